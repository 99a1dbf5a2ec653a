// Where the prefill index scan ranks (indexer.cu make_plan): in the scan, or separately, in
// passes: the scan writes the block maxima of a pass's queries to the workspace,
// select_rows_kernel ranks them, and the next pass reuses the maxima. Plain C++ (no CUDA) so
// CPU tests check it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "cuda/common/workspace_layout.h"  // ceil_div, balanced_chunk
#include "msa/cuda/types.h"                 // IndexRanking

#if defined(__CUDACC__)
#define MSA_RANKING_HOST_DEVICE __host__ __device__
#else
#define MSA_RANKING_HOST_DEVICE
#endif

namespace msa::cuda {

struct RankingPasses {
  int64_t pass_queries = 0;  // queries per pass (the last may have fewer); 0: none fits
  int64_t passes = 0;        // ceil(total_q / pass_queries)
  size_t maxima_bytes = 0;   // workspace of one pass's maxima: pass_queries x one query's
};

// Equal passes over total_q >= 1 queries whose maxima (query_maxima_bytes each: index heads x
// blocks x 4) fit cap_bytes, of at most max_chunk_queries queries when that is > 0. None
// (passes 0) where one query's maxima exceed the cap.
inline RankingPasses ranking_passes(int64_t total_q, size_t query_maxima_bytes, size_t cap_bytes,
                                    int64_t max_chunk_queries) {
  RankingPasses r;
  int64_t fit = query_maxima_bytes == 0
                    ? total_q
                    : std::min<int64_t>(total_q, static_cast<int64_t>(cap_bytes / query_maxima_bytes));
  if (max_chunk_queries > 0) fit = std::min(fit, max_chunk_queries);
  if (fit < 1 || total_q < 1) return r;
  r.pass_queries = balanced_chunk(total_q, fit);
  r.passes = ceil_div(total_q, r.pass_queries);
  r.maxima_bytes = size_t(r.pass_queries) * query_maxima_bytes;
  return r;
}

// The tiles [first, last] that hold the queries [q_lo, q_hi] (inclusive, 0 <= q_lo <= q_hi <
// q_start[batch]) of a varlen batch: query q of sequence s = seq_of_query[q] lies in tile
// tile_prefix[s] + (q - q_start[s]) / queries_per_tile; tiles are consecutive over the batch,
// so a pass's queries are exactly the tiles between its first and its last query's. The
// scan's CTAs of a pass walk this range (tile_prefix_kernel writes it, indexer_scan.cuh).
struct TileRange {
  int64_t first = 0, last = -1;
};

MSA_RANKING_HOST_DEVICE inline int64_t tile_of_query(const int64_t* q_start, const int32_t* seq_of_query,
                                                     const int64_t* tile_prefix, int64_t queries_per_tile,
                                                     int64_t q) {
  const int64_t s = seq_of_query[q];
  return tile_prefix[s] + (q - q_start[s]) / queries_per_tile;
}

MSA_RANKING_HOST_DEVICE inline TileRange pass_tile_range(const int64_t* q_start, const int32_t* seq_of_query,
                                                         const int64_t* tile_prefix, int64_t queries_per_tile,
                                                         int64_t q_lo, int64_t q_hi) {
  return {tile_of_query(q_start, seq_of_query, tile_prefix, queries_per_tile, q_lo),
          tile_of_query(q_start, seq_of_query, tile_prefix, queries_per_tile, q_hi)};
}

// Tiles a pass of L consecutive queries covers at most: its L_s queries of sequence s lie in
// ceil(L_s / qpt) tiles where they start at the sequence's start (every sequence but the
// pass's first), and in one more at most in the first. The ceilings add less than one per
// further sequence: ceil(L / qpt) + batch (tight: TileRanking's CPU test).
inline int64_t pass_tile_bound(int64_t pass_queries, int64_t queries_per_tile, int64_t batch) {
  return ceil_div(pass_queries, queries_per_tile) + batch;
}

constexpr int kMinTileChunk = 8;  // blocks per split-tile CTA: amortises its 64 KB query load

struct TileRankingInputs {
  IndexRanking ranking = IndexRanking::automatic;
  // The scan is producer_tile_scan_kernel (the bf16 or fp8 warpgroup-MMA scan, M3's shape);
  // else the mma.sync tile_scan_kernel, which computes a requested selected LSE with the
  // scores when it ranks in the scan.
  bool producer_scan = false;
  int ranked = 0;           // topk - local - init
  int64_t total_q = 0, batch = 0;
  int64_t tile_bound = 0;   // the scan's grid.x in the scan: an upper bound of the tiles
  int64_t queries_per_tile = 1;
  int64_t max_blocks = 0;   // blocks of the longest sequence (the maxima's row stride)
  RankingPasses passes;     // ranking_passes of these queries
  int sms = 1;
  // Wave-fitted chunks per pass (pass_chunks): the producer scan's resident CTAs (SMs x
  // CTAs per SM at its split shared memory; 0: not fitted) and what bounds a pass's blocks
  // on the host for one sequence, whose query q sits at position <= max_k_len - total_q + q.
  int64_t resident_ctas = 0;
  int64_t max_k_len = 0, block_size = 1, skipped_blocks = 0;  // skipped: init + local
};

struct TileRanking {
  bool separate = false;        // the split path; else the scan ranks (fused)
  int64_t pass_tile_bound = 0;  // separate: tiles one pass covers at most (its scan's grid.x)
  int chunk_blocks = 0;         // separate: blocks per CTA (grid.y splits a tile's blocks)
  int chunks = 1;
  // separate, one sequence on a producer scan: pass_chunks fits each pass's chunks to waves
  int64_t resident_ctas = 0;
  int64_t total_q = 0, pass_queries = 0, key_offset = 0, block_size = 1, skipped_blocks = 0;
};

// The split path, where the maxima of a pass fit (passes.passes > 0) and blocks are ranked:
// - few tiles (short contexts), unless in_scan is pinned: every tile's blocks split into
//   chunks so that the GPU is filled and the longest tile does not decide the runtime. Work ~
//   tiles x blocks / 2 (causal), aimed at ~3 chunks per SM; a pass's tiles count. Taken where
//   that gives more than one chunk.
// - many tiles: pinned separate, or automatic for the producer scans, at any number of
//   passes. Measured on the H200 at M3's shape (bench/results/h200.md), the scan writing
//   maxima plus select_rows against the fused scan, whose ranking epilogue binds: bf16 0.86
//   vs 1.38 ms at 32K, 14.0 vs 19.8 ms at 128K (4 passes), 978 vs 983 ms at 1M (256
//   passes); fp8 0.92 vs 1.58 ms at 32K, 11.8 vs 20.0 ms at 128K. The mma.sync scan is
//   not measured split at many tiles, and with lse_out it computes the LSE with the scores,
//   which the split path would recompute: it ranks in the scan unless pinned.
inline TileRanking plan_tile_ranking(const TileRankingInputs& in) {
  TileRanking r;
  const bool fits = in.passes.passes > 0;
  if (in.ranked <= 0 || !fits) return r;
  const bool many_tiles =
      in.ranking == IndexRanking::separate ||
      (in.ranking == IndexRanking::automatic && in.producer_scan);
  const bool few_tiles = in.ranking != IndexRanking::in_scan && in.tile_bound < 2 * int64_t{in.sms};
  if (!many_tiles && !few_tiles) return r;
  const int64_t pass_tiles = std::min(
      in.tile_bound, pass_tile_bound(in.passes.pass_queries, in.queries_per_tile, in.batch));
  const int64_t work = pass_tiles * in.max_blocks / 2;
  const int64_t chunk = std::max<int64_t>(kMinTileChunk, ceil_div(work, 3 * int64_t{in.sms}));
  const int64_t chunks = ceil_div(in.max_blocks, chunk);
  if (chunks <= 1 && !many_tiles) return r;
  r.separate = true;
  r.pass_tile_bound = pass_tiles;
  r.chunk_blocks = static_cast<int>(chunk);
  r.chunks = static_cast<int>(chunks);
  if (in.producer_scan && in.batch == 1 && in.resident_ctas > 0) {
    r.resident_ctas = in.resident_ctas;
    r.total_q = in.total_q;
    r.pass_queries = in.passes.pass_queries;
    r.key_offset = in.max_k_len - in.total_q;
    r.block_size = in.block_size;
    r.skipped_blocks = in.skipped_blocks;
  }
  return r;
}

// A split-scan CTA's start (query tile load, pipeline fill) in block-times, for the wave
// model below. The chunks it picks for M3's 1M passes are the same for 4 to 16 (simulated
// list scheduling of the 256 passes).
constexpr int64_t kChunkStartBlocks = 8;

// The chunk that runs `tiles` tiles of `blocks` blocks each fastest on `resident` CTAs at a
// time: equal CTAs run in whole waves, so a pass takes ~ ceil(tiles x chunks / resident)
// waves of (chunk + start) block-times. Chunks of >= kMinTileChunk blocks; among equal
// costs the longest chunk (fewest CTAs).
inline int64_t wave_fitted_chunk(int64_t tiles, int64_t blocks, int64_t resident) {
  tiles = std::max<int64_t>(1, tiles);
  blocks = std::max<int64_t>(1, blocks);
  resident = std::max<int64_t>(1, resident);
  int64_t best_chunk = blocks, best_cost = -1;
  for (int64_t c = 1; c <= 2 * resident; ++c) {
    const int64_t chunk = std::max<int64_t>(kMinTileChunk, ceil_div(blocks, c));
    const int64_t cost = ceil_div(tiles * ceil_div(blocks, chunk), resident) * (chunk + kChunkStartBlocks);
    if (best_cost < 0 || cost < best_cost) best_cost = cost, best_chunk = chunk;
    if (chunk == kMinTileChunk) break;  // more chunks would not shorten it
  }
  return best_chunk;
}

struct PassChunks {
  int chunk_blocks = 0;
  int chunks = 1;
};

// The chunks of pass `pass` (its scan's grid.y and blocks per CTA). plan_tile_ranking's
// chunks suit the causal triangle of a whole prefill: tiles of 0 to max_blocks blocks, work
// ~ tiles x max_blocks / 2. A late pass of one long sequence is not a triangle: its queries
// span a few blocks at the end of a long context, so every tile scans about as many blocks,
// and with those chunks a 1M pass ran 65 tiles x 13 chunks of 673 blocks on 132 SMs as 7
// waves where 6.4 were full, and an early one (350 blocks) as 65 CTAs, half the GPU idle.
// Where every tile of the pass scans between 3/4 of the pass's most and the most (the
// bound s_hi of its last query; the least, s_lo, of its first), the chunks are
// wave-fitted to s_hi. Covering: a tile's blocks [init, init + s) with s <= s_hi (k_len <=
// max_k_len) lie within chunks x chunk_blocks blocks of init.
inline PassChunks pass_chunks(const TileRanking& r, int64_t pass) {
  PassChunks c{r.chunk_blocks, r.chunks};
  if (r.resident_ctas <= 0 || r.pass_queries <= 0) return c;
  const int64_t q0 = pass * r.pass_queries;
  const int64_t q1 = std::min(r.total_q, q0 + r.pass_queries);  // exclusive
  const auto scanned = [&](int64_t q) {  // blocks a query at index q scans at most
    return (r.key_offset + q) / r.block_size + 1 - r.skipped_blocks;
  };
  const int64_t s_hi = scanned(q1 - 1), s_lo = scanned(q0);
  if (s_hi < 1 || 4 * s_lo < 3 * s_hi) return c;
  const int64_t chunk = wave_fitted_chunk(r.pass_tile_bound, s_hi, r.resident_ctas);
  c.chunk_blocks = static_cast<int>(chunk);
  c.chunks = static_cast<int>(ceil_div(s_hi, chunk));
  return c;
}

}  // namespace msa::cuda
