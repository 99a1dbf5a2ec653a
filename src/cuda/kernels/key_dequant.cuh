// Quantized index keys (msa/quantized_index_keys.h) into f16 mma.sync operands, in registers.
//
// Why f16 and not bf16: sm_90 converts e4m3 pairs to f16 pairs in one instruction
// (cvt.rn.f16x2.e4m3x2), and e2m1 pairs reach f16 with three integer ops (below); both are
// exact. bf16 would need an extra f16 -> f32 -> bf16 round trip per pair. The index
// queries, bf16 in memory, are then fed as f16 scaled by a power of two per row
// (f16_row_scale): exact for every element above max|q_row| * 2^-31, and the scaling is
// undone on the block maxima (a positive factor commutes with max).
#pragma once
#include <cuda_fp16.h>

#include "cuda/kernels/common.cuh"

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

// Eight e2m1 codes in one word (byte k = channels 2k (low nibble) and 2k + 1 (high)),
// split once per word for e2m1x2_scaled_f16x2: the high nibbles in place, the low nibbles
// moved up into the high nibble positions; every low nibble of both words is zero.
struct E2m1Word {
  uint32_t odd;   // word & 0xf0f0f0f0: channel 2k + 1 in bits 8k + 4 .. 8k + 7
  uint32_t even;  // (word << 4) & 0xf0f0f0f0: channel 2k in bits 8k + 4 .. 8k + 7
};
__device__ __forceinline__ E2m1Word split_e2m1(uint32_t word) {
  return {word & 0xf0f0f0f0u, (word << 4) & 0xf0f0f0f0u};
}

// Channels (2k, 2k + 1) of an E2m1Word as f16x2 of value * 2^-14, exact (e2m1 0.5 becomes
// the f16 subnormal 2^-15). Byte 1 of y takes the even channel's nibble into bits 12-15
// (sign at 15, exponent and mantissa at 12-14), byte 3 the odd one's into bits 28-31; bytes
// 0 and 2 repeat masked bytes (low nibbles zero). Then (y | y >> 3) & 0x8e008e00 keeps each
// sign at bit 15 / 31 and moves exponent+mantissa to bits 9-11 / 25-27: an f16 with
// exponent field e (0..3) and top mantissa bit m, i.e. the e2m1 value (bias 1) times
// 2^(1 - 15). No stray bit reaches the mask: y's bits 9-11, 18 and 25-27 are low nibbles.
__device__ __forceinline__ uint32_t e2m1x2_to_f16x2_raw(E2m1Word w, int k) {
  const uint32_t selector = k | (k << 4) | (k << 8) | ((4 + k) << 12);
  const uint32_t y = __byte_perm(w.even, w.odd, selector);
  return (y | (y >> 3)) & 0x8e008e00u;
}

// f16x2 product, round to nearest (subnormals kept).
__device__ __forceinline__ uint32_t mul_f16x2(uint32_t a, uint32_t b) {
  uint32_t out;
  asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(out) : "r"(a), "r"(b));
  return out;
}

constexpr uint32_t kF16x2TwoPow14 = 0x74007400u;  // (2^14, 2^14)

// Channels (2k, 2k + 1) of an E2m1Word times an f16x2 splat scale: the dequantized keys,
// exact (<= 6 significant bits, in [2^-10, 2688]: normal f16). The 2^14 comes first so that
// the tensor cores never see a subnormal.
__device__ __forceinline__ uint32_t e2m1x2_scaled_f16x2(E2m1Word w, int k, uint32_t scale) {
  return mul_f16x2(mul_f16x2(e2m1x2_to_f16x2_raw(w, k), kF16x2TwoPow14), scale);
}

// Eight e2m1 codes (one word, as split_e2m1) re-encoded as eight e4m3 codes of value * 2^-6
// (exact, no NaN): a nibble s|e1 e0|m goes to the byte s|0 0 e1 e0|m 0 0, i.e. exponent
// field e and top mantissa bit m. e >= 1: 2^(e - 7) (1 + m / 2) = e2m1 * 2^-6; e = 0 is the
// e4m3 subnormal m * 2^-7 = (m / 2) * 2^-6. cvt.rn.f16x2.e4m3x2 then gives normal f16s (no
// subnormal reaches the tensor cores). even: byte k = channel 2k; odd: byte k = channel 2k + 1.
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
