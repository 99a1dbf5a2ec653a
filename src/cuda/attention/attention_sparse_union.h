// Host side of the query-major sparse forward (attention_sparse_union.cuh): the tile unions'
// workspace, their plan kernel, and the union kernel (attention_dense_wgmma.cuh, kUnion).
// Kept in its own translation unit so that attention.cu's compile time does not grow.
#pragma once
#include <cstddef>
#include <cstdint>

#include "cuda/launch.h"

namespace msa::cuda {

// Whether the query-major order can run `p` (a sparse prefill): head_dim = block_size = 128,
// G = q_heads / kv_heads of 4, 8 or 16, and the plan's shared bitmap within bounds.
bool sparse_query_major_fits(const AttentionLaunch& p);

// The unions' workspace regions (offsets from the region's start, sized from host-known
// quantities only).
struct TileUnionPlan {
  int64_t tiles = 0;  // grid x: dense_grid_tiles at 128 rows
  int64_t cap = 0;    // union blocks kept per (tile, group)
  int bitmap_words = 0;
  size_t tile_start = 0, count = 0, blocks = 0, query_major = 0, total = 0;
};
TileUnionPlan plan_tile_unions(const AttentionLaunch& p);

// dense_tile_plan, tile_union_kernel (the union of every (tile, group); tiles whose union
// computes more than max_pair_ratio x the selected (row, block) pairs are left to kv_major:
// count -1 and query_major[g, q] = 0), then the union kernel over the other tiles, writing
// their O and LSE. On `stream`, no host synchronisation. ws: the plan's region.
void run_sparse_query_major(const AttentionLaunch& p, const TileUnionPlan& plan, char* ws, float max_pair_ratio,
                            void* stream);

// [kv_heads, total_q] flags of run_sparse_query_major (1: the query's O was written there).
inline const uint8_t* query_major_flags(const TileUnionPlan& plan, const char* ws) {
  return reinterpret_cast<const uint8_t*>(ws + plan.query_major);
}

}  // namespace msa::cuda
