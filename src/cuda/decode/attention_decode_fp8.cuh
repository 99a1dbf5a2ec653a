// fp8 K/V units of the decode attention kernel (attention_decode.cuh, decode_attention_kernel
// with kFp8; docs/msa.md §6.6): a 64-key unit's e4m3 codes and f32 scales stream through the
// cp.async ring at half the bytes of bf16, then the CTA widens the codes once into one bf16
// tile in the layout of the bf16 ring stages (rows of D at pitch D + 8), and the warps run the
// same warp tile (attention_block_tile.cuh) on it, with the scales applied in f32: the K scale
// multiplies each score column before the softmax, the V scale each probability column before
// it is rounded to bf16 for P.V (the row sums use the unscaled probabilities).
//
// Why widen in shared memory, and to bf16 without the scale:
//  - e4m3 -> bf16 is exact (3 mantissa bits, exponents 2^-9 .. 2^8), so the HMMAs see the
//    codes' values exactly and the scales enter in f32, as the CPU reads code * scale: the GPU
//    then differs from the CPU only by the bf16 rounding of P, as on a bf16 cache (the tests
//    keep the bf16 tolerances). Folding a scale into the bf16 tile would round every value a
//    second time (2^-9); an f16 tile would overflow for scales beyond ~146 (65504 / 448).
//  - e4m3 mma.sync (m16n8k32) would need Q in e4m3 too: a third rounding of the query.
//  - Widening in registers (ldmatrix on the codes) would repeat the conversion in each warp
//    that reads the unit: 4x in the rows-per-warp layout (G x Q > 16), where the 4 warps share
//    every key. Once per CTA, it costs 16 x (one 8-byte load, 4 cvt.f16x2.e4m3x2 + 8 f16 -> f32
//    + 4 packs, one 16-byte store) per thread and unit (D = 128) and one more barrier.
//
// Shared memory (D = 128): 4 stages x (K + V codes 2 x 64 x 128 B + 2 x 64 f32 scales) =
// 67,584 B + the bf16 tile 2 x 64 x 136 x 2 B = 34,816 B: 102,400 B, under the bf16 ring's
// 104,448 B (so 2 CTAs per SM as for bf16). 4 stages, not 3: a unit is half the bytes, so 3
// units in flight keep as many bytes in flight per SM as the bf16 ring's 2. The tile is also
// the key-split merge's scratch (4 x 16 x (D + 8) f32: exactly its size).
#pragma once
#include "cuda/attention/attention_block_tile.cuh"
#include "cuda/decode/key_dequant.cuh"
#include "cuda/launch.h"

namespace msa::cuda::attn {

constexpr int kDecodeFp8Stages = 4;

// One ring stage: K codes [64][D], V codes [64][D] (bytes, unpadded: the widening pass reads
// them in 8-byte pieces, conflict-free), then the 64 K and the 64 V scales (f32).
template <int D>
constexpr size_t fp8_stage_bytes() {
  return size_t{2} * kKeyTile * D + size_t{2} * kKeyTile * sizeof(float);
}
template <int D>
__device__ __forceinline__ const float* fp8_stage_key_scales(const uint8_t* stage) {
  return reinterpret_cast<const float*>(stage + 2 * kKeyTile * D);
}

// 4-byte asynchronous global -> shared copy (cp.async.ca: .cg copies 16 bytes only); `valid`
// false writes zeros instead and reads nothing.
__device__ __forceinline__ void cp_async_4(void* shared, const void* global, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_address(shared)), "l"(global),
               "r"(valid ? 4 : 0));
}

// Copies the fp8 unit of (request b, block, first key `sub` of the block, KV head g) into
// `stage`: rows >= valid_rows (keys no row of the CTA may see: past the sequence, or garbage
// of a partial page) are zero-filled, codes and scales alike, and never read. Called by all
// kThreads threads (2 x 64: thread t copies the K scale of row t, or the V scale of row
// t - 64); the caller commits and waits.
template <int D, int kThreads>
__device__ __forceinline__ void load_fp8_unit_async(uint8_t* stage, const KeyLayout& k_layout,
                                                    const KeyLayout& v_layout, const Fp8Kv& k,
                                                    const Fp8Kv& v, int64_t b, int32_t block, int sub,
                                                    int g, int valid_rows) {
  static_assert(kThreads == 2 * kKeyTile, "one scale per thread");
  constexpr int kChunks = D / 16;  // 16-byte chunks per row
  const int64_t k_page = k_layout.page_table[b * k_layout.page_table_stride + block];
  const int64_t v_page = v_layout.page_table[b * v_layout.page_table_stride + block];
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
    cp_async_16(stage + row * D + col, valid ? src + col : k.codes, valid);
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
  cp_async_4(reinterpret_cast<float*>(stage + 2 * kKeyTile * D) + t, valid ? scales + offset : scales, valid);
}

// An f16 pair widened from two e4m3 codes (cvt.rn.f16x2.e4m3x2, key_dequant.cuh) -> bf16x2,
// through f32: exact, since an e4m3 value has 4 significant bits and an exponent in
// [2^-9, 2^8].
__device__ __forceinline__ uint32_t f16x2_to_bf16x2(uint32_t pair) {
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&pair));
  return pack_bf16(f.x, f.y);
}

// Widens the 128 code rows of `stage` (64 K rows, then 64 V rows) into `tile`: bf16 rows of D
// at pitch D + 8, K rows 0-63 then V rows 64-127 (a bf16 ring stage's layout). Called by all
// kThreads threads; the caller synchronises before the warps read the tile.
template <int D, int kThreads>
__device__ __forceinline__ void widen_fp8_unit(uint16_t* tile, const uint8_t* stage) {
  constexpr int kPieces = D / 8;  // 8-code pieces per row
#pragma unroll 2
  for (int c = threadIdx.x; c < 2 * kKeyTile * kPieces; c += kThreads) {
    const int row = c / kPieces, col = (c % kPieces) * 8;
    const uint2 codes = *reinterpret_cast<const uint2*>(stage + row * D + col);
    uint32_t h[4];
    e4m3x4_to_f16x2(codes.x, h[0], h[1]);
    e4m3x4_to_f16x2(codes.y, h[2], h[3]);
    *reinterpret_cast<uint4*>(tile + row * smem_pitch<D>() + col) =
        make_uint4(f16x2_to_bf16x2(h[0]), f16x2_to_bf16x2(h[1]), f16x2_to_bf16x2(h[2]), f16x2_to_bf16x2(h[3]));
  }
}

}  // namespace msa::cuda::attn
