// Reads K/V/index-key blocks for the CPU forward kernels as f32 rows, whatever their
// stored type (cpu::StoredBlocks). Private to src/ops/cpu.
//
// f32 storage is read in place. bf16/f16 storage is widened (fp8 K/V and quantized index
// keys dequantized) one block (B x dim) at a time into a buffer owned by the reader (one reader
// per thread or work item): B*dim conversions
// per visit against G*B*dim multiply-adds, and no per-call copy of the whole cache. The
// widening is exact and the kernels' arithmetic is the same code either way, so results on
// bf16/f16 storage equal bit for bit those on the same values stored as f32.
#pragma once
#include <array>
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
    return widened(source, b.block_size, b.dim, rows, [&](int64_t t, float* out) {
      const T* in = source + t * b.token_stride;
      for (int64_t d = 0; d < b.dim; ++d) out[d] = widen(in[d]);
    });
  }

  // fp8 K/V and quantized index keys: dequantized as the public dequantize_kv and
  // dequantize_index_keys do (each value the f32 product code * scale, rounded once), so
  // results equal those on the f32 values these return, bit for bit. Index keys have one
  // head (0); a per-tensor K/V scale has stride 0 everywhere (every row reads scale[0]).
  BlockRows read_from(const Fp8Blocks& b, int64_t seq, int64_t block, int64_t head, int64_t rows) {
    const E4m3* codes = b.codes.block(seq, block, head);
    const float* scale = b.scale.block(seq, block, head);
    const float* value = e4m3_values();
    return widened(codes, b.block_size, b.dim, rows, [&](int64_t t, float* out) {
      const E4m3* in = codes + t * b.codes.token_stride;
      const float s = scale[t * b.scale.token_stride];
      for (int64_t d = 0; d < b.dim; ++d) out[d] = value[in[d].bits] * s;
    });
  }

  BlockRows read_from(const Fp4IndexKeys& b, int64_t seq, int64_t block, int64_t, int64_t rows) {
    const uint8_t* codes = b.codes.block(seq, block, 0);
    const E4m3* scale = b.scale.block(seq, block, 0);
    const float* value = e4m3_values();
    return widened(codes, b.block_size, b.dim, rows, [&](int64_t t, float* out) {
      const uint8_t* in = codes + t * b.codes.token_stride;
      const E4m3* group_scale = scale + t * b.scale.token_stride;
      for (int64_t d = 0; d < b.dim; d += 2) {
        const float s = value[group_scale[d / 16].bits];
        out[d] = e2m1_value(in[d / 2] & 0xf) * s;
        out[d + 1] = e2m1_value(in[d / 2] >> 4) * s;
      }
    });
  }

  // Rows [0, rows) of the block starting at `source`, each written by fill_row(t, out) as
  // `dim` f32 values into buffer_. Consecutive reads of one block (the queries of an
  // attention tile) fill it once.
  template <class FillRow>
  BlockRows widened(const void* source, int64_t block_size, int64_t dim, int64_t rows,
                    FillRow fill_row) {
    if (source != cached_ || rows > cached_rows_) {
      buffer_.resize(static_cast<size_t>(block_size * dim));
      for (int64_t t = 0; t < rows; ++t) fill_row(t, buffer_.data() + t * dim);
      cached_ = source;
      cached_rows_ = rows;
    }
    return {buffer_.data(), dim};
  }

  static const float* e4m3_values() {
    static const std::array<float, 256> table = [] {
      std::array<float, 256> t{};
      for (int code = 0; code < 256; ++code) t[code] = e4m3_to_float(static_cast<uint8_t>(code));
      return t;
    }();
    return table.data();
  }
  static float e2m1_value(unsigned code) {
    static constexpr float kValues[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                          -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
    return kValues[code];
  }

  const StoredBlocks& blocks_;
  std::vector<float> buffer_;    // [B][dim] widened rows
  const void* cached_ = nullptr;  // block whose first cached_rows_ rows are in buffer_
  int64_t cached_rows_ = 0;
};

}  // namespace msa::detail::cpu
