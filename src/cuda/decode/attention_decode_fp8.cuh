// fp8 K/V units of the decode attention kernel (attention_decode.cuh, decode_attention_kernel
// with kFp8; docs/msa.md §6.6): a 64-key unit's e4m3 codes and f32 scales stream through the
// cp.async ring at half the bytes of bf16, and the scales are applied in f32 (the K scale
// multiplies each score column before the softmax, the V scale each probability column before
// it is rounded to bf16 for P.V; the row sums use the unscaled probabilities). Two ways from
// the codes to the MMAs, chosen by the kernel variant:
//
// 1. Fragments (the key-split kernel, kSplitKeys: every warp attends to its own 16 keys of a
//    unit, so each code is widened once per CTA either way). The warps build their MMA
//    operands straight from the codes in the ring stage: no bf16 tile, no second barrier per
//    unit, no shared-memory round trip. Code rows sit at pitch D + 16 bytes, so the 8 rows of
//    each ldmatrix 8x8 (16-byte row pieces) fall into 8 distinct 16-byte bank groups
//    (D = 128: 144 r mod 128 = 16 r; D = 64: 80 r mod 128 = 16 (5 r mod 8)): conflict-free.
//    - S = Q K^T runs in f16 (mma m16n8k16 .f16): K's B operand (B[k = d][n = key]) is read
//      with a plain ldmatrix on the byte tile: lane (g = lane / 4, c = lane % 4) of an 8x8
//      b16 matrix receives row g's bytes 4c .. 4c + 3, i.e. d = 4c .. 4c + 3 of key g of the
//      16-d piece, and cvt.rn.f16x2.e4m3x2 turns bytes (0, 1) into b[0] and (2, 3) into
//      b[1] (exact). The MMA reads b[0] as k = 2c, 2c + 1 and b[1] as k = 2c + 8, 2c + 9, so
//      k step s of the MMA holds d = 16 s + {4c, 4c + 1 | 4c + 2, 4c + 3} instead of
//      16 s + {2c, 2c + 1 | 2c + 8, 2c + 9}: a permutation of the reduction, which Q's A
//      fragments follow (load_q_fragments_f16). Q is bf16; f16 would overflow beyond 65504,
//      so each row is scaled by a power of two into [2^14, 2^15) (f16_row_scale, as the fp8
//      index scan does: exact for every element above max|q_row| 2^-31), and the softmax
//      multiplies row r's scores by scale_log2 / 2^e_r instead of scale_log2 (exact: a power
//      of two). The products q k are exact in f32 either way (8 + 4 significant bits).
//    - O += P V stays bf16 (P rounded to bf16 as on a bf16 cache; f16 P would overflow or go
//      subnormal for V scales far from 1). V's B operand is B[k = key][n = channel], and the
//      bytes of consecutive keys of one channel are a row apart: ldmatrix.trans on the byte
//      tile (b16 elements = channel pairs) gives lane (g, c) the 16-bit pair (channels 2g,
//      2g + 1) of keys 2c and 2c + 1: bytes [k0 ch0, k0 ch1, k1 ch0, k1 ch1]. One prmt
//      (0x3120) makes [k0 ch0, k1 ch0 | k0 ch1, k1 ch1]: the e4m3 pairs of B[k = 2c, 2c +
//      1][n = g] for two n-tiles, one of the piece's even channels and one of its odd ones.
//      Each pair goes e4m3x2 -> f16x2 (cvt) -> two f32 (cvt.f32.f16, on the FMA pipe) -> the
//      f32s' high halves (prmt): bf16, exact (4 significant bits). So the output columns come
//      permuted: n-tile 2p holds channels 16p + 2n, n-tile 2p + 1 channels 16p + 2n + 1, and
//      lane c's accumulators hold channels 16p + 4c + {0, 1, 2, 3} = (o[2p][0], o[2p + 1][0],
//      o[2p][1], o[2p + 1][1]) of row 0 ([2], [3] of row 1): Fp8WarpRowsState's stores write
//      them as 4 consecutive floats.
//    Per unit and lane (one warp's 16 keys, D = 128): K 4 ldmatrix.x4 + 32 cvt.f16x2.e4m3x2
//    + 16 HMMA; V 4 ldmatrix.x4.trans + 16 prmt + 32 cvt.f16x2.e4m3x2 + 64 cvt.f32.f16 + 32
//    prmt + 16 HMMA (SASS of decode_attention_kernel<128, true, true>, per attend instance: 16
//    HMMA.F16 + 16 HMMA.BF16, 4 LDSM + 4 LDSM.T, 64 F2FP.F16.E4M3, 64 HADD2.F32, 48 PRMT).
//    64 conversion-pipe instructions (16 / clock / SM on sm_90) per lane and unit, 8,192 per
//    unit over the CTA, against path 2's 8,192 plus its stores, its reloads and a barrier.
//
// 2. A shared bf16 tile (the rows-per-warp kernel, QC x G > 16: warp w holds rows 16 w ..
//    16 w + 15 and ALL 64 keys of each unit, so up to 4 warps read every code). The CTA widens
//    the unit once into one bf16 tile in the layout of the bf16 ring stages (rows of D at pitch
//    D + 8) after the ring barrier, then a second barrier, and the warps run the bf16 warp
//    tile on it: 16 x (one 8-byte load, 4 cvt.f16x2.e4m3x2 + 8 cvt.f32.f16 + 4 prmt, one
//    16-byte store) per thread and unit (D = 128). Why not fragments here: each active warp
//    would convert the whole unit, 128 cvt.f16x2.e4m3x2 per lane and unit (path 1's count x 4),
//    so 4 warps issue 4 x 128 x 32 = 16,384 conversions per unit against the tile's 128 x 64 =
//    8,192; on sm_90's 16 conversions / clock / SM that is ~500 more clocks of the conversion
//    pipe per unit, against the second barrier and the tile's stores and reloads (unmeasured:
//    the case to time; with 2 active warps, rows <= 32, the counts are equal).
//
// Why bf16 (or f16) operands and not e4m3 MMAs: e4m3 mma.sync (m16n8k32) would need Q in e4m3
// too, a third rounding of the query. Why the scales stay out of the operands: folding a scale
// into a bf16 value rounds it a second time (2^-9), into an f16 one overflows for scales beyond
// ~146 (65504 / 448).
//
// Shared memory (D = 128). Fragments: 5 stages x (K + V codes 2 x 64 x 144 B + 2 x 64 f32
// scales) = 94,720 B; 5 stages, not 3: a unit is half the bytes, so 4 units in flight keep
// as many bytes in flight per CTA as the bf16 ring's 2 (64 KB); the key-split merge's scratch
// (4 x 16 x (D + 8) f32 = 34,816 B) is the ring. Tile: 4 stages x (2 x 64 x 128 B + 512 B)
// = 67,584 B + the tile 2 x 64 x 136 x 2 B = 34,816 B: 102,400 B. Both stay under the bf16
// ring's 104,448 B (2 CTAs per SM as for bf16).
#pragma once
#include "cuda/attention/attention_block_tile.cuh"
#include "cuda/decode/key_dequant.cuh"
#include "cuda/launch.h"

namespace msa::cuda::attn {

// The fp8 ring of each path (kFragments: path 1 above; otherwise path 2).
template <bool kFragments>
constexpr int fp8_stages() {
  return kFragments ? 5 : 4;
}
// Byte pitch of a code row in a stage: path 1 pads for conflict-free ldmatrix; path 2 reads
// the rows in 8-byte pieces (a half warp = one 128-byte row: conflict-free unpadded).
template <int D, bool kFragments>
constexpr int fp8_code_pitch() {
  return kFragments ? D + 16 : D;
}

// One ring stage: K codes [64][pitch], V codes [64][pitch] (bytes), then the 64 K and the 64
// V scales (f32).
template <int D, bool kFragments>
constexpr size_t fp8_stage_bytes() {
  return size_t{2} * kKeyTile * fp8_code_pitch<D, kFragments>() + size_t{2} * kKeyTile * sizeof(float);
}
template <int D, bool kFragments>
__device__ __forceinline__ const float* fp8_stage_key_scales(const uint8_t* stage) {
  return reinterpret_cast<const float*>(stage + 2 * kKeyTile * fp8_code_pitch<D, kFragments>());
}

// 4-byte asynchronous global -> shared copy (cp.async.ca: .cg copies 16 bytes only); `valid`
// false writes zeros instead and reads nothing.
__device__ __forceinline__ void cp_async_4(void* shared, const void* global, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_address(shared)), "l"(global),
               "r"(valid ? 4 : 0));
}

// Copies the fp8 unit of (block, its page ids in the K and V caches as loaded (page_id_of;
// checked here), first key `sub` of the block, KV head g) into `stage`: rows >= valid_rows
// (keys no row of the CTA may see: past the sequence, or garbage of a partial page) are
// zero-filled, codes and scales alike, and never read. Called by all
// kThreads threads (2 x 64: thread t copies the K scale of row t, or the V scale of row
// t - 64); the caller commits and waits.
template <int D, bool kFragments, int kThreads>
__device__ __forceinline__ void load_fp8_unit_async(uint8_t* stage, const KeyLayout& k_layout,
                                                    const KeyLayout& v_layout, const Fp8Kv& k,
                                                    const Fp8Kv& v, int32_t block, int32_t k_id,
                                                    int32_t v_id, int sub, int g, int valid_rows,
                                                    PageFaultNote& note) {
  static_assert(kThreads == 2 * kKeyTile, "one scale per thread");
  constexpr int kChunks = D / 16;  // 16-byte chunks per row
  constexpr int kPitch = fp8_code_pitch<D, kFragments>();
  const int64_t k_page = checked_page(k_layout, block, k_id, note);
  const int64_t v_page = checked_page(v_layout, block, v_id, note);
  const uint8_t* k_src = k.codes + k_page * k_layout.block_stride + g * k_layout.head_stride +
                         sub * k_layout.token_stride;
  const uint8_t* v_src = v.codes + v_page * v_layout.block_stride + g * v_layout.head_stride +
                         sub * v_layout.token_stride;
  for (int c = threadIdx.x; c < 2 * kKeyTile * kChunks; c += kThreads) {
    const int row = c / kChunks, col = (c % kChunks) * 16;  // rows 0-63: K, 64-127: V
    const bool is_v = row >= kKeyTile;
    const int key = is_v ? row - kKeyTile : row;
    const bool valid = key < valid_rows;
    const uint8_t* src = is_v ? v_src + key * v_layout.token_stride : k_src + key * k_layout.token_stride;
    cp_async_16(stage + row * kPitch + col, valid ? src + col : k.codes, valid);
  }
  const int t = threadIdx.x;
  const bool is_v = t >= kKeyTile;
  const int key = is_v ? t - kKeyTile : t;
  const float* scales = is_v ? v.scales.data : k.scales.data;  // (field by field: no copy of the
  const int64_t offset = is_v                                    //  parameter struct to select it)
                             ? v_page * v.scales.page_stride + g * v.scales.head_stride +
                                   (sub + key) * v.scales.token_stride
                             : k_page * k.scales.page_stride + g * k.scales.head_stride +
                                   (sub + key) * k.scales.token_stride;
  const bool valid = key < valid_rows;
  cp_async_4(reinterpret_cast<float*>(stage + 2 * kKeyTile * kPitch) + t, valid ? scales + offset : scales, valid);
}

// An f16 pair holding two e4m3 values (cvt.rn.f16x2.e4m3x2, key_dequant.cuh) -> bf16x2: the
// high halves of the two f32 values (cvt.f32.f16 runs on the FMA pipe, prmt on the integer
// one; no conversion-pipe pack). Exact: an e4m3 value has 4 significant bits and an exponent
// in [2^-9, 2^8], so its f32 has 16 zero low bits (a NaN stays a NaN).
__device__ __forceinline__ uint32_t f16x2_to_bf16x2(uint32_t pair) {
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&pair));
  return __byte_perm(__float_as_uint(f.x), __float_as_uint(f.y), 0x7632);
}

// Path 2: widens the 128 code rows of `stage` (64 K rows, then 64 V rows) into `tile`: bf16
// rows of D at pitch D + 8, K rows 0-63 then V rows 64-127 (a bf16 ring stage's layout).
// Called by all kThreads threads; the caller synchronises before the warps read the tile.
template <int D, int kThreads>
__device__ __forceinline__ void widen_fp8_unit(uint16_t* tile, const uint8_t* stage) {
  constexpr int kPieces = D / 8;  // 8-code pieces per row
#pragma unroll 2
  for (int c = threadIdx.x; c < 2 * kKeyTile * kPieces; c += kThreads) {
    const int row = c / kPieces, col = (c % kPieces) * 8;
    const uint2 codes = *reinterpret_cast<const uint2*>(stage + row * fp8_code_pitch<D, false>() + col);
    uint32_t h[4];
    e4m3x4_to_f16x2(codes.x, h[0], h[1]);
    e4m3x4_to_f16x2(codes.y, h[2], h[3]);
    *reinterpret_cast<uint4*>(tile + row * smem_pitch<D>() + col) =
        make_uint4(f16x2_to_bf16x2(h[0]), f16x2_to_bf16x2(h[1]), f16x2_to_bf16x2(h[2]), f16x2_to_bf16x2(h[3]));
  }
}

// ---- path 1: MMA fragments from the codes --------------------------------------------

// Q of the warp's 16 rows as f16 A fragments of S = Q K^T in path 1's reduction order: k step
// s, lane c: a[0] / a[1] = rows 0 / 1 at d = 16 s + 4c, 16 s + 4c + 1 (k = 2c, 2c + 1), a[2] /
// a[3] at d = 16 s + 4c + 2, + 3 (k = 2c + 8, 2c + 9). Each row is multiplied by the power of
// two f16_row_scale(max|q_row|) (the quad holds the row: lane c its d = 4c .. 4c + 3 of every
// 16) and row_scale_log2[r] = scale_log2 / that power, the softmax's factor for row r. A null
// row pointer gives a zero row. Called by the whole warp (quad shuffles).
template <int D>
__device__ __forceinline__ void load_q_fragments_f16(uint32_t (&qf)[D / 16][4], const uint16_t* row0,
                                                     const uint16_t* row1, float scale_log2,
                                                     float (&row_scale_log2)[2]) {
  const int col = 4 * (threadIdx.x % 4);
  const uint16_t* rows[2] = {row0, row1};
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float x[D / 16][4];
    float amax = 0.0f;
#pragma unroll
    for (int k = 0; k < D / 16; ++k) {
      const uint32_t lo = rows[r] ? load_bf16_pair(rows[r] + k * 16 + col) : 0u;
      const uint32_t hi = rows[r] ? load_bf16_pair(rows[r] + k * 16 + col + 2) : 0u;
      x[k][0] = __uint_as_float(lo << 16);
      x[k][1] = __uint_as_float(lo & 0xffff0000u);
      x[k][2] = __uint_as_float(hi << 16);
      x[k][3] = __uint_as_float(hi & 0xffff0000u);
#pragma unroll
      for (int i = 0; i < 4; ++i) amax = fmaxf(amax, fabsf(x[k][i]));
    }
    const float scale = f16_row_scale(quad_max(amax));
    row_scale_log2[r] = scale_log2 / scale;  // a power of two: exact
#pragma unroll
    for (int k = 0; k < D / 16; ++k) {
      qf[k][r] = pack_f16(x[k][0] * scale, x[k][1] * scale);
      qf[k][r + 2] = pack_f16(x[k][2] * scale, x[k][3] * scale);
    }
  }
}

// s = Q K^T (f16 MMAs) of the warp's 16 rows (qf: load_q_fragments_f16) and the kKeys key code
// rows at `keys` (pitch fp8_code_pitch<D, true>). ldmatrix.x4 matrices (8 keys x 16 bytes):
// (keys 0-7, d 0-15), (keys 8-15, d 0-15), (keys 0-7, d 16-31), (keys 8-15, d 16-31) of a
// 16-key x 32-d step; each matrix register is one MMA's b[0], b[1] (bytes 0-1, 2-3).
template <int D, int kKeys>
__device__ __forceinline__ void tile_scores_e4m3(float (&s)[kKeys / 8][4], const uint32_t (&qf)[D / 16][4],
                                                 const uint8_t* keys, int lane) {
  static_assert(kKeys % 16 == 0 && kKeys <= kKeyTile && D % 32 == 0, "tile_scores_e4m3: 16-key, 32-d steps");
  constexpr int kPitch = fp8_code_pitch<D, true>();
  constexpr int kNTiles = kKeys / 8;
#pragma unroll
  for (int n = 0; n < kNTiles; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) s[n][i] = 0.0f;
  const uint8_t* key_row = keys + ((lane % 8) + ((lane / 8) % 2) * 8) * kPitch + (lane / 16) * 16;
#pragma unroll
  for (int kp = 0; kp < D / 32; ++kp)
#pragma unroll
    for (int np = 0; np < kNTiles / 2; ++np) {
      uint32_t w[4];
      ldmatrix_x4(w, key_row + np * 16 * kPitch + kp * 32);
#pragma unroll
      for (int m = 0; m < 4; ++m) {  // matrix m: n-tile 2 np + m % 2, k step 2 kp + m / 2
        uint32_t b[2];
        e4m3x4_to_f16x2(w[m], b[0], b[1]);
        mma_f16_16816(s[2 * np + m % 2], qf[2 * kp + m / 2], b);
      }
    }
}

// o += P V of the warp's 16 rows and the kKeys value code rows at `values` (pitch
// fp8_code_pitch<D, true>): P = the f32 accumulators p rounded to bf16 (the standard A layout),
// V widened to bf16 in registers. ldmatrix.x4.trans matrices (8 keys x 16 bytes = 8 channel
// pairs): (keys 0-7, channels 0-15), (keys 8-15, channels 0-15), (keys 0-7, channels 16-31),
// (keys 8-15, channels 16-31) of a 16-key x 32-channel step. Matrix register -> prmt 0x3120
// -> two e4m3 pairs: the b[0] (keys 0-7 matrix) or b[1] (keys 8-15) of the piece's even n-tile
// (channels 16p + 2n) and of its odd one (16p + 2n + 1). o[2p] / o[2p + 1] are those n-tiles.
template <int D, int kKeys>
__device__ __forceinline__ void accumulate_pv_e4m3(float (&o)[D / 8][4], const float (&p)[kKeys / 8][4],
                                                   const uint8_t* values, int lane) {
  constexpr int kPitch = fp8_code_pitch<D, true>();
  const uint8_t* value_row = values + ((lane % 8) + ((lane / 8) % 2) * 8) * kPitch + (lane / 16) * 16;
#pragma unroll
  for (int kk = 0; kk < kKeys / 16; ++kk) {
    uint32_t a[4];
    accumulator_a_fragment(a, p, kk);
#pragma unroll
    for (int pp = 0; pp < D / 32; ++pp) {
      uint32_t w[4];
      ldmatrix_x4_trans(w, value_row + kk * 16 * kPitch + pp * 32);
#pragma unroll
      for (int half = 0; half < 2; ++half) {  // the 16-channel piece 2 pp + half
        uint32_t even[2], odd[2];
#pragma unroll
        for (int j = 0; j < 2; ++j) {  // j = 0: keys 0-7 (b[0]), 1: keys 8-15 (b[1])
          uint32_t e, d;
          e4m3x4_to_f16x2(__byte_perm(w[2 * half + j], 0u, 0x3120), e, d);
          even[j] = f16x2_to_bf16x2(e);
          odd[j] = f16x2_to_bf16x2(d);
        }
        const int piece = 2 * pp + half;
        mma_bf16_16816(o[2 * piece], a, even);
        mma_bf16_16816(o[2 * piece + 1], a, odd);
      }
    }
  }
}

// The warp tile's state on path 1: attend_codes reads K/V codes and scales from a ring stage,
// and O's columns are in path 1's order (lane c: channels 16p + 4c .. 16p + 4c + 3 in
// o[2p][0], o[2p + 1][0], o[2p][1], o[2p + 1][1] for row 0, [2] / [3] for row 1), which the
// stores below write back in channel order. The softmax and finish() are the bf16 tile's.
template <int D>
struct Fp8WarpRowsState : WarpRowsState<D> {
  using WarpRowsState<D>::o;

  // attend() of the bf16 tile on code rows: key i of the kKeys is code row i of `keys` /
  // `values` times key_scales[i] / value_scales[i]; row r's scores are multiplied by
  // row_scale_log2[r] (load_q_fragments_f16). Limits as attend().
  template <bool kMask, int kKeys>
  __device__ __forceinline__ void attend_codes(const uint32_t (&qf)[D / 16][4], const uint8_t* keys,
                                               const uint8_t* values, const float (&row_scale_log2)[2],
                                               int limit0, int limit1, const float* key_scales,
                                               const float* value_scales) {
    constexpr int kNTiles = kKeys / 8;
    const int lane = threadIdx.x % 32;
    const int col = 2 * (lane % 4);
    float s[kNTiles][4];
    tile_scores_e4m3<D, kKeys>(s, qf, keys, lane);
    this->template scale_columns<kNTiles>(s, key_scales, col);
    this->template softmax_update<kMask, kNTiles>(s, row_scale_log2[0], row_scale_log2[1], limit0, limit1);
    this->template scale_columns<kNTiles>(s, value_scales, col);
    accumulate_pv_e4m3<D, kKeys>(o, s, values, lane);
  }

  // Row r's 4 consecutive channels 16p + 4c .. + 3 of O * inv.
  __device__ __forceinline__ float4 channels(int p, int r, float inv) const {
    return make_float4(o[2 * p][2 * r] * inv, o[2 * p + 1][2 * r] * inv, o[2 * p][2 * r + 1] * inv,
                       o[2 * p + 1][2 * r + 1] * inv);
  }

  // As WarpRowsState::store_row: row r of O * inv as f32 to `out` (D contiguous floats).
  __device__ __forceinline__ void store_row(float* out, int r, float inv) const {
    const int col = 4 * (threadIdx.x % 4);
#pragma unroll
    for (int p = 0; p < D / 16; ++p) *reinterpret_cast<float4*>(out + p * 16 + col) = channels(p, r, inv);
  }

  // As WarpRowsState::store_output_row (f32 or bf16 output row at element `first`).
  __device__ __forceinline__ void store_output_row(void* out, bool bf16, int64_t first, int r, float inv) const {
    const int col = 4 * (threadIdx.x % 4);
#pragma unroll
    for (int p = 0; p < D / 16; ++p) {
      const float4 v = channels(p, r, inv);
      store_output2(out, bf16, first + p * 16 + col, v.x, v.y);
      store_output2(out, bf16, first + p * 16 + col + 2, v.z, v.w);
    }
  }
};

}  // namespace msa::cuda::attn
