// NVFP4 weights in NVIDIA ModelOpt's export layout (nvidia/MiniMax-M3-NVFP4 and the other
// ModelOpt NVFP4 releases; docs/model.md "Checkpoint formats"). A Linear weight [out, in] is
//   `<name>`          uint8 [out, in / 2]: two e2m1 codes per byte, element 2j in the LOW
//                     nibble, 2j + 1 in the high one (ModelOpt packs q[..., 1::2] << 4 |
//                     q[..., 0::2]); a nibble is sign (bit 3) and magnitude code 0..7 for
//                     0, 0.5, 1, 1.5, 2, 3, 4, 6;
//   `<name>_scale`    float8_e4m3fn [out, in / 16]: one scale per 16 input channels;
//   `<name>_scale_2`  float32 scalar ([] or [1]): the tensor's global scale (ModelOpt: amax / (6 * 448));
//   `input_scale`     float32 scalar beside the weight (the activation scale of W4A4 GEMMs;
//                     checked, not used by a dequantizing loader);
// value[r][i] = e2m1(code[r][i]) * e4m3(scale[r][i / 16]) * scale_2.
#pragma once
#include <string>

#include "msa/tensor.h"

namespace msa::model {

constexpr int64_t kNvfp4Block = 16;

// The global scale (`<name>_scale_2`) or an input scale as a float: an msa::Error naming
// `tensor_name` unless it is one float32 value (shape [] or [1]), finite and > 0.
float nvfp4_scalar(const Tensor& scalar, const std::string& tensor_name);

// The weight in bf16 ([..., 2 * packed width]): e2m1 * e4m3 is exact in f32, the product
// with the global scale is rounded once to f32 and then to bf16 (nearest even). An
// msa::Error naming `name` (or its scale) for codes that are not uint8, a scale of the
// wrong dtype or shape (it must be [..., in / 16] with in % 16 == 0), a NaN scale code
// (0x7f / 0xff), or a global scale that is not a positive finite float32. The result owns
// its memory. Rows of codes and scales may be slices of the stored tensors (views).
Tensor dequantize_nvfp4(const Tensor& codes, const Tensor& scale, const Tensor& global_scale,
                        const std::string& name);

// Checks what dequantize_nvfp4 checks without converting (an msa::Error naming `name` or its
// scales) and returns the global scale: uint8 codes, e4m3 scales [..., in / 16] with no NaN
// code, a positive finite global scale, and every value e2m1 * scale * global finite in f32
// (only blocks whose largest value 6 * scale * global could overflow are read value by value).
// For weights kept quantized (the CUDA expert kernels widen them).
float check_nvfp4(const Tensor& codes, const Tensor& scale, const Tensor& global_scale, const std::string& name);

// The e2m1 code of element i of a packed row (low nibble first).
inline uint8_t nvfp4_code(const uint8_t* packed_row, int64_t i) {
  const uint8_t byte = packed_row[i / 2];
  return i % 2 ? static_cast<uint8_t>(byte >> 4) : static_cast<uint8_t>(byte & 0xf);
}

}  // namespace msa::model
