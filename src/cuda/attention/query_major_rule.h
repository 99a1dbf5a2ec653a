// The per-tile rule of the automatic sparse order (SparseOrder::automatic): written once for
// the tile-union kernel (attention_sparse_union_plan.cuh) and the benchmark's host-side count of
// the tiles it sends query-major (tools/bench_cuda). Plain C++, and __host__ __device__ under
// nvcc.
#pragma once
#include <cstdint>

#ifndef MSA_HOST_DEVICE
#ifdef __CUDACC__
#define MSA_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MSA_HOST_DEVICE inline
#endif
#endif

namespace msa::cuda {

// (query, head) rows per query-major tile (the wgmma dense kernel's CTA).
constexpr int kUnionTileRows = 128;

// automatic runs a tile query-major iff its union computes at most this many times the
// (row, block) pairs its selection holds. The value is the two orders' measured rates on the
// M3 shape (H200, bench/results/h200.md): the union kernel runs at the wgmma dense kernel's
// 43-44% of the bf16 peak, kv_major's whole stage (plan, tiles, merge) at 29-30% of it per
// selected pair.
constexpr float kQueryMajorPairRatio = 1.5f;

// Whether a tile of `union_blocks` union blocks, whose queries hold `entries` valid selection
// entries of G heads each, runs query-major under max_pair_ratio.
MSA_HOST_DEVICE bool query_major_pays(int64_t union_blocks, int64_t entries, int G, float max_pair_ratio) {
  return static_cast<float>(union_blocks) * kUnionTileRows <=
         max_pair_ratio * static_cast<float>(entries) * static_cast<float>(G);
}

}  // namespace msa::cuda
