// The text model's weights in device memory, laid out for the CUDA forward: matrices bf16
// [out, in] (row-major, what gemm.h's linear() takes), norm weights, the router and its
// correction bias f32. Projections that read the same input are stored stacked so that one
// GEMM computes them all:
//   attention:  [q; k; v] rows, plus [index q; index k] on MSA layers   -> qkv
//   MLPs:       [gate; up] rows (w1; w3 for experts)                    -> gate_up
// Host-only header.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cuda/common/device_buffer.h"
#include "msa/model_config.h"
#include "msa/model_weights.h"

namespace msa::model::gpu {

using msa::cuda::DeviceBuffer;

struct DeviceMlp {
  int64_t inter = 0;     // 0: absent (no shared expert)
  DeviceBuffer gate_up;  // bf16 [2 * inter, H]
  DeviceBuffer down;     // bf16 [H, inter]
};

struct DeviceLayer {
  DeviceBuffer input_norm, post_attention_norm;  // f32 [H]
  int64_t qkv_rows = 0;                          // Hq*D + 2*Hkv*D (+ Hi*Di + Di on MSA layers)
  DeviceBuffer qkv;                              // bf16 [qkv_rows, H]
  DeviceBuffer o_proj;                           // bf16 [H, Hq*D]
  DeviceBuffer q_norm, k_norm;                   // f32 [D]
  DeviceBuffer index_q_norm, index_k_norm;       // f32 [Di], MSA layers
  DeviceMlp mlp;                                 // dense-MLP layers
  DeviceBuffer router;                           // f32 [E, H], MoE layers
  DeviceBuffer router_bias;                      // f32 [E]
  int64_t experts = 0;                           // routed experts held: E, or a rank's E / world
  DeviceBuffer experts_gate_up;                  // bf16 [experts, 2 * I, H]
  DeviceBuffer experts_down;                     // bf16 [experts, H, I]
  DeviceMlp shared_expert;
};

struct DeviceWeights {
  DeviceBuffer embed_tokens;  // bf16 [V, H]
  DeviceBuffer final_norm;    // f32 [H]
  DeviceBuffer lm_head;       // bf16 [V, H]
  std::vector<DeviceLayer> layers;
};

// Bytes allocate_device_weights takes for `config`.
size_t device_weight_bytes(const ModelConfig& config);
// Allocates every buffer (contents undefined); throws msa::Error naming the sizes when the
// device lacks the memory.
DeviceWeights allocate_device_weights(const ModelConfig& config);
// The same for one rank of a tensor- / expert-parallel model: `config` is its rank_config
// (its heads and MLP columns; the router whole) and it holds `held_experts` routed experts.
size_t device_weight_bytes(const ModelConfig& config, int64_t held_experts);
DeviceWeights allocate_device_weights(const ModelConfig& config, int64_t held_experts);
// Copies `tensor` (any float dtype, any strides) converted to `dtype` into `dst` at element
// `offset`; its element count must be `expected` (a layout check; msa::Error naming `what`).
void copy_to_device(DeviceBuffer& dst, int64_t offset, const Tensor& tensor, DType dtype,
                    int64_t expected, const std::string& what);

// Copies host weights (f32, bf16 or f16 views, see model_weights.h) in, converting; a rank's
// host weights (load_model_weights with a plan) hold exactly the device's `experts` experts.
void upload_device_weights(const ModelConfig& config, const ModelWeights& host,
                           DeviceWeights& device);

}  // namespace msa::model::gpu
