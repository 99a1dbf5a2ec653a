// Host interface of the CUDA backward of the main branch (docs/msa.md §4 "Backward"), sparse
// (selection rows given) or dense causal GQA (topk null), in the style of launch.h: a plain
// struct of device pointers, a workspace query and one launch function. Host-only: no CUDA
// headers. Every pointer is device memory; bf16 values are passed as their 16-bit patterns.
// Training layout only: packed varlen tensors, no page table.
//
// Math, per q-head r of group g = r / G, over its visible keys T (selected blocks' tokens
// t <= pos, or all t <= pos when dense):
//   P = exp(scale q.k - LSE), dP = dO V^T, Delta = rowsum(dO * O), dS = P (dP - Delta),
//   dQ = scale dS K, dK = scale dS^T Q, dV = P^T dO   (dK, dV summed over the group's heads).
//
// Modes (dK and dV are summed in a fixed order in both: bitwise identical run to run):
//   deterministic = true (default): dQ has one writer per element too, so repeated runs are
//     bitwise identical. Sparse: f32 dQ partials per (query, group, slot), summed in slot
//     order; dense: a query-major dQ kernel.
//   deterministic = false: dQ is accumulated with float atomics by the KV-block-major kernel
//     (less work and workspace; the summation order varies run to run).
//
// Launch contract as launch.h's prefill paths: no allocation, no host synchronisation, work
// on the caller's stream only (kernels, CUB sorts, cudaMemsetAsync); the workspace comes from
// attention_backward_workspace_bytes() of the same params and depends on host-known sizes.
// Supported: head_dim 64 or 128, block_size 64 or 128, group size 1..16.
#pragma once
#include <cstddef>
#include <cstdint>

#include "cuda/launch.h"

namespace msa::cuda {

struct AttentionBackwardLaunch {
  const uint16_t* q = nullptr;       // [total_q, q_heads, head_dim]
  KeyLayout k, v;                    // [total_k, kv_heads, head_dim], varlen (no page table)
  const uint16_t* o = nullptr;       // [total_q, q_heads, head_dim] forward output
  const uint16_t* grad_o = nullptr;  // [total_q, q_heads, head_dim] dL/dO
  const float* lse = nullptr;        // [total_q, q_heads] forward LSE, natural log
  int64_t q_heads = 0, kv_heads = 0, head_dim = 0;
  int64_t total_k = 0;  // rows of k / dk (the grads of keys no query reads are zero)
  BatchLayout batch;
  const int32_t* topk = nullptr;  // [kv_heads, total_q, slots], -1 suffix; null = dense causal
  int64_t slots = 0;
  float scale = 0;
  bool deterministic = true;
  float* dq = nullptr;  // [total_q, q_heads, head_dim]
  float* dk = nullptr;  // [total_k, kv_heads, head_dim] (k's element offsets)
  float* dv = nullptr;  // [total_k, kv_heads, head_dim]
  int64_t max_chunk_queries = 0;  // > 0 caps the sparse backward's query chunks
  // The KV-block-major tile engine: wgmma (head_dim = block_size = 128) or mma.sync.
  Engine engine = Engine::automatic;
  // Sparse, optional: [kv_heads, total_q, slots, block_size] f32, the KL's teacher of every
  // selection entry (IndexerKlLaunch::teacher); group sizes 1, 2, 4, 8, 16.
  float* kl_teacher = nullptr;
};

size_t attention_backward_workspace_bytes(const AttentionBackwardLaunch& params);
void attention_backward(const AttentionBackwardLaunch& params, void* workspace, void* stream);

}  // namespace msa::cuda
