// MXFP8 weights (the MiniMax-M3-MXFP8 release; docs/model.md): a Linear weight is
// stored as float8_e4m3fn codes [..., in] plus `<name>_scale_inv`, uint8 [..., ceil(in / 32)]:
// one UE8M0 scale per 32 consecutive input channels, value = e4m3(code) * 2^(u - 127) (the
// `weight_scale_inv` name notwithstanding, transformers' fine-grained FP8 path multiplies by
// it; u = 255 is E8M0's NaN and is refused).
#pragma once
#include <string>

#include "msa/tensor.h"

namespace msa::model {

constexpr int64_t kMxfp8Block = 32;

// Checks what dequantize_mxfp8 checks without converting (an msa::Error naming `name` or its
// scale): codes float8_e4m3fn with no NaN code (0x7f / 0xff), a uint8 scale [..., ceil(in /
// 32)] with no 255, and every value finite in bf16 (only blocks whose exponent could overflow
// are read value by value). For weights kept quantized (the CUDA expert kernels widen them).
void check_mxfp8(const Tensor& codes, const Tensor& scale, const std::string& name);

// The weight in bf16, which holds every e4m3 value times a power of two exactly (an msa::Error
// naming `name` for a scale of the wrong dtype or shape, a NaN scale, or a value that
// overflows). The result owns its memory.
Tensor dequantize_mxfp8(const Tensor& codes, const Tensor& scale, const std::string& name);

}  // namespace msa::model
