// One MSA attention layer's training step (docs/msa.md §3-5), chaining the public ops:
//
//   indexer(qi, ki)                      -> topk [Hkv, total_q, k], index lse [Hkv, total_q]
//   sparse_attention(q, k, v, topk)      -> o [total_q, Hq, D], lse [total_q, Hq]
//   sparse_attention_backward(..., dO)   -> dq, dk, dv          (skipped when grad_o is undefined)
//   indexer_kl(q, k, lse, qi, ki, topk)  -> loss, dqi, dki
//
// q, k, v get their gradients from the attention only; qi, ki from the KL only (the teacher
// carries no gradient, docs/msa.md §5). The request geometry (cu_seqlens) and every shape are
// validated once and shared by the four ops. On the CPU impls each op runs exactly as through
// its public entry point (msa/ops.h), so results equal calling the ops one by one. On CUDA the
// chain is arranged for speed: the indexer only ranks and the KL computes the index lse
// (returned as index.lse), and for group sizes 1, 2, 4, 8 and 16 the backward hands the KL its
// teacher, the group-mean P it computes anyway (msa/cuda/training.h). The outputs are the same
// up to float rounding (the KL's within ~1e-7 relative of the ops one by one).
//
// Layouts as in msa/ops.h (varlen, queries the suffix of their sequence's keys):
//   q [total_q, Hq, D]   k, v [total_k, Hkv, D]   qi [total_q, Hkv, Di]   ki [total_k, Di]
//   grad_o [total_q, Hq, D]   cu_seqlens_q / cu_seqlens_k int32 [batch + 1]
#pragma once
#include "msa/ops.h"

namespace msa {

struct TrainingStepInputs {
  Tensor q, k, v;
  Tensor qi, ki;
  Tensor grad_o;  // dL/dO from the layers above; undefined: no attention backward
  Tensor cu_seqlens_q, cu_seqlens_k;
  // Optional int32 [Hkv, total_q, k]: selection rows to train with instead of the indexer's
  // (validated like sparse_attention's). The indexer is then skipped: index.topk is this
  // tensor, index.lse is undefined and the KL computes its student LSE over these rows. Two
  // runs on different devices compare bit for bit downstream of the selection this way.
  Tensor selection;
};

struct TrainingStepOutput {
  IndexerOutput index;        // selection rows and the selected index LSE
  AttentionOutput attention;  // o and the main-branch LSE (the KL teacher's normaliser)
  AttentionGrads grads;       // dq, dk, dv (undefined when grad_o is)
  IndexerKlOutput kl;         // loss (scalar), dqi, dki
};

// Throws msa::Error naming the first bad argument before any op runs.
TrainingStepOutput training_step(const TrainingStepInputs& inputs, const MsaParams& params,
                                 Impl impl);

}  // namespace msa
