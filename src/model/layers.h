// The two halves of a decoder layer: attention (dense or MSA) and the FFN (dense MLP or MoE).
#pragma once
#include <string>
#include <vector>

#include "msa/model.h"
#include "step_batch.h"

namespace msa::model {

// Embedding rows of `tokens` as f32 [tokens, H] (an msa::Error names a token id outside
// the table).
void embed(const Tensor& table, std::span<const int32_t> tokens, float* out);

// xn [T, H] (the input-norm output) -> out [T, H] (after o_proj). Writes the step's K/V and,
// on MSA layers, index keys into the cache before attending.
void attention_forward(const float* xn, const LayerWeights& w, const ModelConfig& config,
                       int64_t layer, std::span<const float> inv_freq, const StepBatch& batch,
                       KvCache& cache, Impl impl, const ForwardTap& tap, float* out);

// SwiGLU-OAI MLP: out [rows, H] = down(act(gate(x), up(x))).
void mlp_forward(const float* x, int64_t rows, const ExpertWeights& w, const ModelConfig& config,
                 float* out);

// One routing decision of a token: the expert and its weight (renormalised, scaled).
struct ExpertChoice {
  int32_t expert = 0;
  float weight = 0;
};
// The router over xn [T, H]: per token its experts_per_token choices in choice order, [T * K].
std::vector<ExpertChoice> route_tokens(const float* xn, int64_t tokens, const LayerWeights& w,
                                       const ModelConfig& config);

// Sigmoid-routed MoE with the shared expert: out [T, H]. When `chosen` is given it receives
// each token's experts_per_token expert ids in choice order ([T, K]; for taps).
void moe_forward(const float* xn, int64_t tokens, const LayerWeights& w, const ModelConfig& config,
                 float* out, int32_t* chosen = nullptr);

}  // namespace msa::model
