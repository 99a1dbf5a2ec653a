// training_step (msa/training.h): validates every input and the request geometry once, then
// chains the four varlen ops on validated arguments (validated_ops.h).
#include "msa/training.h"

#include <utility>

#include "checks.h"
#include "validated_ops.h"

namespace msa {

using namespace detail;

TrainingStepOutput training_step(const TrainingStepInputs& in, const MsaParams& params,
                                 Impl impl) {
  validate_params(params);
  const AttentionDims dims = check_qkv(in.q, in.k, in.v);
  check_shape(in.qi, "qi", {in.q.size(0), dims.kv_heads, -1});
  check_float(in.qi, "qi");
  if (in.qi.size(2) < 1) throw_arg_error("qi", "an index head dim of at least 1", in.qi.size(2));
  check_shape(in.ki, "ki", {in.k.size(0), in.qi.size(2)});
  check_float(in.ki, "ki");
  if (in.grad_o.defined()) {
    check_shape(in.grad_o, "grad_o", {in.q.size(0), in.q.size(1), in.q.size(2)});
    check_float(in.grad_o, "grad_o");
  }
  const Batch batch = varlen_batch(in.cu_seqlens_q, in.cu_seqlens_k, in.q.size(0), in.k.size(0));

  TrainingStepOutput out;
  if (in.selection.defined()) {
    check_shape(in.selection, "selection", {dims.kv_heads, in.q.size(0), params.topk});
    check_selection(in.selection, batch, dims.kv_heads, params.block_size);
    out.index.topk = in.selection;
  }
  // On CUDA the indexer only ranks (its prefill kernels) and the KL computes the selected index
  // LSE on the tensor cores and hands it back: measured faster than the indexer's LSE-producing
  // scan (bench/results/h200.md, "the student LSE"). The CPU ops compute it in the indexer.
  const bool lse_from_kl = impl == Impl::cuda && !in.selection.defined();
  if (!in.selection.defined()) out.index = validated_indexer(in.qi, in.ki, batch, params, impl, !lse_from_kl);
  out.attention =
      validated_sparse_attention(in.q, in.k, in.v, out.index.topk, dims, batch, params, impl);
  // The indexer's selected LSE is the KL's student LSE: computed once, by either.
  const Tensor* index_lse = out.index.lse.defined() ? &out.index.lse : nullptr;
  Tensor* index_lse_out = lse_from_kl ? &out.index.lse : nullptr;
  if (in.grad_o.defined()) {  // the backward hands the KL its teacher where it can (CUDA)
    BackwardAndKl both = validated_backward_and_kl(in.q, in.k, in.v, out.index.topk, out.attention, in.grad_o,
                                                   in.qi, in.ki, dims, batch, params, impl, index_lse,
                                                   index_lse_out);
    out.grads = std::move(both.grads);
    out.kl = std::move(both.kl);
    return out;
  }
  out.kl = validated_indexer_kl(in.q, in.k, out.attention.lse, in.qi, in.ki, out.index.topk, dims,
                                batch, params, impl, index_lse, index_lse_out);
  return out;
}

}  // namespace msa
