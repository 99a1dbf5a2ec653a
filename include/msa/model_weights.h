// The MiniMax-M3 text tower's weights, loaded memory-mapped from a Hugging Face checkpoint.
//
// Accepted names: the released checkpoint's (`language_model.model.layers.N...`,
// `block_sparse_moe.experts.E.w1/w2/w3`, `self_attn.index_q_proj`, separate gate/up) and
// the transformers >= 5.12 ones (`model.language_model.layers.N...` or, for the text-only
// class, `model.layers.N...`; `mlp.experts.gate_up_proj` [E, 2I, H], `self_attn.indexer.*`,
// fused `gate_up_proj`). Vision, projector and `mtp.*` tensors are ignored. A missing,
// unexpected or mis-shaped text tensor is an msa::Error naming it.
//
// Matrices stay views into the mapping in the file's dtype (f32, bf16 or f16) and are
// [out, in]; norm weights, router weights and biases are converted to f32. MXFP8 matrices
// (float8_e4m3fn + `<name>_scale_inv`, the MiniMax-M3-MXFP8 release; src/model/mxfp8.h) are
// dequantized to bf16 at load, exactly.
#pragma once
#include <string>
#include <vector>

#include "msa/model_config.h"
#include "msa/safetensors.h"
#include "msa/tensor.h"

namespace msa {

struct ExpertWeights {
  Tensor gate;  // [I, H]  (w1)
  Tensor up;    // [I, H]  (w3)
  Tensor down;  // [H, I]  (w2)
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

struct ModelWeights {
  Tensor embed_tokens;  // [V, H]
  Tensor final_norm;    // f32 [H]
  Tensor lm_head;       // [V, H]
  std::vector<LayerWeights> layers;
  std::string layout;  // "released" or "transformers" (which names the checkpoint used)
};

ModelWeights load_model_weights(const SafetensorsModel& file, const ModelConfig& config);

// Scans every float tensor of the checkpoint (f32, f64, bf16, f16, float8_e4m3fn) for NaN and
// infinities; the first one found is an msa::Error naming the tensor and the index. (`msa
// logits|run --check-weights`: one NaN weight makes every logit NaN, with no other word.)
void check_weights_finite(const SafetensorsModel& file);

}  // namespace msa
