// Quantized index keys: format recognition, quantize and dequantize on the CPU (the rules
// are written down in include/msa/quantized_index_keys.h).
#include "msa/quantized_index_keys.h"

#include <utility>
#include <algorithm>
#include <cmath>
#include <string>

#include "core/e2m1_rounding.h"
#include "core/fp8_rows.h"
#include "msa/dtype.h"

namespace msa {

namespace {

constexpr float kE2m1Max = 6.0f;
constexpr int64_t kFp4Group = 16;  // channels per fp4 scale

// Magnitudes of the e2m1 codes 0..7.
constexpr float kE2m1Magnitude[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

// Smallest e4m3 code (non-negative) whose value is >= value (> 0, finite); 448 at most.
uint8_t e4m3_at_least(float value) {
  uint8_t code = float_to_e4m3(value);
  if (e4m3_to_float(code) < value && code < 0x7e) ++code;  // positive codes ascend by value
  return code;
}

}  // namespace

std::string_view index_key_format_name(IndexKeyFormat format) {
  switch (format) {
    case IndexKeyFormat::plain: return "plain";
    case IndexKeyFormat::fp8: return "fp8";
    case IndexKeyFormat::fp4: return "fp4";
  }
  return "?";
}

uint8_t float_to_e2m1(float value) { return static_cast<uint8_t>(detail::e2m1_round(value)); }

float e2m1_to_float(uint8_t code) {
  const float magnitude = kE2m1Magnitude[code & 0x7];
  return code & 0x8 ? -magnitude : magnitude;
}

IndexKeyFormat index_key_format_of(const Tensor& codes, const Tensor& scale) {
  if (!codes.defined()) throw_arg_error("index_key_cache", "a tensor", "nothing");
  const DType dtype = codes.dtype();
  if (!scale.defined()) {
    if (dtype == DType::e4m3 || dtype == DType::u8)
      throw_arg_error("index_key_scale",
                      std::string("a scale tensor for ") + std::string(dtype_name(dtype)) +
                          " index keys (fp8: e4m3 keys + f32 [..., tokens]; fp4: u8 keys + e4m3 "
                          "[..., tokens, Di/16])",
                      "nothing");
    return IndexKeyFormat::plain;
  }
  if (dtype != DType::e4m3 && dtype != DType::u8)
    throw_arg_error("index_key_cache",
                    "dtype e4m3 (fp8) or u8 (fp4) when index_key_scale is given (plain float "
                    "keys take no scale)",
                    dtype_name(dtype));
  if (codes.dim() < 1) throw_arg_error("index_key_cache", "rank >= 1", codes.dim());
  const Shape leading(codes.shape().begin(), codes.shape().end() - 1);
  const bool fp8 = dtype == DType::e4m3;
  const DType scale_dtype = fp8 ? DType::f32 : DType::e4m3;
  const Shape scale_shape = fp8 ? leading : detail::with_last(leading, codes.size(-1) * 2 / kFp4Group);
  if (scale.dtype() != scale_dtype)
    throw_arg_error("index_key_scale",
                    std::string("dtype ") + std::string(dtype_name(scale_dtype)) + " for " +
                        (fp8 ? "fp8 (e4m3)" : "fp4 (u8)") + " index keys",
                    dtype_name(scale.dtype()));
  if (!fp8 && (codes.size(-1) * 2) % kFp4Group != 0)
    throw_arg_error("index_key_cache",
                    "fp4 codes whose last extent Di/2 holds a multiple of 16 channels",
                    shape_string(codes.shape()));
  if (scale.shape() != scale_shape)
    throw_arg_error("index_key_scale",
                    "shape " + shape_string(scale_shape) + " for index_key_cache of shape " +
                        shape_string(codes.shape()) +
                        (fp8 ? " (one f32 per token)" : " (one e4m3 per 16 channels)"),
                    shape_string(scale.shape()));
  return fp8 ? IndexKeyFormat::fp8 : IndexKeyFormat::fp4;
}

QuantizedIndexKeys quantize_index_keys_fp8(const Tensor& keys) {
  detail::Fp8Rows rows = detail::encode_fp8_rows(keys, "keys", "fp8");
  return {std::move(rows.codes), std::move(rows.scale)};
}

QuantizedIndexKeys quantize_index_keys_fp4(const Tensor& keys) {
  const detail::QuantizerRows in = detail::quantizer_rows(keys, "keys", "fp4");
  if (in.dim % kFp4Group != 0)
    throw_arg_error("keys", "an index dim that is a multiple of 16 (fp4 scale groups)", in.dim);
  const int64_t groups = in.dim / kFp4Group;
  QuantizedIndexKeys out;
  out.codes = Tensor::zeros(detail::with_last(in.leading, in.dim / 2), DType::u8);
  out.scale = Tensor::zeros(detail::with_last(in.leading, groups), DType::e4m3);
  const float* x = in.values.data<float>();
  uint8_t* codes = static_cast<uint8_t*>(out.codes.raw());
  uint8_t* scales = static_cast<uint8_t*>(out.scale.raw());
  for (int64_t r = 0; r < in.rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const float* group = x + r * in.dim + g * kFp4Group;
      float amax = 0;
      for (int64_t i = 0; i < kFp4Group; ++i) amax = std::max(amax, std::fabs(group[i]));
      const float wanted = amax / kE2m1Max;
      if (wanted == 0) continue;  // scale and codes stay 0
      const uint8_t scale_code = e4m3_at_least(wanted);
      scales[r * groups + g] = scale_code;
      const float scale = e4m3_to_float(scale_code);
      uint8_t* packed = codes + r * (in.dim / 2) + g * (kFp4Group / 2);
      for (int64_t i = 0; i < kFp4Group; i += 2)
        packed[i / 2] = static_cast<uint8_t>(float_to_e2m1(group[i] / scale) |
                                             (float_to_e2m1(group[i + 1] / scale) << 4));
    }
  return out;
}

QuantizedIndexKeys quantize_index_keys(const Tensor& keys, IndexKeyFormat format) {
  switch (format) {
    case IndexKeyFormat::fp8: return quantize_index_keys_fp8(keys);
    case IndexKeyFormat::fp4: return quantize_index_keys_fp4(keys);
    case IndexKeyFormat::plain: break;
  }
  throw_arg_error("format", "fp8 or fp4", index_key_format_name(format));
}

Tensor dequantize_index_keys(const Tensor& codes, const Tensor& scale, DType dtype) {
  const IndexKeyFormat format = index_key_format_of(codes, scale);
  if (format == IndexKeyFormat::plain)
    throw_arg_error("index_key_scale", "a scale tensor (fp8 or fp4 codes)", "nothing");
  if (dtype != DType::f32 && dtype != DType::f64)
    throw_arg_error("dtype", "f32 or f64", dtype_name(dtype));
  if (!codes.is_contiguous() || !scale.is_contiguous() || codes.device() != Device::cpu ||
      scale.device() != Device::cpu)
    throw_arg_error("index_key_cache", "contiguous cpu codes and scales", "a strided or device tensor");
  const bool fp8 = format == IndexKeyFormat::fp8;
  const int64_t stored = codes.size(-1), dim = fp8 ? stored : 2 * stored;
  const int64_t rows = codes.numel() / std::max<int64_t>(stored, 1);
  Shape shape = codes.shape();
  shape.back() = dim;
  Tensor out = Tensor::zeros(shape, DType::f64);
  double* values = out.data<double>();
  const uint8_t* code = static_cast<const uint8_t*>(codes.raw());
  for (int64_t r = 0; r < rows; ++r) {
    double* row = values + r * dim;
    if (fp8) {
      const double s = scale.data<float>()[r];
      for (int64_t d = 0; d < dim; ++d) row[d] = double{e4m3_to_float(code[r * dim + d])} * s;
    } else {
      const uint8_t* scale_codes = static_cast<const uint8_t*>(scale.raw()) + r * (dim / kFp4Group);
      for (int64_t d = 0; d < dim; ++d) {
        const uint8_t byte = code[r * stored + d / 2];
        row[d] = double{e2m1_to_float(d % 2 ? byte >> 4 : byte & 0xf)} *
                 double{e4m3_to_float(scale_codes[d / kFp4Group])};
      }
    }
  }
  return dtype == DType::f64 ? out : out.to(DType::f32);
}

}  // namespace msa
