// Host interface of the CUDA KL backward of the indexer (docs/msa.md §5), in the style of
// launch.h: a plain struct of device pointers, a workspace query and one launch function.
// Host-only: no CUDA headers. Every pointer is device memory; bf16 values are passed as
// their 16-bit patterns (uint16_t). Varlen layouts only (training).
//
// Outputs: loss = c / (Hi * total_q) * sum_{q,h} KL(p_t || p_s), and the gradients
//   dqi_h(q) = g sum_t (p_s - p_t) ki(t),  dki(t) = g sum_{q,h} (p_s - p_t) qi_h(q),
//   g = logit_scale * loss_scale, with p_t the group-mean main-branch probabilities over the
//   selected tokens and p_s the index softmax of logit_scale * qi.ki over the same tokens.
//
// deterministic = true (default): every sum has a fixed order, so repeated runs are bitwise
// identical (dki from per-work-item partials reduced per key block in a fixed order).
// false: dki is accumulated with atomicAdd (less workspace, one pass fewer; the float
// summation order then varies run to run). loss and dqi are deterministic in both modes.
//
// Launch contract as launch.h's prefill paths: no allocation, no host synchronisation, work
// on the caller's stream only (kernels, CUB sorts and cudaMemsetAsync); the workspace comes
// from indexer_kl_workspace_bytes() of the same params and depends on host-known sizes only.
#pragma once
#include <cstddef>
#include <cstdint>

#include "cuda/launch.h"

namespace msa::cuda {

struct IndexerKlLaunch {
  const uint16_t* q = nullptr;  // [total_q, q_heads, head_dim]
  KeyLayout k;                  // [total_k, kv_heads, head_dim], varlen
  const float* main_lse = nullptr;  // [total_q, q_heads] natural-log LSE of the main branch
  const uint16_t* qi = nullptr;     // [total_q, kv_heads, index_dim] (Hi = kv_heads)
  KeyLayout ki;                     // [total_k, index_dim], one head, varlen
  int64_t q_heads = 0, kv_heads = 0, head_dim = 0, index_dim = 0;
  BatchLayout batch;
  int64_t total_k = 0;  // rows of dki
  const int32_t* topk = nullptr;  // [kv_heads, total_q, slots], -1 suffix
  int64_t slots = 0;
  int block_size = 128;
  float scale = 0;        // main softmax scale
  float logit_scale = 0;  // index_scale / temperature: student logit per raw index score
  // Optional [kv_heads, total_q]: the student LSE the indexer already produced (cuda::indexer's
  // lse_out with this logit_scale, as msa::training_step runs it); null: computed here.
  const float* student_lse = nullptr;
  // Optional [kv_heads, total_q], with student_lse null: receives the student LSE computed here
  // (the selected index LSE, as cuda::indexer's lse_out would give it).
  float* student_lse_out = nullptr;
  // Optional [kv_heads, total_q, slots, block_size]: the teacher p_t of every selection entry
  // as the sparse backward wrote it (AttentionBackwardLaunch::kl_teacher) for the same rows and
  // main branch; q, k, main_lse and scale are then not read. Null: recomputed here from them.
  const float* teacher = nullptr;
  double loss_scale = 0;  // c / (Hi * total_q)
  bool deterministic = true;
  float* loss = nullptr;  // [1]
  float* dqi = nullptr;   // [total_q, kv_heads, index_dim]
  float* dki = nullptr;   // [total_k, index_dim] (dense: ki's token rows)
};

size_t indexer_kl_workspace_bytes(const IndexerKlLaunch& params);
void indexer_kl(const IndexerKlLaunch& params, void* workspace, void* stream);

}  // namespace msa::cuda
