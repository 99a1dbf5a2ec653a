// fp8 K/V caches (docs/msa.md §6.6): the format a paged K/V cache (PagedKvCache in msa/ops.h)
// may be stored in, and the CPU functions that make and read it. Attention reads the
// DEQUANTIZED keys and values (q stays a float tensor); only the stored bytes change, so a
// decode step reads half the K/V bytes of a bf16 cache.
//
// Formats (recognised from the dtypes of PagedKvCache's k_cache / v_cache and k_scale / v_scale):
//   float  k_cache, v_cache f32/bf16/f16/f64 [pages, Hkv, B, D]; no k_scale / v_scale.
//   fp8    k_cache, v_cache e4m3 [pages, Hkv, B, D], each with an f32 scale in one of two layouts
//          (both are vLLM's, for MiniMax-M3):
//          per token and head  scale [pages, Hkv, B]:  x[p][h][t][d] = e4m3(code[p][h][t][d]) * scale[p][h][t]
//          per tensor          scale [1]:              x = e4m3(code) * scale[0]  (vLLM's k_scale / v_scale)
//          K and V are both fp8 or both float; each has its own scale and may use either layout.
//
// Quantization (exact, reproducible; the CUDA append kernel of msa/cuda/quantize.h writes the
// same bytes for the same bf16 or f32 values):
//   per token and head: per (token, head) row, amax = max |x| over its D values (read as f32);
//        scale = f32(amax) / 448 (f32 division, round to nearest even);
//        code  = e4m3_rne_saturating(f32(x / scale)). amax == 0 (or a scale that underflows to
//        0): scale 0 and codes 0. This is the fp8 index-key rule (msa/quantized_index_keys.h)
//        applied to each (token, head) row; one implementation serves both (src/core/fp8_rows.h).
//   per tensor: code = e4m3_rne_saturating(f32(x / scale)) with the given scale (positive and
//        finite): values beyond 448 * scale saturate to +-448 * scale.
//   Values must be finite (msa::Error otherwise), as for every quantizer of msa.
#pragma once
#include <cstdint>
#include <string_view>

#include "msa/tensor.h"

namespace msa {

enum class KvScaleLayout : uint8_t { per_token_head, per_tensor };
std::string_view kv_scale_layout_name(KvScaleLayout layout);  // "per_token_head" | "per_tensor"
KvScaleLayout kv_scale_layout_from_name(std::string_view name);  // throws msa::Error

// The scale layout of one fp8 cache: `codes` e4m3 [pages, Hkv, B, D] with `scale` f32
// [pages, Hkv, B] (per token and head) or f32 [1] (per tensor). `which` ("k" or "v") names the
// arguments of an error ("k_cache", "k_scale"); throws msa::Error when the pair is no fp8 cache
// (a missing scale included).
KvScaleLayout kv_scale_layout_of(const Tensor& codes, const Tensor& scale, std::string_view which);

struct QuantizedKv {
  Tensor codes;  // e4m3 [..., D]
  Tensor scale;  // f32: [...] per token and head, [1] per tensor
};

// values: a contiguous float tensor [..., D] (f32, bf16, f16 or f64; any leading shape, e.g.
// [pages, Hkv, B, D] for a whole cache or [tokens, Hkv, D] for new tokens).
QuantizedKv quantize_kv_fp8(const Tensor& values);               // per token and head
QuantizedKv quantize_kv_fp8(const Tensor& values, float scale);  // per tensor: scale > 0, finite

// The values attention reads: [..., D] in `dtype` (f64: exact, since a 4-bit code times an
// f32 scale fits a double; f32: each value rounded once). `scale` is [...] or [1] as above.
Tensor dequantize_kv(const Tensor& codes, const Tensor& scale, DType dtype = DType::f32);

}  // namespace msa
