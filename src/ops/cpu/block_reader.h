// Reads K/V/index-key blocks for the CPU forward kernels as f32 rows, whatever their
// stored type (cpu::StoredBlocks). Private to src/ops/cpu.
//
// f32 storage is read in place. bf16/f16 storage is widened one block (B x dim) at a time
// into a buffer owned by the reader (one reader per thread or work item): B*dim conversions
// per visit against G*B*dim multiply-adds, and no per-call copy of the whole cache. The
// widening is exact and the kernels' arithmetic is the same code either way, so results on
// bf16/f16 storage equal bit for bit those on the same values stored as f32.
#pragma once
#include <cstdint>
#include <type_traits>
#include <variant>
#include <vector>

#include "cpu.h"
#include "msa/dtype.h"

namespace msa::detail::cpu {

inline float widen(Bf16 x) { return bf16_to_float(x.bits); }
inline float widen(F16 x) { return f16_to_float(x.bits); }

// `rows` f32 rows of one block, `stride` floats apart (each `dim` floats long).
struct BlockRows {
  const float* data;
  int64_t stride;
  const float* row(int64_t t) const { return data + t * stride; }
};

class BlockReader {
 public:
  explicit BlockReader(const StoredBlocks& blocks) : blocks_(blocks) {}

  int64_t block_size() const {
    return std::visit([](const auto& b) { return b.block_size; }, blocks_);
  }

  // Rows [0, rows) of block `block` of sequence `seq`, head `head`. Rows past a sequence's
  // end are never touched (in a varlen tensor they may lie outside it). Valid until the
  // next read.
  BlockRows read(int64_t seq, int64_t block, int64_t head, int64_t rows) {
    return std::visit([&](const auto& b) { return read_from(b, seq, block, head, rows); },
                      blocks_);
  }

 private:
  BlockRows read_from(const KeyBlocks<float>& b, int64_t seq, int64_t block, int64_t head,
                      int64_t) {
    return {b.block(seq, block, head), b.token_stride};
  }

  template <class T>
  BlockRows read_from(const KeyBlocks<T>& b, int64_t seq, int64_t block, int64_t head,
                      int64_t rows) {
    const T* source = b.block(seq, block, head);
    // Consecutive reads of one block (the queries of an attention tile) widen it once.
    if (source != cached_ || rows > cached_rows_) {
      buffer_.resize(static_cast<size_t>(b.block_size * b.dim));
      for (int64_t t = 0; t < rows; ++t) {
        const T* in = source + t * b.token_stride;
        float* out = buffer_.data() + t * b.dim;
        for (int64_t d = 0; d < b.dim; ++d) out[d] = widen(in[d]);
      }
      cached_ = source;
      cached_rows_ = rows;
    }
    return {buffer_.data(), b.dim};
  }

  const StoredBlocks& blocks_;
  std::vector<float> buffer_;    // [B][dim] widened rows
  const void* cached_ = nullptr;  // block whose first cached_rows_ rows are in buffer_
  int64_t cached_rows_ = 0;
};

}  // namespace msa::detail::cpu
