// What the decode index scan's per-block work shares across key formats (bf16:
// indexer_decode_bf16.cuh, fp8 / fp4: indexer_decode_quantized.cuh): the dispatch to
// compile-time tile counts and the last step per n-tile (cross-lane max, store).
#pragma once
#include <type_traits>

#include "cuda/common/common.cuh"

namespace msa::cuda::indexer_detail {

// Calls work(kMT, kNT) with the per-warp m-tile count (1 or T::kMaxMTiles: B 64 or 128) and
// the n-tile count the code handles (1, or T::kNTiles with the inactive ones predicated off
// by the runtime n_tiles) as std::integral_constant: with one active n-tile (decode batch 1,
// Q 1: 4 of the 32 rows) no predicated-off MMA issues, and no branch separates the m-tiles.
// Branches on CTA-uniform values only (once per block: a few uniform instructions).
template <class T, class Work>
__device__ __forceinline__ void with_tile_counts(int m_tiles, int n_tiles, Work&& work) {
  using One = std::integral_constant<int, 1>;
  using AllM = std::integral_constant<int, T::kMaxMTiles>;
  using AllN = std::integral_constant<int, T::kNTiles>;
  if (n_tiles == 1) {
    if (m_tiles == T::kMaxMTiles)
      work(AllM{}, One{});
    else
      work(One{}, One{});
  } else {
    if (m_tiles == T::kMaxMTiles)
      work(AllM{}, AllN{});
    else
      work(One{}, AllN{});
  }
}

// The last step per n-tile: a lane holds the maxima of rows 2 quad (even) and 2 quad + 1
// (odd) over its key group's keys; reduce over the 8 key groups (lanes 4 apart) and let
// group 0 store the n-tile's 8 row maxima into part.
__device__ __forceinline__ void store_key_group_max(float even, float odd, float* part, int nt,
                                                    int group, int quad) {
#pragma unroll
  for (int offset = 4; offset < 32; offset *= 2) {
    even = fmaxf(even, __shfl_xor_sync(0xffffffffu, even, offset));
    odd = fmaxf(odd, __shfl_xor_sync(0xffffffffu, odd, offset));
  }
  if (group == 0) {
    part[nt * 8 + 2 * quad] = even;
    part[nt * 8 + 2 * quad + 1] = odd;
  }
}

}  // namespace msa::cuda::indexer_detail
