#include "mxfp8.h"

#include <cmath>

#include "msa/error.h"

namespace msa::model {

Tensor dequantize_mxfp8(const Tensor& codes, const Tensor& scale, const std::string& name) {
  const std::string scale_name = "tensor '" + name + "_scale_inv'";
  if (codes.dtype() != DType::e4m3 || codes.dim() < 1)
    throw_arg_error("tensor '" + name + "'", "float8_e4m3fn codes", dtype_name(codes.dtype()));
  if (scale.dtype() != DType::u8) throw_arg_error(scale_name, "uint8 (UE8M0)", dtype_name(scale.dtype()));
  Shape expected = codes.shape();
  const int64_t in = expected.back();
  expected.back() = (in + kMxfp8Block - 1) / kMxfp8Block;
  if (scale.shape() != expected) throw_arg_error(scale_name, shape_string(expected), shape_string(scale.shape()));

  const Tensor code_data = codes.is_contiguous() ? codes : codes.clone();
  const auto* code = static_cast<const uint8_t*>(code_data.raw());
  const uint8_t* exponent = scale.data<uint8_t>();
  const int64_t rows = codes.numel() / in, blocks = expected.back();
  Tensor out = Tensor::zeros(codes.shape(), DType::bf16);
  auto* dst = static_cast<uint16_t*>(out.raw());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t u = exponent[r * blocks + b];
      if (u == 255) throw_arg_error(scale_name + " at [" + std::to_string(r) + ", " + std::to_string(b) + "]",
                                    "a UE8M0 exponent (0..254)", "255 (NaN)");
      const float factor = std::ldexp(1.0f, static_cast<int>(u) - 127);
      for (int64_t i = b * kMxfp8Block; i < std::min(in, (b + 1) * kMxfp8Block); ++i) {
        const float value = e4m3_to_float(code[r * in + i]) * factor;
        if (!std::isfinite(value))
          throw_arg_error("tensor '" + name + "' at flat index " + std::to_string(r * in + i),
                          "a finite weight", "NaN or an overflow after scaling");
        dst[r * in + i] = float_to_bf16(value);
      }
    }
  return out;
}

}  // namespace msa::model
