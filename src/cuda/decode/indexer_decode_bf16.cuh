// The per-block work of the decode index scan on bf16 keys (indexer_decode.cuh: tile plan,
// ring, budget). Made lean for few rows, like the quantized scan's (indexer_decode_quantized.cuh):
// - compile-time m-tile and n-tile counts (bf16_block_partials<kMT, kNT>): no branch per
//   m-tile, no predicated-off MMAs when one n-tile is active (decode batch 1, Q 1).
// - the block copy (bf16_load_block): fully unrolled, one source pointer per thread and
//   block, shared offsets and (contiguous keys) global offsets as immediates; no per-granule
//   division or 64-bit multiply.
// - the block's first key (Bf16BlockSource): the request's part of block_pointer hoisted
//   out of the block loop; a block costs one page-id load and one 64-bit multiply-add.
#pragma once
#include "cuda/common/common.cuh"
#include "cuda/decode/indexer_decode_tiles.cuh"
#include "cuda/launch.h"

namespace msa::cuda::indexer_detail {

// Block i of a request's scan range (blocks scan_begin + i) -> its first key: block_pointer
// (common.cuh, head 0) with the request's terms computed once; page ids checked as the layout
// asks (checked_page, into the caller's note). Null past the range (no page-table read there).
struct Bf16BlockSource {
  const KeyLayout& ki;    // the kernel's parameter
  const uint16_t* base;   // paged: ki.data; varlen: block scan_begin's first key
  const int32_t* pages;   // paged: the request's page ids from block scan_begin; else null
  int32_t scan_begin;
  int n_blocks;

  __device__ __forceinline__ Bf16BlockSource(const KeyLayout& ki_, int64_t seq, int32_t scan_begin_,
                                             int n_blocks_)
      : ki(ki_),
        base(ki_.page_table ? ki_.data : block_pointer(ki_, seq, scan_begin_, 0)),
        pages(ki_.page_table ? ki_.page_table + seq * ki_.page_table_stride + scan_begin_ : nullptr),
        scan_begin(scan_begin_),
        n_blocks(n_blocks_) {}

  __device__ __forceinline__ const uint16_t* operator()(int i, PageFaultNote& note) const {
    if (i >= n_blocks) return nullptr;
    const int64_t block = pages ? checked_page(ki, int64_t{scan_begin} + i, pages[i], note) : int64_t{i};
    return base + block * ki.block_stride;
  }
};

// cp.async of one block's keys (rows token_stride apart from `first_key`) into a stage's
// pitched rows. Thread t copies granule t % G of keys t / G + j (kThreads / G), G = Di / 8
// granules per key. block_size is 64 or 128 (check_params): the second half of the passes
// runs only for full (128-key) blocks. Stride: int64_t, or std::integral_constant for
// contiguous keys (token stride Di), which makes every global offset an immediate too.
template <class T, class Stride>
__device__ __forceinline__ void bf16_load_block(unsigned char* stage, const uint16_t* first_key,
                                                Stride token_stride, bool full_block) {
  constexpr int kGranulesPerKey = T::kCodeBytes / 16;
  constexpr int kKeysPerPass = T::kThreads / kGranulesPerKey;
  constexpr int kPasses = T::kMaxBlock / kKeysPerPass;
  static_assert(T::kThreads % kGranulesPerKey == 0 && (T::kMaxBlock / 2) % kKeysPerPass == 0,
                "copy passes: whole keys, half a block");
  const int t = threadIdx.x;
  const int key = t / kGranulesPerKey, granule = t % kGranulesPerKey;
  const uint32_t dst = smem_address(stage + key * T::kRowPitchBytes + granule * 16);
  const uint16_t* src = first_key + key * token_stride + granule * 8;
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass)
    if (pass < kPasses / 2 || full_block)
      cp_async_16(dst + pass * kKeysPerPass * T::kRowPitchBytes,
                  src + pass * kKeysPerPass * token_stride);
}

// One warp's keys (16 kMT rows from `keys`, its ldmatrix lane address) of a landed stage
// against the CTA's rows: per-row maxima -> part[row] (lanes of group 0 write). kNT: n-tiles
// the code handles (1, or T::kNTiles with the inactive ones predicated off by n_tiles).
// Same MMAs in the same order per accumulator, and the same max order, as a runtime-count
// loop over T::kMaxMTiles x T::kNTiles with the inactive tiles skipped.
template <class T, int kMT, int kNT>
__device__ __forceinline__ void bf16_block_partials(
    const uint16_t* keys, const uint32_t (&qb)[T::kNTiles][T::kKSteps][2], int n_tiles,
    int group, int quad, float* part) {
  float acc[kMT][kNT][4] = {};
#pragma unroll
  for (int ks = 0; ks < T::kKSteps; ++ks)
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      uint32_t a[4];
      ldmatrix_x4(a, keys + mt * 16 * T::kKeyPitch + ks * 16);
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
        if (kNT == 1 || nt < n_tiles) mma_bf16_16816(acc[mt][nt], a, qb[nt][ks]);
    }
  // Accumulator (mt, nt): c0/c1 = key group, rows 2 quad / +1; c2/c3 = key group + 8.
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt) {
    if (kNT > 1 && nt >= n_tiles) continue;
    float even = fmaxf(acc[0][nt][0], acc[0][nt][2]), odd = fmaxf(acc[0][nt][1], acc[0][nt][3]);
#pragma unroll
    for (int mt = 1; mt < kMT; ++mt) {
      even = fmaxf(even, fmaxf(acc[mt][nt][0], acc[mt][nt][2]));
      odd = fmaxf(odd, fmaxf(acc[mt][nt][1], acc[mt][nt][3]));
    }
    store_key_group_max(even, odd, part, nt, group, quad);
  }
}

}  // namespace msa::cuda::indexer_detail
