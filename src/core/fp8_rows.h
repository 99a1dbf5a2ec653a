// The fp8 (OCP e4m3) encodings of msa's quantized caches, written once: the fp8 index keys
// (msa/quantized_index_keys.h, one scale per token) and the fp8 K/V cache (msa/ops.h,
// PagedKvCache: one scale per (token, head) row, or one given scale per tensor). The e4m3
// rounding itself is float_to_e4m3 (msa/dtype.h). Private to src/.
#pragma once
#include <cstdint>
#include <string>

#include "msa/tensor.h"

namespace msa::detail {

// The values a quantizer reads: a contiguous CPU float tensor [..., dim] (f32, bf16, f16 or
// f64; dim >= 1) as a contiguous f32 tensor of `rows` rows, with its leading shape. Throws
// msa::Error naming `name` for another dtype, rank 0, a strided view, or a non-finite value
// (the quantizers' one content check, docs/msa.md §7; `what` says which quantization).
struct QuantizerRows {
  Tensor values;  // f32 [rows, dim]
  Shape leading;
  int64_t rows = 0, dim = 0;
};
QuantizerRows quantizer_rows(const Tensor& values, const std::string& name, const char* what);

constexpr float kE4m3Max = 448.0f;  // the largest finite e4m3 magnitude

// `leading` with `last` appended: the shape of codes or scales of rows with that leading shape.
Shape with_last(Shape leading, int64_t last);

// e4m3 codes [leading..., dim] and one f32 scale per row [leading...] of a quantizer's input
// (quantizer_rows, then encode_fp8_row on every row): the fp8 index keys and the fp8 K/V
// cache per token and head.
struct Fp8Rows {
  Tensor codes, scale;
};
Fp8Rows encode_fp8_rows(const Tensor& values, const std::string& name, const char* what);

// One row of `dim` f32 values: amax = max |x|, scale = amax / 448 (an f32 division, round to
// nearest even), codes[d] = e4m3_rne_saturating(f32(x[d] / scale)). amax == 0, or a scale
// that underflows to 0: scale 0 and every code 0 (written, not skipped). Returns the scale.
float encode_fp8_row(const float* x, int64_t dim, uint8_t* codes);

// `count` f32 values with a given scale (positive and finite, checked by the callers):
// codes[i] = e4m3_rne_saturating(f32(x[i] / scale)).
void encode_fp8_scaled(const float* x, int64_t count, float scale, uint8_t* codes);

}  // namespace msa::detail
