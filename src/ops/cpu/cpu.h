// The optimised CPU implementations: f32 storage and arithmetic (f32 accumulation),
// threads over queries/heads (OpenMP), vectorised inner loops, no token-score matrices.
// Same contracts as the reference in ../reference/reference.h.
#pragma once
#include <cstdint>

#include "../batch.h"

namespace msa::detail::cpu {

void attention_forward(const float* q, const KeyBlocks<float>& k, const KeyBlocks<float>& v,
                       const AttentionDims& dims, const Batch& batch, BlockSource blocks,
                       float scale, float* o, float* lse);

// dk/dv have k's layout and are accumulated into (the caller zeroes them). Deterministic:
// the same inputs give bitwise-identical gradients for a fixed thread count.
void attention_backward(const float* q, const KeyBlocks<float>& k, const KeyBlocks<float>& v,
                        const AttentionDims& dims, const Batch& batch, BlockSource blocks,
                        float scale, const float* o, const float* lse, const float* grad_o,
                        float* dq, float* dk, float* dv);

// lse may be null (inference needs only the rows).
void indexer(const float* qi, int64_t index_heads, int64_t index_dim, const KeyBlocks<float>& ki,
             const Batch& batch, const MsaParams& params, float index_scale, int32_t* topk,
             float* lse);

// Returns the loss; dki is accumulated into (the caller zeroes it).
double indexer_kl(const float* q, const KeyBlocks<float>& k, const float* main_lse,
                  const AttentionDims& dims, const float* qi, const KeyBlocks<float>& ki,
                  int64_t index_dim, const Batch& batch, BlockSource selection,
                  const MsaParams& params, float scale, float index_scale, float* dqi,
                  float* dki);

}  // namespace msa::detail::cpu
