#include "mxfp8.h"

#include <algorithm>
#include <cmath>

#include "msa/error.h"
#include "quantized_refusals.h"

namespace msa::model {

namespace {

// The dtype and shape checks shared by check_mxfp8 and dequantize_mxfp8.
void check_mxfp8_layout(const Tensor& codes, const Tensor& scale, const std::string& name) {
  const std::string scale_name = "tensor '" + name + "_scale_inv'";
  if (codes.dtype() != DType::e4m3 || codes.dim() < 1)
    throw_arg_error("tensor '" + name + "'", "float8_e4m3fn codes", dtype_name(codes.dtype()));
  if (scale.dtype() != DType::u8) throw_arg_error(scale_name, "uint8 (UE8M0)", dtype_name(scale.dtype()));
  Shape expected = codes.shape();
  const int64_t in = expected.back();
  expected.back() = (in + kMxfp8Block - 1) / kMxfp8Block;
  if (scale.shape() != expected) throw_arg_error(scale_name, shape_string(expected), shape_string(scale.shape()));
}

void refuse_nan_exponent(const std::string& name, int64_t row, int64_t block) {
  refuse_block_scale(name + "_scale_inv", row, block, "a UE8M0 exponent (0..254)", "255 (NaN)");
}

void refuse_value(const std::string& name, int64_t flat_index) {
  refuse_scaled_weight(name, flat_index, "NaN or an overflow after scaling");
}

// The largest exponent at which every e4m3 value (|v| <= 448 = 1.75 * 2^8) times 2^(u - 127)
// stays below bf16's largest finite value (~1.99 * 2^127): u - 119 <= 127.
constexpr int kMxfp8SafeExponent = 246;

}  // namespace

void check_mxfp8(const Tensor& codes, const Tensor& scale, const std::string& name) {
  check_mxfp8_layout(codes, scale, name);
  const Tensor code_data = codes.is_contiguous() ? codes : codes.clone();
  const Tensor scale_data = scale.is_contiguous() ? scale : scale.clone();
  const auto* code = static_cast<const uint8_t*>(code_data.raw());
  const auto* exponent = static_cast<const uint8_t*>(scale_data.raw());
  const int64_t in = codes.shape().back(), rows = codes.numel() / in, blocks = scale.shape().back();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t u = exponent[r * blocks + b];
      if (u == 255) refuse_nan_exponent(name, r, b);
      const int64_t end = std::min(in, (b + 1) * kMxfp8Block);
      if (u <= kMxfp8SafeExponent) {
        for (int64_t i = b * kMxfp8Block; i < end; ++i)
          if ((code[r * in + i] & 0x7f) == 0x7f) refuse_value(name, r * in + i);  // e4m3's NaN
        continue;
      }
      const float factor = std::ldexp(1.0f, static_cast<int>(u) - 127);
      for (int64_t i = b * kMxfp8Block; i < end; ++i) {
        const float value = e4m3_to_float(code[r * in + i]) * factor;
        if (!std::isfinite(bf16_to_float(float_to_bf16(value)))) refuse_value(name, r * in + i);
      }
    }
}

Tensor dequantize_mxfp8(const Tensor& codes, const Tensor& scale, const std::string& name) {
  check_mxfp8_layout(codes, scale, name);
  const int64_t in = codes.shape().back();
  const Tensor code_data = codes.is_contiguous() ? codes : codes.clone();
  const auto* code = static_cast<const uint8_t*>(code_data.raw());
  const uint8_t* exponent = scale.data<uint8_t>();
  const int64_t rows = codes.numel() / in, blocks = scale.shape().back();
  Tensor out = Tensor::zeros(codes.shape(), DType::bf16);
  auto* dst = static_cast<uint16_t*>(out.raw());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t u = exponent[r * blocks + b];
      if (u == 255) refuse_nan_exponent(name, r, b);
      const float factor = std::ldexp(1.0f, static_cast<int>(u) - 127);
      for (int64_t i = b * kMxfp8Block; i < std::min(in, (b + 1) * kMxfp8Block); ++i) {
        const float value = e4m3_to_float(code[r * in + i]) * factor;
        if (!std::isfinite(value)) refuse_value(name, r * in + i);
        dst[r * in + i] = float_to_bf16(value);
      }
    }
  return out;
}

}  // namespace msa::model
