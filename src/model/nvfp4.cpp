#include "nvfp4.h"

#include <cmath>

#include "msa/error.h"
#include "quantized_refusals.h"
#include "msa/quantized_index_keys.h"  // e2m1_to_float: the one e2m1 table of the library

namespace msa::model {

float nvfp4_scalar(const Tensor& scalar, const std::string& tensor_name) {
  const std::string what = "tensor '" + tensor_name + "'";
  if (scalar.dtype() != DType::f32) throw_arg_error(what, "float32", dtype_name(scalar.dtype()));
  if (scalar.numel() != 1 || scalar.dim() > 1)
    throw_arg_error(what, "one value (shape [] or [1])", shape_string(scalar.shape()));
  const float value = scalar.data<float>()[0];
  if (!std::isfinite(value) || value <= 0)
    throw_arg_error(what, "a positive finite scale", std::to_string(value));
  return value;
}

namespace {

// The dtype and shape checks shared by check_nvfp4 and dequantize_nvfp4; returns the global
// scale.
float check_nvfp4_layout(const Tensor& codes, const Tensor& scale, const Tensor& global_scale,
                         const std::string& name) {
  const std::string codes_name = "tensor '" + name + "'", scale_name = "tensor '" + name + "_scale'";
  if (codes.dtype() != DType::u8 || codes.dim() < 1)
    throw_arg_error(codes_name, "uint8 packed e2m1 codes [..., in / 2]", dtype_name(codes.dtype()));
  const float global = nvfp4_scalar(global_scale, name + "_scale_2");
  if (scale.dtype() != DType::e4m3)
    throw_arg_error(scale_name, "float8_e4m3fn (one per 16 input channels)", dtype_name(scale.dtype()));
  Shape shape = codes.shape();
  const int64_t in = 2 * shape.back();
  if (in % kNvfp4Block != 0)
    throw_arg_error(codes_name, "a packed width holding a multiple of 16 channels (in / 2 with in % 16 == 0)",
                    shape_string(codes.shape()));
  Shape expected = shape;
  expected.back() = in / kNvfp4Block;
  if (scale.shape() != expected)
    throw_arg_error(scale_name, shape_string(expected) + " (one scale per 16 of the " + std::to_string(in) +
                                    " input channels packed in " + shape_string(codes.shape()) + ")",
                    shape_string(scale.shape()));
  return global;
}

void refuse_nan_scale(const std::string& name, int64_t row, int64_t block) {
  refuse_block_scale(name + "_scale", row, block, "a finite e4m3 scale", "NaN");
}

void refuse_overflow(const std::string& name, int64_t flat_index) {
  refuse_scaled_weight(name, flat_index, "an overflow after scaling");
}

}  // namespace

float check_nvfp4(const Tensor& codes, const Tensor& scale, const Tensor& global_scale, const std::string& name) {
  const float global = check_nvfp4_layout(codes, scale, global_scale, name);
  const Tensor code_data = codes.is_contiguous() ? codes : codes.clone();
  const Tensor scale_data = scale.is_contiguous() ? scale : scale.clone();
  const auto* packed = static_cast<const uint8_t*>(code_data.raw());
  const auto* block_scale = static_cast<const uint8_t*>(scale_data.raw());
  const int64_t in = 2 * codes.shape().back(), rows = codes.numel() / codes.shape().back(), blocks = in / kNvfp4Block;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t s = block_scale[r * blocks + b];
      if ((s & 0x7f) == 0x7f) refuse_nan_scale(name, r, b);
      const float factor = e4m3_to_float(s);
      if (std::isfinite(6.0f * factor * global)) continue;  // e2m1's largest magnitude is 6
      for (int64_t i = b * kNvfp4Block; i < (b + 1) * kNvfp4Block; ++i)
        if (!std::isfinite(e2m1_to_float(nvfp4_code(packed + r * (in / 2), i)) * factor * global))
          refuse_overflow(name, r * in + i);
    }
  return global;
}

Tensor dequantize_nvfp4(const Tensor& codes, const Tensor& scale, const Tensor& global_scale,
                        const std::string& name) {
  const float global = check_nvfp4_layout(codes, scale, global_scale, name);
  Shape shape = codes.shape();
  const int64_t in = 2 * shape.back();
  const Tensor code_data = codes.is_contiguous() ? codes : codes.clone();
  const Tensor scale_data = scale.is_contiguous() ? scale : scale.clone();
  const auto* packed = static_cast<const uint8_t*>(code_data.raw());
  const auto* block_scale = static_cast<const uint8_t*>(scale_data.raw());
  const int64_t rows = codes.numel() / shape.back(), blocks = in / kNvfp4Block;
  shape.back() = in;
  Tensor out = Tensor::zeros(shape, DType::bf16);
  auto* dst = static_cast<uint16_t*>(out.raw());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t s = block_scale[r * blocks + b];
      if ((s & 0x7f) == 0x7f) refuse_nan_scale(name, r, b);
      const float factor = e4m3_to_float(s);
      for (int64_t i = b * kNvfp4Block; i < (b + 1) * kNvfp4Block; ++i) {
        const float value = e2m1_to_float(nvfp4_code(packed + r * (in / 2), i)) * factor * global;
        if (!std::isfinite(value)) refuse_overflow(name, r * in + i);
        dst[r * in + i] = float_to_bf16(value);
      }
    }
  return out;
}

}  // namespace msa::model
