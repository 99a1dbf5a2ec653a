// Paged cases with quantized index keys (msa/quantized_index_keys.h), shared by the CPU and
// GPU tests of fp8 / fp4 index-key caches.
#pragma once
#include <cmath>
#include <utility>
#include <vector>

#include "msa/quantized_index_keys.h"
#include "op_cases.h"

namespace msa::testing {

// Index of the grid magnitude nearest to |value| (ascending grid; beyond the end: the last),
// ties to the even index (the even mantissa): the reference rounding of the fp8 / fp4 encoder
// tests, independent of the code under test.
inline int nearest_even(const std::vector<double>& grid, double value) {
  const double v = std::fabs(value);
  int best = 0;
  for (int i = 1; i < static_cast<int>(grid.size()); ++i) {
    const double d = std::fabs(grid[i] - v), d_best = std::fabs(grid[best] - v);
    if (d < d_best || (d == d_best && i % 2 == 0)) best = i;
  }
  return best;
}

// page_varlen_case(c) with the index-key cache quantized per token (garbage slots too), and
// the case's varlen ki replaced by the dequantized keys, so that DoubleInputs and
// expect_same_selection judge against the keys the indexer scores. `dequantized` is the
// same cache with those keys as f32 (the plain-cache equivalent, bit for bit on Impl::cpu).
struct QuantizedPagedCase {
  VarlenCase c;
  PagedRequests paged;      // index_key_cache = codes, index_key_scale = scales
  PagedKvCache dequantized;  // index_key_cache = dequantized f32 keys, no scale
};

inline QuantizedPagedCase make_quantized_paged_case(VarlenCase c, IndexKeyFormat format) {
  QuantizedPagedCase out;
  out.paged = page_varlen_case(c);
  const QuantizedIndexKeys cache = quantize_index_keys(out.paged.cache.index_key_cache, format);
  out.dequantized = out.paged.cache;
  out.dequantized.index_key_cache = dequantize_index_keys(cache.codes, cache.scale);
  out.paged.cache.index_key_cache = cache.codes;
  out.paged.cache.index_key_scale = cache.scale;
  const QuantizedIndexKeys varlen = quantize_index_keys(c.ki, format);
  c.ki = dequantize_index_keys(varlen.codes, varlen.scale);
  out.c = std::move(c);
  return out;
}

inline std::string format_name(IndexKeyFormat format) {
  return std::string(index_key_format_name(format));
}

}  // namespace msa::testing
