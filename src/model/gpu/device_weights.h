// The text model's weights in device memory, laid out for the CUDA forward: matrices bf16
// [out, in] (row-major, what gemm.h's linear() takes), norm weights, the router and its
// correction bias f32. Projections that read the same input are stored stacked so that one
// GEMM computes them all:
//   attention:  [q; k; v] rows, plus [index q; index k] on MSA layers   -> qkv
//   MLPs:       [gate; up] rows (w1; w3 for experts)                    -> gate_up
// Routed experts are bf16, or (ExpertWeights mxfp8 / nvfp4, kernels.h) the checkpoint's codes
// and scales as stored, [gate; up] stacked the same way, which the expert kernels widen in
// registers: nothing dequantizes them in device memory.
// Host-only header.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cuda/common/device_buffer.h"
#include "kernels.h"
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
  ExpertWeights expert_format = ExpertWeights::bf16;
  // bf16 [experts, 2 * I, H] / [experts, H, I]; mxfp8: e4m3 codes of those shapes; nvfp4:
  // packed e2m1 [experts, 2 * I, H / 2] / [experts, H, I / 2].
  DeviceBuffer experts_gate_up;
  DeviceBuffer experts_down;
  // Quantized formats only. Block scales: mxfp8 UE8M0 [experts, 2 * I, H / 32] / [experts, H,
  // I / 32]; nvfp4 e4m3 [experts, 2 * I, H / 16] / [experts, H, I / 16].
  DeviceBuffer experts_gate_up_scales, experts_down_scales;
  // nvfp4 only: f32 global scale per output row [experts, 2 * I] (gate's in the first I rows,
  // up's in the next I) / [experts, H].
  DeviceBuffer experts_gate_up_global, experts_down_global;
  DeviceMlp shared_expert;
};

// The expert kernels' view of a layer's routed-expert weights (format bf16: all null, the
// weights are experts_gate_up / experts_down as bf16).
QuantizedExpertWeights gate_up_expert_weights(const DeviceLayer& layer);
QuantizedExpertWeights down_expert_weights(const DeviceLayer& layer);

struct DeviceWeights {
  DeviceBuffer embed_tokens;  // bf16 [V, H]
  DeviceBuffer final_norm;    // f32 [H]
  DeviceBuffer lm_head;       // bf16 [V, H]
  std::vector<DeviceLayer> layers;
};

// Bytes allocate_device_weights takes for `config` with routed experts in `experts` format
// (the real bytes: codes, scales and global scales for the quantized formats).
size_t device_weight_bytes(const ModelConfig& config, ExpertWeights experts = ExpertWeights::bf16);
// Allocates every buffer (contents undefined); throws msa::Error naming the sizes when the
// device lacks the memory, or (quantized `experts`) when hidden_size or moe_intermediate_size
// is not a multiple of the format's scale block (expert_weights_in_multiple).
DeviceWeights allocate_device_weights(const ModelConfig& config, ExpertWeights experts = ExpertWeights::bf16);
// The same for one rank of a tensor- / expert-parallel model: `config` is its rank_config
// (its heads and MLP columns; the router whole) and it holds `held_experts` routed experts.
size_t device_weight_bytes(const ModelConfig& config, int64_t held_experts,
                           ExpertWeights experts = ExpertWeights::bf16);
DeviceWeights allocate_device_weights(const ModelConfig& config, int64_t held_experts,
                                      ExpertWeights experts = ExpertWeights::bf16);
// The routed experts' format of host weights (load_model_weights): bf16 for float experts,
// mxfp8 / nvfp4 for experts kept quantized (WeightLoadOptions); an msa::Error when MoE layers
// differ (the device holds one format).
ExpertWeights host_expert_format(const ModelConfig& config, const ModelWeights& host);
// Copies `tensor` (any float dtype, any strides) converted to `dtype` into `dst` at element
// `offset`; its element count must be `expected` (a layout check; msa::Error naming `what`).
void copy_to_device(DeviceBuffer& dst, int64_t offset, const Tensor& tensor, DType dtype,
                    int64_t expected, const std::string& what);

// Copies host weights (f32, bf16 or f16 views, see model_weights.h) in, converting; a rank's
// host weights (load_model_weights with a plan) hold exactly the device's `experts` experts.
// Routed experts kept quantized are copied verbatim (codes and scales as stored, the global
// scales spread over their rows) into a device of the same format; a format that differs from
// the device's is an msa::Error naming the layer.
void upload_device_weights(const ModelConfig& config, const ModelWeights& host,
                           DeviceWeights& device);

}  // namespace msa::model::gpu
