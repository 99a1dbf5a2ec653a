// The fp8 encodings of fp8_rows.h.
#include "core/fp8_rows.h"

#include <algorithm>
#include <cmath>

#include "msa/dtype.h"
#include "msa/error.h"

namespace msa::detail {

QuantizerRows quantizer_rows(const Tensor& values, const std::string& name, const char* what) {
  if (!values.defined()) throw_arg_error(name, "a tensor", "nothing");
  if (values.device() != Device::cpu) throw_arg_error(name, "a cpu tensor", "a device tensor");
  const DType dtype = values.dtype();
  if (dtype != DType::f32 && dtype != DType::f64 && dtype != DType::bf16 && dtype != DType::f16)
    throw_arg_error(name, "dtype f32, bf16, f16 or f64", dtype_name(dtype));
  if (values.dim() < 1) throw_arg_error(name, "rank >= 1 ([..., dim])", values.dim());
  if (!values.is_contiguous()) throw_arg_error(name, "a contiguous tensor", "a strided view");
  QuantizerRows out;
  out.dim = values.size(-1);
  out.leading.assign(values.shape().begin(), values.shape().end() - 1);
  out.rows = shape_numel(out.leading);
  if (out.dim < 1) throw_arg_error(name, "a positive last extent (the row length)", out.dim);
  out.values = dtype == DType::f32 ? values : values.to(DType::f32);
  const float* x = out.values.data<float>();
  for (int64_t i = 0; i < out.rows * out.dim; ++i)
    if (!std::isfinite(x[i]))
      throw_arg_error(name + " (" + what + " quantization)", "finite values",
                      "element " + index_string(values.shape(), i) + " = " + std::to_string(x[i]));
  return out;
}

float encode_fp8_row(const float* x, int64_t dim, uint8_t* codes) {
  float amax = 0;
  for (int64_t d = 0; d < dim; ++d) amax = std::max(amax, std::fabs(x[d]));
  const float scale = amax / kE4m3Max;
  for (int64_t d = 0; d < dim; ++d) codes[d] = scale == 0 ? 0 : float_to_e4m3(x[d] / scale);
  return scale;
}

void encode_fp8_scaled(const float* x, int64_t count, float scale, uint8_t* codes) {
  for (int64_t i = 0; i < count; ++i) codes[i] = float_to_e4m3(x[i] / scale);
}

Shape with_last(Shape leading, int64_t last) {
  leading.push_back(last);
  return leading;
}

Fp8Rows encode_fp8_rows(const Tensor& values, const std::string& name, const char* what) {
  const QuantizerRows in = quantizer_rows(values, name, what);
  Fp8Rows out;
  out.codes = Tensor::zeros(with_last(in.leading, in.dim), DType::e4m3);
  out.scale = Tensor::zeros(in.leading, DType::f32);
  const float* x = in.values.data<float>();
  uint8_t* codes = static_cast<uint8_t*>(out.codes.raw());
  float* scales = out.scale.data<float>();
  for (int64_t r = 0; r < in.rows; ++r) scales[r] = encode_fp8_row(x + r * in.dim, in.dim, codes + r * in.dim);
  return out;
}

}  // namespace msa::detail
