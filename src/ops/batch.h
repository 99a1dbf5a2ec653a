// Request geometry shared by every op: where each sequence's queries and keys are, and
// how keys are laid out in blocks (packed varlen tensors or a paged cache).
#pragma once
#include <cstdint>
#include <vector>

#include "msa/ops.h"

namespace msa::detail {

// Validated batch geometry. Queries of sequence b occupy packed rows
// [q_start[b], q_start[b+1]) and sit at the end of its k_len[b] keys.
struct Batch {
  std::vector<int64_t> q_start;        // [batch + 1]
  std::vector<int64_t> k_len;          // [batch]
  std::vector<int64_t> k_start;        // [batch] packed key offsets (varlen only)
  std::vector<int32_t> seq_of_query;   // [total_q]
  // Causal (the default): query row r sees keys 0 .. pos(r). Bidirectional (dense attention
  // with MsaParams::causal = false): every query sees all k_len keys of its sequence.
  bool causal = true;
  int64_t size() const { return static_cast<int64_t>(k_len.size()); }
  int64_t total_q() const { return q_start.back(); }
  int64_t q_len(int64_t b) const { return q_start[b + 1] - q_start[b]; }
  // Position of packed query row `row` in its sequence (bottom-right aligned).
  int64_t pos(int64_t row) const {
    const int64_t b = seq_of_query[row];
    return k_len[b] - q_len(b) + (row - q_start[b]);
  }
  // The last key position packed query row `row` attends to: pos(row) when causal, else
  // the last key of its sequence.
  int64_t last_key(int64_t row) const {
    return causal ? pos(row) : k_len[seq_of_query[row]] - 1;
  }
};

// Keys (or values, or index keys) of every sequence, addressed by (sequence, block, head).
// Varlen: token t of sequence b is row seq_token_start[b] + t of a [total, H, D] tensor.
// Paged:  block j of sequence b is page page_table[b][j] of a [pages, H, B, D] cache.
template <class T>
struct KeyBlocks {
  const T* data = nullptr;
  int64_t block_size = 0;
  int64_t token_stride = 0;  // elements between consecutive tokens of one head
  int64_t head_stride = 0;   // elements between heads of one token / page
  int64_t block_stride = 0;  // elements between blocks (varlen) or pages (paged)
  const int64_t* seq_token_start = nullptr;  // varlen only
  const int32_t* page_table = nullptr;       // paged only
  int64_t page_table_stride = 0;
  int64_t dim = 0;  // elements of one token's row of one head (contiguous)

  const T* block(int64_t seq, int64_t block_id, int64_t head) const {
    if (page_table)
      return data + page_table[seq * page_table_stride + block_id] * block_stride +
             head * head_stride;
    return data + seq_token_start[seq] * token_stride + block_id * block_stride +
           head * head_stride;
  }
  const T* token(int64_t seq, int64_t t, int64_t head) const {
    return block(seq, t / block_size, head) + (t % block_size) * token_stride;
  }
};

// Varlen tensor [total, heads, dim] as blocks. `seq_token_start` must outlive the view.
template <class T>
KeyBlocks<T> varlen_blocks(const T* data, int64_t heads, int64_t dim, int64_t block_size,
                           const std::vector<int64_t>& seq_token_start) {
  return {.data = data,
          .block_size = block_size,
          .token_stride = heads * dim,
          .head_stride = dim,
          .block_stride = block_size * heads * dim,
          .seq_token_start = seq_token_start.data(),
          .dim = dim};
}

// Paged cache [pages, heads, B, dim] as blocks.
template <class T>
KeyBlocks<T> paged_blocks(const T* data, int64_t heads, int64_t dim, int64_t block_size,
                          const int32_t* page_table, int64_t page_table_stride) {
  return {.data = data,
          .block_size = block_size,
          .token_stride = dim,
          .head_stride = block_size * dim,
          .block_stride = heads * block_size * dim,
          .page_table = page_table,
          .page_table_stride = page_table_stride,
          .dim = dim};
}

// Which blocks query `row` of KV group `group` reads: the selection row when `topk` is
// given ([groups, total_q, slots], -1 ends a row), else every block up to its own (dense).
struct BlockSource {
  const int32_t* topk = nullptr;
  int64_t slots = 0;
};

// Attention geometry common to the main-branch ops.
struct AttentionDims {
  int64_t q_heads = 0, kv_heads = 0, head_dim = 0;
  int64_t group_size() const { return q_heads / kv_heads; }
};

}  // namespace msa::detail
