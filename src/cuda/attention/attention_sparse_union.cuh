// Sparse attention, query-major: the union of the selected blocks of each 128-row tile.
//
// The query-major sparse forward (SparseOrder::query_major, include/msa/cuda/types.h) runs
// the wgmma dense kernel's tiles (attention_dense_wgmma.cuh with kUnion): a CTA owns 128
// (query, head) rows of one KV group, flattened query-major as dense_tile gives them (8
// queries x 16 heads for M3), and walks the sorted union of the blocks its queries selected.
// A row sees a union block's keys only if its own query selected the block (and, in its own
// block, up to its position); every other (row, block) pair is masked, so the kernel computes
// union x 128 rows of scores where kv_major computes selected x G rows per query. What it
// saves: no partial per (query, head, block) written and merged (~814 of ~870 bytes per row
// of kv_major's traffic, attention_sparse_wgmma.cuh), Q read once, O written once.
// Measured (H200, M3 shape, bench/results/h200.md): on coherent selections (union 1.13-1.28x
// the valid blocks per query) 1.24-1.35x faster than kv_major at 8K-128K; on the indexer's
// rows over random inputs (union 2.2-6.3x) 1.36-3.4x slower, which is why automatic decides
// per tile (query_major_rule.h).
//
// The plan that builds the unions: attention_sparse_union_plan.cuh (tile_union_kernel).
// The query bit is the query's index within the tile: G must divide 128 (G = 4, 8, 16: at most
// 32 queries per tile, one 32-bit mask; a query's heads never straddle two tiles).
#pragma once
#include <cstdint>

#include "cuda/attention/query_major_rule.h"

namespace msa::cuda::attn {

using cuda::kUnionTileRows;          // rows per tile: DenseWgmmaTraits::kRows
constexpr int kUnionKeys = 128;      // keys per union block: B = 128

// One block of a tile's union: its id and the tile's queries (bit i: the tile's i-th query)
// that selected it.
struct UnionBlock {
  int32_t block;
  uint32_t queries;
};
static_assert(sizeof(UnionBlock) == 8);

// Where the query-major kernel finds its tile's union: count[tile * kv_heads + g] blocks at
// blocks + (tile * kv_heads + g) * cap. A negative count hands the tile to kv_major
// (SparseOrder::automatic; the query-major kernel skips it).
struct TileUnions {
  const UnionBlock* blocks = nullptr;
  const int32_t* count = nullptr;
  int64_t cap = 0;
};

}  // namespace msa::cuda::attn
