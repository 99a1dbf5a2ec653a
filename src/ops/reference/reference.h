// The plain reference: docs/msa.md written as straight loops in f64. Obviously right first,
// fast never. Every other implementation is tested against these.
#pragma once
#include <cstdint>
#include <vector>

#include "../batch.h"

namespace msa::detail::ref {


// O [total_q, Hq, D] and LSE [total_q, Hq] of attention over the keys t <= pos of the
// blocks each query reads. Empty sets give O = 0, LSE = -inf.
void attention_forward(const double* q, const KeyBlocks<double>& k, const KeyBlocks<double>& v,
                       const AttentionDims& dims, const Batch& batch, BlockSource blocks,
                       double scale, double* o, double* lse);

// dQ, dK, dV of the same function; dk/dv have k's layout and are accumulated into
// (the caller zeroes them).
void attention_backward(const double* q, const KeyBlocks<double>& k, const KeyBlocks<double>& v,
                        const AttentionDims& dims, const Batch& batch, BlockSource blocks,
                        double scale, const double* o, const double* lse, const double* grad_o,
                        double* dq, double* dk, double* dv);

// The values the selection ranks by, when they differ from the scored ones (index_compute
// fp8: the fp8-dequantized qi [total_q, Hi, Di] and keys, same layouts as qi and ki).
struct RankingInputs {
  const double* qi = nullptr;
  const KeyBlocks<double>* ki = nullptr;
};

// Selection rows [Hi, total_q, k] and, when `lse` is not null, the selected LSE [Hi, total_q].
// With `ranking`, block maxima come from ranking's qi . ki; the LSE always from qi . ki.
void indexer(const double* qi, int64_t index_heads, int64_t index_dim,
             const KeyBlocks<double>& ki, const Batch& batch, const MsaParams& params,
             double index_scale, int32_t* topk, double* lse,
             const RankingInputs* ranking = nullptr);

// KL loss of docs/msa.md §5; writes dqi [total_q, Hi, Di] and accumulates into dki (ki's
// layout, zeroed by the caller).
double indexer_kl(const double* q, const KeyBlocks<double>& k, const double* main_lse,
                  const AttentionDims& dims, const double* qi, const KeyBlocks<double>& ki,
                  int64_t index_dim, const Batch& batch, BlockSource selection,
                  const MsaParams& params, double scale, double index_scale, double* dqi,
                  double* dki);

// Writes `values` [T, Hkv, D] (float, any dtype) into the paged cache `cache` [pages, Hkv, B, D]
// at `slots` (page * B + row; negative: skipped; validated): a float cache stores the values
// rounded to its dtype; an e4m3 cache quantizes them (msa/quantized_kv_cache.h) with `scale`,
// f32 [pages, Hkv, B] per token and head (written) or [1] per tensor (read).
void append_kv(const Tensor& values, const std::vector<int64_t>& slots, const Tensor& cache,
               const Tensor& scale);

}  // namespace msa::detail::ref
