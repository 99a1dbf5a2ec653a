// The MiniMax-M3 text tower's weights, loaded memory-mapped from a Hugging Face checkpoint.
//
// Accepted names: the released checkpoint's (`language_model.model.layers.N...`,
// `block_sparse_moe.experts.E.w1/w2/w3`, `self_attn.index_q_proj`, separate gate/up) and
// the transformers >= 5.12 ones (`model.language_model.layers.N...` or, for the text-only
// class, `model.layers.N...`; `mlp.experts.gate_up_proj` [E, 2I, H], `self_attn.indexer.*`,
// fused `gate_up_proj`). `mtp.*` tensors are ignored. A missing, unexpected or mis-shaped
// tensor is an msa::Error naming it.
//
// With a vision_config the vision tower and projector load too (VisionWeights), under the
// release's names (`vision_tower.vision_model.embeddings.patch_embedding`, `...pre_layrnorm`,
// `...encoder.layers.N.{layer_norm1,self_attn.q_proj,mlp.fc1,...}`,
// `multi_modal_projector.linear_{1,2}`, `patch_merge_mlp.linear_{1,2}`) or transformers'
// (`model.vision_tower.embeddings.proj`, `model.vision_tower.layers.N...`,
// `model.multi_modal_projector.{linear_1,linear_2,merge_linear_1,merge_linear_2}`); without
// one (a text-only config.json) those tensors are ignored.
//
// Matrices stay views into the mapping in the file's dtype (f32, bf16 or f16) and are
// [out, in]; norm weights, router weights and biases are converted to f32. MXFP8 matrices
// (float8_e4m3fn + `<name>_scale_inv`, the MiniMax-M3-MXFP8 release; src/model/mxfp8.h) are
// dequantized to bf16 at load, exactly; NVFP4 routed experts (ModelOpt's export) are
// dequantized to bf16 too. With WeightLoadOptions::routed_experts = quantized (the CUDA model's
// choice) the routed experts of such a checkpoint stay as stored instead: codes, block scales
// and global scale (ExpertWeights::quantized), for the CUDA expert kernels that widen them in
// registers.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "msa/model_config.h"
#include "msa/safetensors.h"
#include "msa/tensor.h"

namespace msa {

// How a quantized matrix [out, in] is stored (src/model/mxfp8.h, src/model/nvfp4.h).
enum class QuantizedFormat : uint8_t { none, mxfp8, nvfp4 };
const char* quantized_format_name(QuantizedFormat format);  // "floats" (none), "mxfp8", "nvfp4"

// A matrix [out, in] as the checkpoint stores it (views into the mapping, or the rank's rows):
//   mxfp8: codes float8_e4m3fn [out, in], scales uint8 UE8M0 [out, ceil(in / 32)], global 1;
//   nvfp4: codes uint8 [out, in / 2] (two e2m1, low nibble first), scales float8_e4m3fn
//          [out, in / 16], global_scale the tensor's `_scale_2`.
struct QuantizedMatrix {
  QuantizedFormat format = QuantizedFormat::none;
  Tensor codes;
  Tensor scales;
  float global_scale = 1;
};

// A routed expert kept quantized: all three matrices in one format (the layer's).
struct QuantizedExpert {
  QuantizedMatrix gate;  // [I, H]  (w1)
  QuantizedMatrix up;    // [I, H]  (w3)
  QuantizedMatrix down;  // [H, I]  (w2)
  QuantizedFormat format() const { return gate.format; }
};

struct ExpertWeights {
  Tensor gate;  // [I, H]  (w1)
  Tensor up;    // [I, H]  (w3)
  Tensor down;  // [H, I]  (w2)
  // Routed experts loaded with RoutedExperts::quantized from an MXFP8 / NVFP4 checkpoint: the
  // stored matrices (format != none), and gate / up / down are undefined.
  QuantizedExpert quantized;
  bool is_quantized() const { return quantized.format() != QuantizedFormat::none; }
};

struct LayerWeights {
  Tensor input_norm, post_attention_norm;  // f32 [H]
  Tensor q_proj, k_proj, v_proj, o_proj;   // [Hq*D, H], [Hkv*D, H] x2, [H, Hq*D]
  Tensor q_norm, k_norm;                   // f32 [D]
  // MSA layers only.
  Tensor index_q_proj, index_k_proj;  // [Hi*Di, H], [Di, H]
  Tensor index_q_norm, index_k_norm;  // f32 [Di]
  // Dense MLP layers: `mlp`; MoE layers: router, experts and the shared expert.
  ExpertWeights mlp;
  Tensor router;       // f32 [E, H]
  Tensor router_bias;  // f32 [E] (e_score_correction_bias, selection only)
  std::vector<ExpertWeights> experts;
  ExpertWeights shared_expert;  // undefined tensors when the config has none
};

// A linear layer with bias: weight [out, in] as stored (f32, bf16 or f16), bias f32 [out].
struct LinearWeights {
  Tensor weight;
  Tensor bias;
};
// LayerNorm affine parameters, f32 [dim] each.
struct LayerNormWeights {
  Tensor weight;
  Tensor bias;
};

struct VisionLayerWeights {
  LayerNormWeights norm1, norm2;                  // layer_norm1 (attention), layer_norm2 (MLP)
  LinearWeights q_proj, k_proj, v_proj, out_proj;  // [Hv, Hv]
  LinearWeights fc1;                               // [I, Hv]
  LinearWeights fc2;                               // [Hv, I]
};

struct VisionWeights {
  // The Conv3d kernel [Hv, C, T, P, P] (kernel = stride, no bias) flattened to the GEMM it
  // is: f32 [Hv, C*T*P*P], columns in pixel_values' [C][T][P][P] order.
  Tensor patch_embedding;
  LayerNormWeights pre_norm;  // pre_layrnorm
  std::vector<VisionLayerWeights> layers;
  // Projector: per patch linear_1 [Hp, Hv] and linear_2 [H, Hp]; per merge window of
  // m*m patches merge_linear_1 [Hp, m*m*H] and merge_linear_2 [H, Hp] (release:
  // patch_merge_mlp.linear_{1,2}).
  LinearWeights linear_1, linear_2, merge_linear_1, merge_linear_2;
};

struct ModelWeights {
  Tensor embed_tokens;  // [V, H]
  Tensor final_norm;    // f32 [H]
  Tensor lm_head;       // [V, H]
  std::vector<LayerWeights> layers;
  std::optional<VisionWeights> vision;  // when the config has a vision_config
  std::string layout;  // "released" or "transformers" (which names the checkpoint used)
};

// What the loader makes of the routed experts of an MXFP8 / NVFP4 checkpoint.
enum class RoutedExperts {
  dequantized,  // bf16 gate / up / down (what the CPU model reads)
  quantized,    // ExpertWeights::quantized as stored (what the CUDA expert kernels read)
};
struct WeightLoadOptions {
  // quantized: every MoE layer's routed experts (all three matrices of all its experts) must
  // share one format, else an msa::Error naming the first tensor that differs; a layer stored
  // as floats loads as floats. The values are checked as the dequantizing loader checks them
  // (no NaN code or scale, no value that overflows bf16). Other matrices (attention, dense MLP,
  // shared expert) are dequantized as always.
  RoutedExperts routed_experts = RoutedExperts::dequantized;
};

ModelWeights load_model_weights(const SafetensorsModel& file, const ModelConfig& config,
                                const WeightLoadOptions& options = {});

// One tensor- / expert-parallel rank's part (msa/model_shard.h, docs/parallel.md): q/k/v,
// index-query and gate/up rows of its heads and columns stay views into the mapping; o_proj's
// and down's owned columns are copied (a column slice is not contiguous); `experts` holds its
// experts only (expert plan.expert_begin + i at i); norms, router, embedding and lm_head whole.
// MXFP8 matrices are sliced before they are dequantized; routed experts kept quantized are
// whole experts' codes and scales. Other ranks' experts are still
// checked for presence, shape and dtype (not their values), so a missing or mis-shaped tensor
// is reported on every rank. A plan of one rank
// loads exactly what load_model_weights(file, config) does.
struct ShardPlan;
ModelWeights load_model_weights(const SafetensorsModel& file, const ModelConfig& config,
                                const ShardPlan& plan, const WeightLoadOptions& options = {});

// Scans every float tensor of the checkpoint (f32, f64, bf16, f16, float8_e4m3fn) for NaN and
// infinities; the first one found is an msa::Error naming the tensor and the index. (`msa
// logits|run --check-weights`: one NaN weight makes every logit NaN, with no other word.)
void check_weights_finite(const SafetensorsModel& file);

}  // namespace msa
