// Quantized index keys (docs/msa.md §6.4): the formats a paged index-key cache may be stored in,
// and the CPU functions that make and read them. The indexer scores every query against
// the DEQUANTIZED keys (qi stays a float tensor); only the stored bytes change.
//
// Formats (recognised from the dtypes of PagedKvCache::index_key_cache and index_key_scale):
//   plain  index_key_cache f32/bf16/f16/f64 [pages, B, Di], no index_key_scale.
//   fp8    index_key_cache e4m3 [pages, B, Di] + index_key_scale f32 [pages, B]:
//          key[t][d] = e4m3(code[t][d]) * scale[t]            (one f32 scale per token).
//   fp4    index_key_cache u8 [pages, B, Di/2] + index_key_scale e4m3 [pages, B, Di/16]:
//          key[t][d] = e2m1(nibble[t][d]) * e4m3(scale[t][d/16])  (NVFP4-style, Di % 16 == 0).
//          Nibble order: byte i of a token's row holds channel 2i in its LOW nibble (bits 0-3)
//          and channel 2i+1 in its HIGH nibble (bits 4-7). A nibble is an OCP e2m1 code:
//          bit 3 sign, bits 2-1 exponent (bias 1), bit 0 mantissa; magnitudes
//          0, 0.5, 1, 1.5, 2, 3, 4, 6. The product e2m1 * e4m3 has at most 6 significant bits
//          and lies in [2^-10, 2688]: it is exact in f32, bf16 and f16.
//          No per-tensor global scale (NVFP4 has one): a positive factor on all keys scales
//          every score alike and changes no selection; fold one into qi if needed.
//
// Quantization (exact, reproducible; the CUDA quantizer in src/cuda gives the same bytes):
//   fp8: per token, amax = max |x| over its Di values (read as f32);
//        scale = f32(amax) / 448 (f32 division, round to nearest even);
//        code  = e4m3_rne_saturating(f32(x / scale))   (x / scale <= 448 up to rounding, so
//        no code saturates beyond the rounding of 448 itself). amax == 0 (or a scale that
//        underflows to 0): scale 0 and codes 0.
//   fp4: per 16 consecutive channels of a token, amax16 = max |x|;
//        scale = the smallest e4m3 value >= f32(amax16 / 6), at most 448 (so |x| / scale
//        <= 6 and no code saturates, unless amax16 > 2688 caps the scale);
//        code  = e2m1_rne_saturating(f32(x / scale)). amax16 == 0: scale 0 and codes 0.
//   Keys must be finite (msa::Error otherwise).
#pragma once
#include <cstdint>
#include <string_view>

#include "msa/tensor.h"

namespace msa {

enum class IndexKeyFormat : uint8_t { plain, fp8, fp4 };
std::string_view index_key_format_name(IndexKeyFormat format);  // "plain" | "fp8" | "fp4"

// The format of codes + scale (scale undefined: plain); throws msa::Error when the pair's
// dtypes or shapes do not form one (see above; shapes: codes [..., Di or Di/2], scale
// [...] or [..., Di/16] with the same leading extents).
IndexKeyFormat index_key_format_of(const Tensor& codes, const Tensor& scale);

struct QuantizedIndexKeys {
  Tensor codes;  // fp8: e4m3 [..., Di];   fp4: u8 [..., Di/2]
  Tensor scale;  // fp8: f32 [...];        fp4: e4m3 [..., Di/16]
};

// keys: a contiguous float tensor [..., Di] (f32, bf16, f16 or f64; any leading shape, e.g.
// [pages, B, Di] for a whole cache or [tokens, Di]).
QuantizedIndexKeys quantize_index_keys_fp8(const Tensor& keys);
QuantizedIndexKeys quantize_index_keys_fp4(const Tensor& keys);  // Di % 16 == 0
QuantizedIndexKeys quantize_index_keys(const Tensor& keys, IndexKeyFormat format);  // fp8|fp4

// The keys the indexer scores against: [..., Di] in `dtype` (f32: each value rounded once to
// f32, exact for fp4; f64: exact).
Tensor dequantize_index_keys(const Tensor& codes, const Tensor& scale, DType dtype = DType::f32);

// OCP E2M1 (FP4): round to nearest, ties to the even code; saturating at +-6; the sign of a
// value that rounds to zero is kept (-0 = 0x8). NaN has no encoding (gives +-6).
uint8_t float_to_e2m1(float value);
float e2m1_to_float(uint8_t code);  // low 4 bits

}  // namespace msa
