// Quantized index keys (msa/quantized_index_keys.h) into f16 mma.sync operands, in registers.
//
// Why f16 and not bf16: sm_90 converts e4m3 pairs to f16 pairs in one instruction
// (cvt.rn.f16x2.e4m3x2), and e2m1 codes reach e4m3 with a few integer ops (below); both are
// exact. bf16 would need an extra f16 -> f32 -> bf16 round trip per pair. The index
// queries, bf16 in memory, are then fed as f16 scaled by a power of two per row
// (f16_row_scale): exact for every element above max|q_row| * 2^-31, and the scaling is
// undone on the block maxima (a positive factor commutes with max).
#pragma once
#include <cuda_fp16.h>

#include "cuda/common/common.cuh"

namespace msa::cuda {

// D = A (16x16, row) * B (16x8, col) + C with f16 inputs, f32 accumulators (fragment layout
// as mma_bf16_16816).
__device__ __forceinline__ void mma_f16_16816(float (&d)[4], const uint32_t (&a)[4],
                                              const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ uint32_t pack_f16(float lo, float hi) {
  const __half2 pair = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

// Four e4m3 (byte i = channel i) -> f16x2 of channels (0, 1) and (2, 3); exact (e4m3 NaN
// stays NaN).
__device__ __forceinline__ void e4m3x4_to_f16x2(uint32_t word, uint32_t& lo, uint32_t& hi) {
  asm("{\n"
      "  .reg .b16 l, h;\n"
      "  mov.b32 {l, h}, %2;\n"
      "  cvt.rn.f16x2.e4m3x2 %0, l;\n"
      "  cvt.rn.f16x2.e4m3x2 %1, h;\n"
      "}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(word));
}

// One e4m3 scale -> f16x2 (s, s); exact.
__device__ __forceinline__ uint32_t e4m3_to_f16x2_splat(uint32_t code) {
  uint32_t out;
  asm("{\n"
      "  .reg .b16 c;\n"
      "  cvt.u16.u32 c, %1;\n"
      "  cvt.rn.f16x2.e4m3x2 %0, c;\n"
      "}\n"
      : "=r"(out)
      : "r"(code * 0x101u));
  return out;
}

// f16x2 product, round to nearest (subnormals kept).
__device__ __forceinline__ uint32_t mul_f16x2(uint32_t a, uint32_t b) {
  uint32_t out;
  asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(out) : "r"(a), "r"(b));
  return out;
}

// Eight e2m1 codes (one word; byte k = channels 2k (low nibble) and 2k + 1 (high))
// re-encoded as eight e4m3 codes of value * 2^-6 (exact, no NaN): a nibble s|e1 e0|m goes
// to the byte s|0 0 e1 e0|m 0 0, i.e. exponent field e and top mantissa bit m. e >= 1:
// 2^(e - 7) (1 + m / 2) = e2m1 * 2^-6; e = 0 is the e4m3 subnormal m * 2^-7 = (m / 2) *
// 2^-6. cvt.rn.f16x2.e4m3x2 then gives normal f16s (no subnormal reaches the tensor cores).
// even: byte k = channel 2k; odd: byte k = channel 2k + 1.
struct E4m3Pairs {
  uint32_t even, odd;
};
__device__ __forceinline__ E4m3Pairs e2m1x8_to_e4m3x8(uint32_t word) {
  return {((word << 4) & 0x80808080u) | ((word << 2) & 0x1c1c1c1cu),
          (word & 0x80808080u) | ((word >> 2) & 0x1c1c1c1cu)};
}

constexpr uint32_t kF16x2TwoPow6 = 0x54005400u;  // (2^6, 2^6)

// Power of two 2^e that brings a row's largest magnitude `amax` into [2^14, 2^15) (so every
// bf16 element of the row is exact in f16 down to amax * 2^-31); 1 for amax == 0. NaN/inf
// rows keep a finite factor (their scores are NaN/inf anyway).
__device__ __forceinline__ float f16_row_scale(float amax) {
  if (!(amax > 0.0f)) return 1.0f;
  const int exponent = static_cast<int>((__float_as_uint(amax) >> 23) & 0xff);  // biased
  int e = 141 - exponent;  // 14 - (exponent - 127); subnormal amax: clamp below
  e = max(-100, min(100, e));
  return __uint_as_float(static_cast<uint32_t>(e + 127) << 23);
}

}  // namespace msa::cuda
