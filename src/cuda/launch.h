// The CUDA kernels' host interface: plain parameter structs of device pointers and one
// launch function per kernel family. Host-only: no CUDA headers, so the ops layer and
// the CPU build never see device code. Every pointer is device memory unless noted.
// bf16 values are passed as their 16-bit patterns (uint16_t).
#pragma once
#include <cstddef>
#include <cstdint>

namespace msa::cuda {

// Keys (or values, or index keys) addressed by (sequence, block, head), as KeyBlocks in
// src/ops/batch.h: varlen when page_table is null (token t of sequence b is token
// seq_token_start[b] + t), else paged (block j of b is page page_table[b * stride + j]).
struct KeyLayout {
  const uint16_t* data = nullptr;  // bf16
  int64_t block_size = 0;
  int64_t token_stride = 0;  // elements between consecutive tokens of one head
  int64_t head_stride = 0;   // elements between heads
  int64_t block_stride = 0;  // elements between blocks (varlen) or pages (paged)
  const int64_t* seq_token_start = nullptr;  // [batch], varlen only
  const int32_t* page_table = nullptr;       // [batch, page_table_stride], paged only
  int64_t page_table_stride = 0;
};

// Request geometry: queries of sequence b are packed rows [q_start[b], q_start[b+1]) and
// sit at the end of its k_len[b] keys (pos = k_len - q_len + i).
struct BatchLayout {
  const int64_t* q_start = nullptr;     // [batch + 1]
  const int64_t* k_len = nullptr;       // [batch]
  const int32_t* seq_of_query = nullptr;  // [total_q]
  int64_t batch = 0;
  int64_t total_q = 0;
  int64_t max_k_len = 0;  // host-known maxima, for grid sizing
  int64_t max_q_len = 0;
};

// Index branch: selection rows [heads, total_q, topk] (msa-spec §3) and optionally the
// selected LSE [heads, total_q] of logit_scale * score.
struct IndexerParams {
  const uint16_t* qi = nullptr;  // [total_q, heads, dim]
  int64_t heads = 0, dim = 0;
  KeyLayout ki;                  // one head
  BatchLayout batch;
  int block_size = 128, topk = 16, local_blocks = 1, init_blocks = 0;
  float logit_scale = 0;         // index_scale / temperature (LSE only)
  int32_t* topk_out = nullptr;   // [heads, total_q, topk]
  float* lse_out = nullptr;      // [heads, total_q] or null
};
size_t indexer_workspace_bytes(const IndexerParams& params);
void indexer(const IndexerParams& params, void* workspace, void* stream);

// Main branch: attention over the selected blocks (topk given) or dense causal (null).
struct AttentionParams {
  const uint16_t* q = nullptr;  // [total_q, q_heads, head_dim]
  KeyLayout k, v;
  int64_t q_heads = 0, kv_heads = 0, head_dim = 0;
  BatchLayout batch;
  const int32_t* topk = nullptr;  // [kv_heads, total_q, slots], -1 ends a row; null = dense
  int64_t slots = 0;
  float scale = 0;
  float* o = nullptr;    // [total_q, q_heads, head_dim]
  float* lse = nullptr;  // [total_q, q_heads]
};
size_t attention_workspace_bytes(const AttentionParams& params);
void attention(const AttentionParams& params, void* workspace, void* stream);

}  // namespace msa::cuda
