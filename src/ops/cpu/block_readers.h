// Block bookkeeping shared by the CPU backward passes (attention_backward_cpu.cpp,
// kl_cpu.cpp): which blocks a query reads and, inverted, which queries read a block.
// Private to src/ops/cpu.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu.h"

namespace msa::detail::cpu {

// The blocks one query reads: ids[0, count) of its selection row, or 0..count-1 (dense).
struct QueryBlocks {
  const int32_t* ids = nullptr;
  int64_t count = 0;
  int64_t operator[](int64_t i) const { return ids ? ids[i] : i; }
};

inline QueryBlocks blocks_read_by(BlockSource source, const Batch& batch, int64_t row,
                                  int64_t group, int64_t block_size) {
  if (!source.topk) return {nullptr, batch.last_key(row) / block_size + 1};
  const int32_t* ids = source.topk + (group * batch.total_q() + row) * source.slots;
  int64_t count = 0;
  while (count < source.slots && ids[count] >= 0) ++count;
  return {ids, count};
}

// Key blocks of all sequences numbered globally: block j of sequence b is first[b] + j.
inline std::vector<int64_t> first_global_blocks(const Batch& batch, int64_t block_size) {
  std::vector<int64_t> first(batch.size() + 1, 0);
  for (int64_t b = 0; b < batch.size(); ++b)
    first[b + 1] = first[b] + (batch.k_len[b] + block_size - 1) / block_size;
  return first;
}

// The query rows reading one block, ascending: rows[begin, end), or the range itself
// when `rows` is null (dense attention, where the readers are a suffix of the sequence).
struct Readers {
  const int32_t* rows = nullptr;
  int64_t begin = 0, end = 0;
  int64_t operator[](int64_t i) const { return rows ? rows[i] : i; }
};

// The selection inverted: for each (group, global block), its readers in row order (CSR).
// Same size as the selection itself.
class BlockReaderIndex {
 public:
  BlockReaderIndex(BlockSource source, const Batch& batch, int64_t groups,
                   const std::vector<int64_t>& first_block, int64_t block_size)
      : source_(source), batch_(batch), first_block_(first_block), block_size_(block_size) {
    if (!source.topk) return;
    const int64_t total_blocks = first_block.back();
    offsets_.assign(groups * total_blocks + 1, 0);
    for (int64_t group = 0; group < groups; ++group)
      for (int64_t row = 0; row < batch.total_q(); ++row) {
        const QueryBlocks blocks = blocks_read_by(source, batch, row, group, block_size);
        const int64_t base = group * total_blocks + first_block[batch.seq_of_query[row]];
        for (int64_t i = 0; i < blocks.count; ++i) ++offsets_[base + blocks[i] + 1];
      }
    for (size_t i = 1; i < offsets_.size(); ++i) offsets_[i] += offsets_[i - 1];
    rows_.resize(offsets_.back());
    std::vector<int64_t> fill(offsets_.begin(), offsets_.end() - 1);
    for (int64_t group = 0; group < groups; ++group)
      for (int64_t row = 0; row < batch.total_q(); ++row) {
        const QueryBlocks blocks = blocks_read_by(source, batch, row, group, block_size);
        const int64_t base = group * total_blocks + first_block[batch.seq_of_query[row]];
        for (int64_t i = 0; i < blocks.count; ++i)
          rows_[fill[base + blocks[i]]++] = static_cast<int32_t>(row);
      }
  }

  Readers readers(int64_t group, int64_t seq, int64_t block) const {
    if (source_.topk) {
      const int64_t at = group * first_block_.back() + first_block_[seq] + block;
      return {rows_.data(), offsets_[at], offsets_[at + 1]};
    }
    // Dense: every query at pos >= block * B reads the block (bidirectional: every query).
    if (!batch_.causal) return {nullptr, batch_.q_start[seq], batch_.q_start[seq + 1]};
    const int64_t first_pos = batch_.k_len[seq] - batch_.q_len(seq);
    const int64_t skip = std::max<int64_t>(0, block * block_size_ - first_pos);
    return {nullptr, std::min(batch_.q_start[seq] + skip, batch_.q_start[seq + 1]),
            batch_.q_start[seq + 1]};
  }

 private:
  BlockSource source_;
  const Batch& batch_;
  const std::vector<int64_t>& first_block_;
  int64_t block_size_;
  std::vector<int64_t> offsets_;
  std::vector<int32_t> rows_;
};

// Keys of block `block` visible up to key position `last` (t <= last), at most `block_size`.
inline int64_t visible_in_block(int64_t block, int64_t block_size, int64_t last) {
  return std::clamp<int64_t>(last - block * block_size + 1, 0, block_size);
}

}  // namespace msa::detail::cpu
