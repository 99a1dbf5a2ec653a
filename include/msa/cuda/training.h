// MSA training on the GPU (docs/msa.md, "Backward" and "KL objective"): the main branch's
// backward (sparse or dense causal) and the indexer's KL loss with its gradients. Packed
// (varlen) layouts only. Public device API: see msa/cuda/types.h for the launch contract.
// Kernels: src/cuda/training/.
#pragma once
#include "msa/cuda/types.h"

namespace msa::cuda {

// dQ, dK, dV of attention over the selected blocks (topk given) or dense causal (null):
//   P = exp(scale q.k - LSE), dP = dO V^T, Delta = rowsum(dO * O), dS = P (dP - Delta),
//   dQ = scale dS K, dK = scale dS^T Q, dV = P^T dO  (dK, dV summed over the group's heads).
// deterministic (default): every output has one writer and a fixed summation order, so
// repeated runs are bitwise identical; false: dQ accumulates with float atomics (less work
// and workspace). dK and dV are summed in a fixed order in both modes.
struct AttentionBackwardParams {
  const uint16_t* q = nullptr;       // [total_q, q_heads, head_dim] bf16
  Keys k, v;                         // packed [total_k, kv_heads, head_dim] bf16
  const uint16_t* o = nullptr;       // [total_q, q_heads, head_dim] forward output, bf16
  const uint16_t* grad_o = nullptr;  // [total_q, q_heads, head_dim] dL/dO, bf16
  const float* lse = nullptr;        // [total_q, q_heads] forward LSE, natural log
  int64_t q_heads = 0, kv_heads = 0, head_dim = 0;  // head_dim 64 or 128, group 1..16
  int64_t total_k = 0;  // rows of k / dk (keys no query reads get zero gradients)
  Sequences seqs;       // packed keys: cu_seqlens_k
  int64_t block_size = 128;
  const int32_t* topk = nullptr;  // [kv_heads, total_q, slots], -1 suffix; null = dense causal
  int64_t slots = 0;
  float scale = 0;
  bool deterministic = true;
  float* dq = nullptr;  // [total_q, q_heads, head_dim]
  float* dk = nullptr;  // [total_k, kv_heads, head_dim] at k's element offsets
  float* dv = nullptr;  // [total_k, kv_heads, head_dim]
  int64_t max_chunk_queries = 0;  // > 0 caps the sparse backward's query chunks (tests)
  // The dK / dV kernel's tile engine: automatic picks the warpgroup-MMA kernel where it runs
  // (head_dim = block_size = 128), mma.sync elsewhere; wgmma elsewhere is an error.
  Engine engine = Engine::automatic;
  // Optional, sparse only: [kv_heads, total_q, slots, block_size] f32. The backward also writes
  // the KL's teacher p_t(g, q, t) = (1/G) sum_{r in group g} P_r(q, t) of every selection entry
  // topk[g, q, s] over its block's keys (0 past the query's position), from the P it computes
  // anyway; pass it to indexer_kl's `teacher` to skip the KL's own Q K^T. Entries the rows do
  // not name (slots of -1) are not written. Group sizes 1, 2, 4, 8 and 16
  // (backward_writes_kl_teacher); others are an error.
  float* kl_teacher = nullptr;
};
// Whether attention_backward can write kl_teacher for this group size (q_heads / kv_heads).
constexpr bool backward_writes_kl_teacher(int64_t group) {
  return group == 1 || group == 2 || group == 4 || group == 8 || group == 16;
}
size_t attention_backward_workspace_bytes(const AttentionBackwardParams& params);
void attention_backward(const AttentionBackwardParams& params, void* workspace, Stream stream);

// KL(p_t || p_s) of the indexer and its gradients in qi and ki (the teacher p_t, the
// group-mean main-branch probabilities over the selected tokens, is detached):
//   loss = loss_scale * sum_{q,h} KL(p_t || p_s),   loss_scale = c / (Hi * total_q)
//   dqi_h(q) = g sum_t (p_s - p_t) ki(t),  dki(t) = g sum_{q,h} (p_s - p_t) qi_h(q),
//   g = logit_scale * loss_scale,  p_s = softmax_T(logit_scale * qi.ki).
// deterministic (default): bitwise repeatable; false: dki accumulates with atomics.
struct IndexerKlParams {
  const uint16_t* q = nullptr;      // [total_q, q_heads, head_dim] bf16
  Keys k;                           // packed [total_k, kv_heads, head_dim] bf16
  const float* main_lse = nullptr;  // [total_q, q_heads] natural-log LSE of the main branch
  const uint16_t* qi = nullptr;     // [total_q, kv_heads, index_dim] bf16 (Hi = kv_heads)
  Keys ki;                          // packed [total_k, index_dim] bf16, one head
  int64_t q_heads = 0, kv_heads = 0, head_dim = 0, index_dim = 0;
  int64_t total_k = 0;              // rows of dki
  Sequences seqs;                   // packed keys: cu_seqlens_k
  const int32_t* topk = nullptr;    // [kv_heads, total_q, slots], -1 suffix
  int64_t slots = 0;
  int block_size = 128;
  float scale = 0;        // main softmax scale
  float logit_scale = 0;  // index_scale / temperature
  // Optional [kv_heads, total_q]: the student LSE indexer() already produced with this
  // logit_scale; null: computed here (on the tensor cores, over the selection's blocks).
  const float* student_lse = nullptr;
  // Optional [kv_heads, total_q], with student_lse null: receives the student LSE computed here,
  // the selected index LSE indexer()'s lse_out would give. A training step is faster this way
  // than with the indexer's lse_out (msa::training_step on CUDA does it: bench/results/h200.md).
  float* student_lse_out = nullptr;
  // Optional [kv_heads, total_q, slots, block_size]: the teacher attention_backward wrote into
  // its kl_teacher for the same selection rows and main branch. q, k, main_lse and scale are
  // then not read (they may be null). Null: the teacher is recomputed from them.
  const float* teacher = nullptr;
  double loss_scale = 0;
  bool deterministic = true;
  float* loss = nullptr;  // [1]
  float* dqi = nullptr;   // [total_q, kv_heads, index_dim]
  float* dki = nullptr;   // [total_k, index_dim]
};
size_t indexer_kl_workspace_bytes(const IndexerKlParams& params);
void indexer_kl(const IndexerKlParams& params, void* workspace, Stream stream);

}  // namespace msa::cuda
