// The per-block work of the decode index scan on fp8 / fp4 keys (indexer_decode.cuh: tile
// plan, channel order per quad, shared memory layout, budget). Made lean for few rows:
// - fp4 conversion: eight codes -> two e4m3 words (7 integer ops, e2m1x8_to_e4m3x8), one
//   cvt per f16 pair, one f16 multiply by the group scale * 2^6; the f16 operand is v * s
//   exactly. The cvt pairs channels (0, 2) / (1, 3) of a word instead of (0, 1) / (2, 3):
//   Q^T is permuted alike (fp4_permute_q).
// - compile-time m-tile and n-tile counts (quantized_block_partials<kMT, kNT>): no branch
//   between the two m-tiles' MMA chains, no predicated-off MMAs when one n-tile is active
//   (decode batch 1, Q 1: 4 of the 32 rows).
// - two accumulator chains per tile (even / odd k-steps), summed before the max: halves the
//   dependent MMA chain, which bounds the per-block latency with 8 warps per SM.
// - the block copy with compile-time strides (quantized_load_block): no per-granule
//   divisions or 64-bit address arithmetic.
#pragma once
#include "cuda/decode/indexer_decode_tiles.cuh"
#include "cuda/decode/key_dequant.cuh"
#include "cuda/launch.h"

namespace msa::cuda::indexer_detail {

// 4-byte asynchronous global -> shared copy (a page id), completed with its commit group.
__device__ __forceinline__ void cp_async_4(void* shared, const void* global) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_address(shared)),
               "l"(global));
}

// fp4 Q^T fragments to the cvt's pair order: (b0, b1) = channels ((0, 1), (2, 3)) of a
// quad's 4-channel unit -> ((0, 2), (1, 3)).
template <int kNTiles, int kKSteps>
__device__ __forceinline__ void fp4_permute_q(uint32_t (&qb)[kNTiles][kKSteps][2]) {
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
      const uint32_t b0 = qb[nt][ks][0], b1 = qb[nt][ks][1];
      qb[nt][ks][0] = __byte_perm(b0, b1, 0x5410);  // (b0.lo, b1.lo)
      qb[nt][ks][1] = __byte_perm(b0, b1, 0x7632);  // (b0.hi, b1.hi)
    }
}

// cp.async of one block's codes and scales (page `page`) into a ring stage: key rows
// (T::kRowPitchBytes apart), then the scales. block_size is a multiple of the keys one pass
// of the CTA copies (B 64 or 128, T::kThreads / granules per key <= 64), and its scale
// bytes fit one granule per thread.
template <class T>
__device__ __forceinline__ void quantized_load_block(unsigned char* stage, const uint8_t* codes,
                                                     const uint8_t* scales, int64_t page,
                                                     int block_size) {
  constexpr int kGranulesPerKey = T::kCodeBytes / 16;
  constexpr int kKeysPerPass = T::kThreads / kGranulesPerKey;
  static_assert(T::kThreads % kGranulesPerKey == 0 && 64 % kKeysPerPass == 0, "copy passes");
  const int t = threadIdx.x;
  const uint8_t* src = codes + page * (int64_t{block_size} * T::kCodeBytes) + t * 16;
  unsigned char* dst =
      stage + (t / kGranulesPerKey) * T::kRowPitchBytes + (t % kGranulesPerKey) * 16;
#pragma unroll
  for (int pass = 0; pass < T::kMaxBlock / kKeysPerPass; ++pass)
    if (pass * kKeysPerPass < block_size)
      cp_async_16(dst + pass * kKeysPerPass * T::kRowPitchBytes, src + pass * T::kThreads * 16);
  static_assert(T::kMaxBlock * T::kScaleBytes / 16 <= T::kThreads, "one scale granule per thread");
  if (t < block_size * T::kScaleBytes / 16)
    cp_async_16(stage + T::kMaxBlock * T::kRowPitchBytes + t * 16,
                scales + page * (int64_t{block_size} * T::kScaleBytes) + t * 16);
}

// One warp's keys [first_key, first_key + 16 kMT) of a landed stage against the CTA's rows:
// per-row maxima over those keys -> part[row] (lanes of group 0 write). kNT: n-tiles the
// code handles (1, or T::kNTiles with the inactive ones predicated off by n_tiles).
template <class T, KeyFormat kFormat, int kMT, int kNT>
__device__ __forceinline__ void quantized_block_partials(
    const unsigned char* stage, const uint32_t (&qb)[T::kNTiles][T::kKSteps][2], int first_key,
    int group, int quad, int n_tiles, float* part) {
  static_assert(kFormat == KeyFormat::fp8 || kFormat == KeyFormat::fp4, "quantized keys only");
  const unsigned char* scales = stage + T::kMaxBlock * T::kRowPitchBytes;
  float acc[2][kMT][kNT][4];  // [k-step parity]: two independent MMA chains
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[h][mt][nt][r] = 0.0f;
  const auto mma_all = [&](float (&d)[kNT][4], const uint32_t (&a)[4], int ks) {
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
      if (kNT == 1 || nt < n_tiles) mma_f16_16816(d[nt], a, qb[nt][ks]);
  };
  float s_lo[kMT], s_hi[kMT];  // fp8: token scales of keys key, key + 8
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
    const int key = first_key + mt * 16 + group;  // A rows key and key + 8
    const unsigned char* row_lo = stage + key * T::kRowPitchBytes;
    const unsigned char* row_hi = row_lo + 8 * T::kRowPitchBytes;
    if constexpr (kFormat == KeyFormat::fp8) {
      uint32_t lo[T::kKSteps], hi[T::kKSteps];  // word ks = the 4 channels of k-step ks
#pragma unroll
      for (int c = 0; c < T::kChunks; ++c) {
        const uint4 l = *reinterpret_cast<const uint4*>(row_lo + 16 * (quad * T::kChunks + c));
        const uint4 h = *reinterpret_cast<const uint4*>(row_hi + 16 * (quad * T::kChunks + c));
        lo[4 * c] = l.x, lo[4 * c + 1] = l.y, lo[4 * c + 2] = l.z, lo[4 * c + 3] = l.w;
        hi[4 * c] = h.x, hi[4 * c + 1] = h.y, hi[4 * c + 2] = h.z, hi[4 * c + 3] = h.w;
      }
      const float* token_scale = reinterpret_cast<const float*>(scales);
      s_lo[mt] = token_scale[key];
      s_hi[mt] = token_scale[key + 8];
#pragma unroll
      for (int ks = 0; ks < T::kKSteps; ++ks) {
        uint32_t a[4];
        e4m3x4_to_f16x2(lo[ks], a[0], a[2]);
        e4m3x4_to_f16x2(hi[ks], a[1], a[3]);
        mma_all(acc[ks & 1][mt], a, ks);
      }
    } else {  // fp4: words 2c, 2c + 1 = chunk c's channels 0-7, 8-15
      uint32_t lo[2 * T::kChunks], hi[2 * T::kChunks];
      if constexpr (T::kChunks == 2) {
        const uint4 l = *reinterpret_cast<const uint4*>(row_lo + 16 * quad);
        const uint4 h = *reinterpret_cast<const uint4*>(row_hi + 16 * quad);
        lo[0] = l.x, lo[1] = l.y, lo[2] = l.z, lo[3] = l.w;
        hi[0] = h.x, hi[1] = h.y, hi[2] = h.z, hi[3] = h.w;
      } else {
        const uint2 l = *reinterpret_cast<const uint2*>(row_lo + 8 * quad);
        const uint2 h = *reinterpret_cast<const uint2*>(row_hi + 8 * quad);
        lo[0] = l.x, lo[1] = l.y;
        hi[0] = h.x, hi[1] = h.y;
      }
      uint32_t g_lo[T::kChunks], g_hi[T::kChunks];  // f16x2 splats of group scale * 2^6
#pragma unroll
      for (int c = 0; c < T::kChunks; ++c) {
        g_lo[c] = mul_f16x2(
            e4m3_to_f16x2_splat(scales[key * T::kScaleBytes + quad * T::kChunks + c]),
            kF16x2TwoPow6);
        g_hi[c] = mul_f16x2(
            e4m3_to_f16x2_splat(scales[(key + 8) * T::kScaleBytes + quad * T::kChunks + c]),
            kF16x2TwoPow6);
      }
#pragma unroll
      for (int word = 0; word < 2 * T::kChunks; ++word) {
        const int c = word / 2;
        const E4m3Pairs l = e2m1x8_to_e4m3x8(lo[word]), h = e2m1x8_to_e4m3x8(hi[word]);
        uint32_t le[2], lo_odd[2], he[2], ho[2];  // [0]: channels 0-3 of the word, [1]: 4-7
        e4m3x4_to_f16x2(l.even, le[0], le[1]);      // (0, 2), (4, 6)
        e4m3x4_to_f16x2(l.odd, lo_odd[0], lo_odd[1]);  // (1, 3), (5, 7)
        e4m3x4_to_f16x2(h.even, he[0], he[1]);
        e4m3x4_to_f16x2(h.odd, ho[0], ho[1]);
#pragma unroll
        for (int half = 0; half < 2; ++half) {  // k-step 2 word + half
          const int ks = 2 * word + half;
          uint32_t a[4];
          a[0] = mul_f16x2(le[half], g_lo[c]);
          a[1] = mul_f16x2(he[half], g_hi[c]);
          a[2] = mul_f16x2(lo_odd[half], g_lo[c]);
          a[3] = mul_f16x2(ho[half], g_hi[c]);
          mma_all(acc[ks & 1][mt], a, ks);
        }
      }
    }
  }
  // Accumulator (mt, nt): c0/c1 = key group, rows 2 quad / +1; c2/c3 = key group + 8.
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt) {
    if (kNT > 1 && nt >= n_tiles) continue;
    float even = 0.0f, odd = 0.0f;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      float v[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) v[r] = acc[0][mt][nt][r] + acc[1][mt][nt][r];
      if constexpr (kFormat == KeyFormat::fp8) {
        v[0] *= s_lo[mt], v[1] *= s_lo[mt], v[2] *= s_hi[mt], v[3] *= s_hi[mt];
      }
      even = mt == 0 ? fmaxf(v[0], v[2]) : fmaxf(even, fmaxf(v[0], v[2]));
      odd = mt == 0 ? fmaxf(v[1], v[3]) : fmaxf(odd, fmaxf(v[1], v[3]));
    }
    store_key_group_max(even, odd, part, nt, group, quad);
  }
}

}  // namespace msa::cuda::indexer_detail
