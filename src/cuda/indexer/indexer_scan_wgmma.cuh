// Shared pieces of the prefill index scans on Hopper warpgroup MMA (Di = B = 128): the rows a
// thread owns in the wgmma accumulator layout and the fused mode's selection writes. The
// kernel (bf16 and fp8 keys): producer_tile_scan_kernel, indexer_scan_producer.cuh.
//
// Why chains (ptxas C7514, nvcc 13.0): ptxas serialises EVERY wgmma of the function as soon
//   as an MMA group is still in flight across a loop's back edge and its accumulators are
//   read afterwards (a 40-line reproducer shows it). The same overlap written as
//   straight-line code is fine. So the scans' mainloops run chains of blocks, each chain
//   fully unrolled, overlapped inside (wait_group 1) and ending in wait_group 0 before the
//   back edge. A scan whose pair loop was serialised this way ran slower than the mma.sync
//   scan.
//
// The bf16 scan runs on the fp8 scan's producer-warpgroup kernel (indexer_scan_producer.cuh)
//   rather than with all 256 threads copying through a cp.async ring and a CTA barrier per
//   block: faster at every context, selections bitwise equal (bench/results/history.md).
#pragma once
#include "cuda/indexer/indexer_scan.cuh"
#include "cuda/common/wgmma.cuh"

namespace msa::cuda::indexer_detail {

// The rows a thread owns in the wgmma accumulator layout (bf16 and fp8 scans): in tile t of
// its warpgroup, rows r and r + 8 with r = 16 warp + lane / 4; after the reduce quad lane 0
// owns row r, quad lane 1 row r + 8. owner: the thread writes that row; own_block: the row's
// query's own block; own_cand_end: one past its last rankable block (before the local ones).
template <int kTiles>
__device__ __forceinline__ void owned_row_geometry(const IndexerLaunch& p, const TileGeometry& tile,
                                                   int heads, int warpgroup, int warp, int lane,
                                                   int (&own_row)[kTiles], bool (&owner)[kTiles],
                                                   int32_t (&own_block)[kTiles],
                                                   int32_t (&own_cand_end)[kTiles]) {
  const int quad = lane % 4;
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
    own_row[t] = (warpgroup * kTiles + t) * 64 + warp * 16 + lane / 4 + 8 * (quad & 1);
    owner[t] = quad < 2 && own_row[t] < tile.n_rows;
    own_block[t] = static_cast<int32_t>((tile.first_pos + own_row[t] / heads) / p.block_size);
    // Rows of another pass (split mode) offer nothing.
    own_cand_end[t] = own_row[t] >= tile.row_lo && own_row[t] < tile.row_hi
                          ? own_block[t] - p.local_blocks + 1
                          : INT_MIN;
  }
}

// Fused mode, the wgmma scans' (bf16 and fp8) last step: each owner thread writes its row's
// selection (ranked blocks, then the forced ones); rows as in the kernels (own_row etc.).
// List: TopList, or a TopSet after sort_best_first().
template <int kTiles, class List>
__device__ __forceinline__ void write_owned_selections(const IndexerLaunch& p, const TileGeometry& tile,
                                                       int heads, const int (&own_row)[kTiles],
                                                       const bool (&owner)[kTiles],
                                                       const int32_t (&own_block)[kTiles],
                                                       const List (&list)[kTiles]) {
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
    if (!owner[t]) continue;
    const int64_t own_query = tile.first_query + own_row[t] / heads;
    const int own_head = own_row[t] % heads;
    int32_t* out = p.topk_out + (own_head * p.batch.total_q + own_query) * p.topk;
    for (int slot = 0; slot < p.topk; ++slot)
      out[slot] = selection_slot(slot, p, own_block[t], list[t].ids, list[t].count);
  }
}

}  // namespace msa::cuda::indexer_detail
