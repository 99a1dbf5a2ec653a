// fp8 K/V caches: layout recognition, quantize and dequantize on the CPU (the rules are
// written down in include/msa/quantized_kv_cache.h; the encoder is src/core/fp8_rows.h).
#include "msa/quantized_kv_cache.h"

#include <utility>
#include <cmath>
#include <string>

#include "core/fp8_rows.h"
#include "msa/dtype.h"
#include "msa/error.h"

namespace msa {

namespace {

std::string quoted(std::string_view text) { return "\"" + std::string(text) + "\""; }

// The layout of `scale` for codes [..., D] (rank >= 1): the leading shape, or [1]. `codes_name`
// and `scale_name` name the arguments of an error.
KvScaleLayout scale_layout(const Tensor& codes, const Tensor& scale, const std::string& codes_name,
                           const std::string& scale_name) {
  if (!codes.defined()) throw_arg_error(codes_name, "a tensor", "nothing");
  if (codes.dtype() != DType::e4m3)
    throw_arg_error(codes_name, "dtype e4m3 (an fp8 cache goes with a scale tensor)",
                    dtype_name(codes.dtype()));
  if (codes.dim() < 1) throw_arg_error(codes_name, "rank >= 1", codes.dim());
  if (!scale.defined())
    throw_arg_error(scale_name,
                    "an f32 scale tensor for e4m3 " + codes_name + " " + shape_string(codes.shape()) +
                        " (per token and head: the shape without the last axis; per tensor: [1])",
                    "nothing");
  if (scale.dtype() != DType::f32)
    throw_arg_error(scale_name, "dtype f32", dtype_name(scale.dtype()));
  const Shape leading(codes.shape().begin(), codes.shape().end() - 1);
  if (scale.shape() == leading) return KvScaleLayout::per_token_head;
  if (scale.shape() == Shape{1}) return KvScaleLayout::per_tensor;
  throw_arg_error(scale_name,
                  "shape " + shape_string(leading) + " (one scale per token and head) or [1] (one "
                  "per tensor) for " + codes_name + " of shape " + shape_string(codes.shape()),
                  shape_string(scale.shape()));
}

}  // namespace

std::string_view kv_scale_layout_name(KvScaleLayout layout) {
  switch (layout) {
    case KvScaleLayout::per_token_head: return "per_token_head";
    case KvScaleLayout::per_tensor: return "per_tensor";
  }
  return "?";
}

KvScaleLayout kv_scale_layout_from_name(std::string_view name) {
  if (name == "per_token_head") return KvScaleLayout::per_token_head;
  if (name == "per_tensor") return KvScaleLayout::per_tensor;
  throw_arg_error("kv scale layout", "per_token_head or per_tensor", quoted(name));
}

KvScaleLayout kv_scale_layout_of(const Tensor& codes, const Tensor& scale, std::string_view which) {
  const std::string codes_name = std::string(which) + "_cache", scale_name = std::string(which) + "_scale";
  if (codes.defined() && codes.dim() != 4)
    throw_arg_error(codes_name, "rank 4 [pages, Hkv, B, D]", shape_string(codes.shape()));
  return scale_layout(codes, scale, codes_name, scale_name);
}

QuantizedKv quantize_kv_fp8(const Tensor& values) {
  detail::Fp8Rows rows = detail::encode_fp8_rows(values, "values", "fp8 K/V");
  return {std::move(rows.codes), std::move(rows.scale)};
}

QuantizedKv quantize_kv_fp8(const Tensor& values, float scale) {
  MSA_CHECK_ARG(scale > 0 && std::isfinite(scale), "scale",
                "a positive finite per-tensor scale", scale);
  const detail::QuantizerRows in = detail::quantizer_rows(values, "values", "fp8 K/V");
  QuantizedKv out;
  out.codes = Tensor::zeros(detail::with_last(in.leading, in.dim), DType::e4m3);
  out.scale = Tensor::full({1}, DType::f32, scale);
  detail::encode_fp8_scaled(in.values.data<float>(), in.rows * in.dim, scale,
                            static_cast<uint8_t*>(out.codes.raw()));
  return out;
}

Tensor dequantize_kv(const Tensor& codes, const Tensor& scale, DType dtype) {
  const KvScaleLayout layout = scale_layout(codes, scale, "codes", "scale");
  if (dtype != DType::f32 && dtype != DType::f64)
    throw_arg_error("dtype", "f32 or f64", dtype_name(dtype));
  if (!codes.is_contiguous() || !scale.is_contiguous() || codes.device() != Device::cpu ||
      scale.device() != Device::cpu)
    throw_arg_error("codes", "contiguous cpu codes and scales", "a strided or device tensor");
  const int64_t dim = codes.size(-1);
  const int64_t rows = dim == 0 ? 0 : codes.numel() / dim;
  Tensor out = Tensor::zeros(codes.shape(), DType::f64);
  double* values = out.data<double>();
  const uint8_t* code = static_cast<const uint8_t*>(codes.raw());
  const float* scales = scale.data<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const double s = scales[layout == KvScaleLayout::per_tensor ? 0 : r];
    for (int64_t d = 0; d < dim; ++d)
      values[r * dim + d] = double{e4m3_to_float(code[r * dim + d])} * s;
  }
  return dtype == DType::f64 ? out : out.to(DType::f32);
}

}  // namespace msa
