// Appending new tokens' K or V to a paged cache, as plain loops: the rule of
// msa/quantized_kv_cache.h written out element by element (the e4m3 rounding is
// float_to_e4m3 of msa/dtype.h), for the CPU implementation to be held to.
#include <algorithm>
#include <cmath>
#include <vector>

#include "msa/dtype.h"
#include "reference.h"

namespace msa::detail::ref {

void append_kv(const Tensor& values, const std::vector<int64_t>& slots, const Tensor& cache,
               const Tensor& scale) {
  const int64_t heads = cache.size(1), block_size = cache.size(2), dim = cache.size(3);
  const bool fp8 = cache.dtype() == DType::e4m3;
  const bool per_tensor = fp8 && scale.dim() == 1;
  for (size_t t = 0; t < slots.size(); ++t) {
    if (slots[t] < 0) continue;  // padding: skipped
    const int64_t page = slots[t] / block_size, row = slots[t] % block_size;
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t in = (static_cast<int64_t>(t) * heads + h) * dim;  // values [T, Hkv, D]
      const int64_t out = ((page * heads + h) * block_size + row) * dim;  // cache [pages, Hkv, B, D]
      if (!fp8) {  // float caches: the value rounded to the cache's dtype
        for (int64_t d = 0; d < dim; ++d)
          store_from_double(cache.raw(), cache.dtype(), out + d, load_as_double(values.raw(), values.dtype(), in + d));
        continue;
      }
      // fp8: every value read as f32 first.
      std::vector<float> x(static_cast<size_t>(dim));
      for (int64_t d = 0; d < dim; ++d)
        x[d] = static_cast<float>(load_as_double(values.raw(), values.dtype(), in + d));
      float s;
      if (per_tensor) {
        s = scale.data<float>()[0];
      } else {
        float amax = 0;
        for (int64_t d = 0; d < dim; ++d) amax = std::max(amax, std::fabs(x[d]));
        s = amax / 448.0f;
        scale.data<float>()[(page * heads + h) * block_size + row] = s;
      }
      uint8_t* codes = static_cast<uint8_t*>(cache.raw()) + out;
      for (int64_t d = 0; d < dim; ++d) codes[d] = s == 0 ? 0 : float_to_e4m3(x[d] / s);
    }
  }
}

}  // namespace msa::detail::ref
