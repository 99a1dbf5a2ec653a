// Widening the routed experts' quantized weights (ExpertWeights, kernels.h) to bf16 in
// registers, shared by moe_experts_small.cu and moe_experts_grouped.cu so both kernels compute
// with the same weight values. The widening to bf16 (the grouped kernel's tensor-core
// operands) and to f32 (chunk_f32: the small kernel's CUDA-core products) use the repository's
// cvt conversions (cuda/decode/key_dequant.cuh: e4m3 pairs to f16 pairs in one cvt, e2m1
// re-encoded as e4m3).
//
// Exactness (why the kernels match f64 products of the host-dequantized weights):
//   MXFP8: e4m3 has 4 significant bits; times 2^(u - 127) it is exact in f32 and, inside
//     bf16's exponent range, in bf16's 8 bits (the host's dequantize_mxfp8 rounds the same f32
//     value with the same nearest-even rule, so the two agree bit for bit everywhere).
//   NVFP4: e2m1 (2 significant bits) x e4m3 (4) has at most 6 significant bits and lies in
//     [2^-10, 6 x 448]; the widening yields that product times 2^-6 (key_dequant's e2m1 ->
//     e4m3 re-encoding carries the factor), which is exact in f16 (the smallest, 2^-16, is
//     above f16's 2^-24 resolution; the largest, 42, below 65504) and in bf16. The kernels
//     multiply the f32 accumulator by 2^6 x the global scale once per output: the global
//     scale is an arbitrary f32, so it is never folded into the bf16 elements.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/common/common.cuh"
#include "cuda/common/e4m3.cuh"
#include "cuda/decode/key_dequant.cuh"
#include "kernels.h"

namespace msa::model::gpu {

// The factor the kernels apply to an NVFP4 accumulator besides the global scale: the widened
// elements carry e2m1 x e4m3 x 2^-6.
constexpr float kNvfp4WidenedFactor = 64.0f;

// 2^(u - 127) for a UE8M0 exponent u in 0..254 as f32 (u = 0 is the subnormal 2^-127; the
// loader refuses E8M0's NaN, 255).
__device__ __forceinline__ float ue8m0_value(uint32_t u) {
  return __uint_as_float(u != 0 ? u << 23 : 0x00400000u);
}

__device__ __forceinline__ float2 f16x2_to_float2(uint32_t pair) {
  return __half22float2(*reinterpret_cast<const __half2*>(&pair));
}

// Two f16 (one f16x2 word) times `scale` in f32, packed as a bf16 pair (nearest even: exact
// for the values above).
__device__ __forceinline__ uint32_t f16x2_to_bf16x2(uint32_t pair, float scale) {
  const float2 f = f16x2_to_float2(pair);
  return msa::cuda::pack_bf16(f.x * scale, f.y * scale);
}

// 16 MXFP8 codes (one 16-byte load: byte i = channel i, all in one 32-channel block) with
// their block's UE8M0 exponent -> 16 bf16 (out[0] channels 0-7, out[1] channels 8-15).
__device__ __forceinline__ void widen_mxfp8x16(const uint4& codes, uint32_t exponent, uint4 (&out)[2]) {
  const float scale = ue8m0_value(exponent);
  const uint32_t words[4] = {codes.x, codes.y, codes.z, codes.w};
  uint32_t bf16[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint32_t lo, hi;  // f16 pairs of channels (4i, 4i + 1), (4i + 2, 4i + 3)
    msa::cuda::e4m3x4_to_f16x2(words[i], lo, hi);
    bf16[2 * i] = f16x2_to_bf16x2(lo, scale);
    bf16[2 * i + 1] = f16x2_to_bf16x2(hi, scale);
  }
  out[0] = make_uint4(bf16[0], bf16[1], bf16[2], bf16[3]);
  out[1] = make_uint4(bf16[4], bf16[5], bf16[6], bf16[7]);
}

// 16 NVFP4 codes (one 8-byte load: byte k = channels 2k (low nibble) and 2k + 1, one
// 16-channel block) with the block's e4m3 scale -> 16 bf16 of e2m1 x e4m3 x 2^-6.
__device__ __forceinline__ void widen_nvfp4x16(const uint2& codes, uint32_t scale_code, uint4 (&out)[2]) {
  const uint32_t scale = msa::cuda::e4m3_to_f16x2_splat(scale_code);
  const uint32_t words[2] = {codes.x, codes.y};
  uint32_t bf16[8];
#pragma unroll
  for (int i = 0; i < 2; ++i) {  // word i: channels 8i .. 8i + 7
    const msa::cuda::E4m3Pairs pairs = msa::cuda::e2m1x8_to_e4m3x8(words[i]);
    uint32_t even_lo, even_hi, odd_lo, odd_hi;  // f16 pairs: even (c0, c2), (c4, c6); odd (c1, c3), (c5, c7)
    msa::cuda::e4m3x4_to_f16x2(pairs.even, even_lo, even_hi);
    msa::cuda::e4m3x4_to_f16x2(pairs.odd, odd_lo, odd_hi);
    // Products of <= 6 significant bits in [2^-16, 42]: exact in f16.
    const float2 e0 = f16x2_to_float2(msa::cuda::mul_f16x2(even_lo, scale));
    const float2 e1 = f16x2_to_float2(msa::cuda::mul_f16x2(even_hi, scale));
    const float2 o0 = f16x2_to_float2(msa::cuda::mul_f16x2(odd_lo, scale));
    const float2 o1 = f16x2_to_float2(msa::cuda::mul_f16x2(odd_hi, scale));
    bf16[4 * i] = msa::cuda::pack_bf16(e0.x, o0.x);      // c0, c1
    bf16[4 * i + 1] = msa::cuda::pack_bf16(e0.y, o0.y);  // c2, c3
    bf16[4 * i + 2] = msa::cuda::pack_bf16(e1.x, o1.x);  // c4, c5
    bf16[4 * i + 3] = msa::cuda::pack_bf16(e1.y, o1.y);  // c6, c7
  }
  out[0] = make_uint4(bf16[0], bf16[1], bf16[2], bf16[3]);
  out[1] = make_uint4(bf16[4], bf16[5], bf16[6], bf16[7]);
}

// A chunk's 16 codes as f32 (w[k] = channel k) for the CUDA-core products of
// moe_experts_small.cu, times chunk_factor's inverse: e4m3 pairs go to f16 pairs in one cvt
// (exact), e2m1 through the e4m3 re-encoding (value x 2^-6, exact), and each f16 to f32
// (HADD2.F32 on the FMA pipe, exact). Half a conversion per weight and no integer op for
// MXFP8; the integer decode it replaced (shift, shift, mask, multiply per weight) kept the
// ALU pipe two thirds busy (Nsight Compute) at ~8.5 weights per SM per cycle.
__device__ __forceinline__ void mxfp8_chunk_f32(const uint4& codes, float (&w)[16]) {
  const uint32_t words[4] = {codes.x, codes.y, codes.z, codes.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // word i: channels 4i .. 4i + 3
    uint32_t lo, hi;
    msa::cuda::e4m3x4_to_f16x2(words[i], lo, hi);
    const float2 a = f16x2_to_float2(lo), b = f16x2_to_float2(hi);
    w[4 * i] = a.x;
    w[4 * i + 1] = a.y;
    w[4 * i + 2] = b.x;
    w[4 * i + 3] = b.y;
  }
}
__device__ __forceinline__ void nvfp4_chunk_f32(const uint2& codes, float (&w)[16]) {
  const uint32_t words[2] = {codes.x, codes.y};
#pragma unroll
  for (int i = 0; i < 2; ++i) {  // word i: channels 8i .. 8i + 7
    const msa::cuda::E4m3Pairs pairs = msa::cuda::e2m1x8_to_e4m3x8(words[i]);
    uint32_t even_lo, even_hi, odd_lo, odd_hi;  // (c0, c2), (c4, c6); (c1, c3), (c5, c7)
    msa::cuda::e4m3x4_to_f16x2(pairs.even, even_lo, even_hi);
    msa::cuda::e4m3x4_to_f16x2(pairs.odd, odd_lo, odd_hi);
    const float2 e0 = f16x2_to_float2(even_lo), e1 = f16x2_to_float2(even_hi);
    const float2 o0 = f16x2_to_float2(odd_lo), o1 = f16x2_to_float2(odd_hi);
    float* out = w + 8 * i;
    out[0] = e0.x, out[1] = o0.x, out[2] = e0.y, out[3] = o0.y;
    out[4] = e1.x, out[5] = o1.x, out[6] = e1.y, out[7] = o1.y;
  }
}

// Per format: the bytes of codes holding 16 weights of a row, and how a kernel addresses a
// row's codes and block scales. Weight (expert e, output row o, channel i).
template <ExpertWeights F>
struct ExpertFormat;
template <>
struct ExpertFormat<ExpertWeights::mxfp8> {
  static constexpr int kCodeBytes16 = 16;  // 16 e4m3 codes
  static constexpr int kBlock = 32;        // channels per scale
  using Codes16 = uint4;
  __device__ static void widen16(const Codes16& codes, uint32_t scale, uint4 (&out)[2]) {
    widen_mxfp8x16(codes, scale, out);
  }
  __device__ static void chunk_f32(const Codes16& codes, float (&w)[16]) { mxfp8_chunk_f32(codes, w); }
  static constexpr float kChunkFactor = 1.0f;  // chunk_f32's values are the codes'
  __device__ static float scale_f32(uint32_t scale) { return ue8m0_value(scale); }
};
template <>
struct ExpertFormat<ExpertWeights::nvfp4> {
  static constexpr int kCodeBytes16 = 8;  // 16 e2m1 codes
  static constexpr int kBlock = 16;
  using Codes16 = uint2;
  __device__ static void widen16(const Codes16& codes, uint32_t scale, uint4 (&out)[2]) {
    widen_nvfp4x16(codes, scale, out);
  }
  __device__ static void chunk_f32(const Codes16& codes, float (&w)[16]) { nvfp4_chunk_f32(codes, w); }
  static constexpr float kChunkFactor = kNvfp4WidenedFactor;  // chunk_f32's values are the codes' x 2^-6
  __device__ static float scale_f32(uint32_t scale) { return msa::cuda::e4m3_value(static_cast<uint8_t>(scale)); }
};

// Bytes of codes per weight row of `in` channels (bf16: 2 per weight).
__host__ __device__ constexpr int64_t expert_row_bytes(ExpertWeights format, int64_t in) {
  return format == ExpertWeights::bf16 ? 2 * in : format == ExpertWeights::mxfp8 ? in : in / 2;
}

}  // namespace msa::model::gpu
