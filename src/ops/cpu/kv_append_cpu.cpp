// Appending new tokens' K or V to a paged cache: threads over tokens, the fp8 rows encoded by
// the one encoder of src/core/fp8_rows.h (the fp8 index keys' too) straight into the cache's
// pages. Held bitwise to the plain loops of ../reference/kv_append_ref.cpp.
#include <cstring>
#include <vector>

#include "core/fp8_rows.h"
#include "cpu.h"

namespace msa::detail::cpu {

void append_kv(const Tensor& values, const std::vector<int64_t>& slots, const Tensor& cache,
               const Tensor& scale) {
  const int64_t heads = cache.size(1), block_size = cache.size(2), dim = cache.size(3);
  const int64_t tokens = static_cast<int64_t>(slots.size());
  const bool fp8 = cache.dtype() == DType::e4m3;
  // fp8 reads the values as f32; a float cache takes them converted to its own dtype (the
  // same rounding as element by element, Tensor::to).
  const Tensor rows = values.to(fp8 ? DType::f32 : cache.dtype());
  const size_t row_bytes = static_cast<size_t>(dim) * dtype_size(rows.dtype());
  const bool per_tensor = fp8 && scale.dim() == 1;
  const float tensor_scale = per_tensor ? scale.data<float>()[0] : 0.0f;
  float* scales = fp8 && !per_tensor ? scale.data<float>() : nullptr;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tokens; ++t) {
    if (slots[t] < 0) continue;  // padding: skipped
    const int64_t page = slots[t] / block_size, row = slots[t] % block_size;
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t in = (t * heads + h) * dim, slot = (page * heads + h) * block_size + row;
      const char* source = static_cast<const char*>(rows.raw()) + in * dtype_size(rows.dtype());
      char* target = static_cast<char*>(cache.raw()) + slot * row_bytes;
      if (!fp8) {
        std::memcpy(target, source, row_bytes);
        continue;
      }
      const float* x = reinterpret_cast<const float*>(source);
      uint8_t* codes = reinterpret_cast<uint8_t*>(static_cast<char*>(cache.raw()) + slot * dim);
      if (per_tensor)
        encode_fp8_scaled(x, dim, tensor_scale, codes);
      else
        scales[slot] = encode_fp8_row(x, dim, codes);
    }
  }
}

}  // namespace msa::detail::cpu
