// The varlen training ops on arguments the caller has already validated (shapes, dtypes,
// params) with the request geometry (Batch) computed once: what training_step.cpp chains.
// They are the public ops of msa/ops.h minus their checks (api.cpp), so every Impl behaves
// exactly as through the public entry points.
#pragma once
#include "batch.h"
#include "msa/ops.h"

namespace msa::detail {

// Selection rows and (want_lse) the selected index LSE (docs/msa.md §3).
IndexerOutput validated_indexer(const Tensor& qi, const Tensor& ki, const Batch& batch,
                                const MsaParams& params, Impl impl, bool want_lse = true);

// Sparse attention over `topk` (docs/msa.md §4).
AttentionOutput validated_sparse_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                           const Tensor& topk, const AttentionDims& dims,
                                           const Batch& batch, const MsaParams& params,
                                           Impl impl);

// Its backward given dO.
AttentionGrads validated_sparse_attention_backward(const Tensor& q, const Tensor& k,
                                                   const Tensor& v, const Tensor& topk,
                                                   const AttentionOutput& forward,
                                                   const Tensor& grad_o, const AttentionDims& dims,
                                                   const Batch& batch, const MsaParams& params,
                                                   Impl impl);

// The KL objective of the indexer (docs/msa.md §5); `main_lse` from the sparse forward;
// `index_lse` (optional): the indexer's selected LSE of the same rows, reused by the CUDA KL;
// `index_lse_out` (optional, Impl::cuda, index_lse null): receives the LSE the CUDA KL computed.
IndexerKlOutput validated_indexer_kl(const Tensor& q, const Tensor& k, const Tensor& main_lse,
                                     const Tensor& qi, const Tensor& ki, const Tensor& topk,
                                     const AttentionDims& dims, const Batch& batch,
                                     const MsaParams& params, Impl impl,
                                     const Tensor* index_lse = nullptr, Tensor* index_lse_out = nullptr);

// The backward and the KL of one training step over the same rows. Impl::cuda with a group
// size cuda::backward_writes_kl_teacher takes: the backward writes the KL's teacher on the
// device and the KL reads it instead of recomputing Q K^T and P; otherwise the two ops above
// run one after the other.
struct BackwardAndKl {
  AttentionGrads grads;
  IndexerKlOutput kl;
};
BackwardAndKl validated_backward_and_kl(const Tensor& q, const Tensor& k, const Tensor& v,
                                        const Tensor& topk, const AttentionOutput& forward,
                                        const Tensor& grad_o, const Tensor& qi, const Tensor& ki,
                                        const AttentionDims& dims, const Batch& batch,
                                        const MsaParams& params, Impl impl,
                                        const Tensor* index_lse = nullptr, Tensor* index_lse_out = nullptr);

}  // namespace msa::detail
