// Where the prefill index scan ranks (src/cuda/indexer/ranking_passes.h): plain C++, checked
// on the CPU. The separate ranking's passes: every query in exactly one pass, each pass's
// maxima within the cap, equal passes (no small tail), M3's contexts taking the passes the
// docs state. The choice (plan_tile_ranking): which calls rank separately, and chunks that
// cover every block once.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "cuda/indexer/ranking_passes.h"

namespace msa::testing {
namespace {

using cuda::ranking_passes;
using cuda::RankingPasses;

constexpr size_t kCap = size_t{512} << 20;  // the indexer's cap (kMaxBlockMaxBytes, decode_launch.h)

// One query's maxima at M3's shape (4 index heads, B = 128) for a context of n tokens.
size_t m3_query_bytes(int64_t n) { return size_t(4) * size_t((n + 127) / 128) * sizeof(float); }

TEST(RankingPasses, PassesCoverEveryQueryOnceWithinTheCap) {
  for (int64_t total_q : {1, 2, 37, 1000, 65536, 65537, 131072, 1048576})
    for (size_t query_bytes : {size_t{0}, size_t{16}, size_t{4096}, size_t{16384}, size_t{131072}})
      for (size_t cap : {size_t{1} << 20, kCap})
        for (int64_t max_chunk : {0, 1, 37, 5000}) {
          const RankingPasses r = ranking_passes(total_q, query_bytes, cap, max_chunk);
          const std::string what = std::to_string(total_q) + " queries, " + std::to_string(query_bytes) +
                                   " B each, cap " + std::to_string(cap) + ", chunk " + std::to_string(max_chunk);
          ASSERT_GE(r.passes, 1) << what;
          EXPECT_GE(r.passes * r.pass_queries, total_q) << what;
          EXPECT_LT((r.passes - 1) * r.pass_queries, total_q) << "an empty last pass: " << what;
          EXPECT_LE(r.maxima_bytes, cap) << what;
          EXPECT_EQ(r.maxima_bytes, size_t(r.pass_queries) * query_bytes) << what;
          if (max_chunk > 0) EXPECT_LE(r.pass_queries, max_chunk) << what;
          // Equal passes: the last holds more than pass_queries - passes queries.
          EXPECT_GT(total_q - (r.passes - 1) * r.pass_queries, r.pass_queries - r.passes) << what;
          // No fewer passes would do: pass_queries / passes - 1 passes would exceed a bound.
          const int64_t fit = query_bytes == 0 ? total_q : int64_t(cap / query_bytes);
          const int64_t bound = max_chunk > 0 ? std::min(fit, max_chunk) : fit;
          EXPECT_EQ(r.passes, (total_q + std::min(bound, total_q) - 1) / std::min(bound, total_q)) << what;
        }
}

TEST(RankingPasses, M3ContextsTakeTheStatedPasses) {
  const auto passes = [](int64_t n) { return ranking_passes(n, m3_query_bytes(n), kCap, 0); };
  EXPECT_EQ(passes(32768).passes, 1);
  EXPECT_EQ(passes(65536).passes, 1);  // exactly 512 MiB
  EXPECT_EQ(passes(65536).maxima_bytes, kCap);
  EXPECT_EQ(passes(65537).passes, 2);
  EXPECT_EQ(passes(131072).passes, 4);
  EXPECT_EQ(passes(131072).pass_queries, 32768);
  EXPECT_EQ(passes(1048576).passes, 256);
}

TEST(RankingPasses, NoneWhereOneQueryExceedsTheCap) {
  const RankingPasses r = ranking_passes(10, 4096, 4095, 0);
  EXPECT_EQ(r.passes, 0);
  EXPECT_EQ(r.pass_queries, 0);
  EXPECT_EQ(r.maxima_bytes, 0u);
  EXPECT_EQ(ranking_passes(0, 16, 1024, 0).passes, 0);  // no queries, no pass
}

// One prefill of n tokens (all n queries) at M3's shape on the H200's 132 SMs, the scan as
// make_plan sizes it (wgmma: 64 queries per tile; mma.sync / fp8: 32).
// producer: the bf16 or fp8 wgmma scan (else mma.sync, as with lse_out under automatic).
cuda::TileRankingInputs m3_prefill(int64_t n, cuda::IndexRanking ranking, bool producer) {
  cuda::TileRankingInputs in;
  in.ranking = ranking;
  in.producer_scan = producer;
  in.ranked = 15;
  in.total_q = n;
  in.batch = 1;
  in.queries_per_tile = producer ? 64 : 32;
  in.tile_bound = std::min(n, (n + in.queries_per_tile - 1) / in.queries_per_tile + 1);
  in.max_blocks = (n + 127) / 128;
  in.passes = ranking_passes(n, m3_query_bytes(n), kCap, 0);
  in.sms = 132;
  return in;
}

TEST(TileRanking, AutomaticRanksSeparatelyForTheProducerScans) {
  using R = cuda::IndexRanking;
  for (int64_t n : {32768, 65536, 131072, 1048576}) {
    EXPECT_TRUE(cuda::plan_tile_ranking(m3_prefill(n, R::automatic, true)).separate) << n;
    EXPECT_TRUE(cuda::plan_tile_ranking(m3_prefill(n, R::separate, true)).separate) << n;
    EXPECT_FALSE(cuda::plan_tile_ranking(m3_prefill(n, R::in_scan, true)).separate) << n;
  }
  // The mma.sync scan (other shapes, or lse_out under automatic) ranks in the scan over many
  // tiles unless separate is pinned.
  EXPECT_FALSE(cuda::plan_tile_ranking(m3_prefill(32768, R::automatic, false)).separate);
  EXPECT_TRUE(cuda::plan_tile_ranking(m3_prefill(32768, R::separate, false)).separate);
}

TEST(TileRanking, FewTilesSplitTheirBlocksUnlessInScanIsPinned) {
  using R = cuda::IndexRanking;
  // 8K with lse_out (the mma.sync scan): 257 tiles (< 2 per SM), 64 blocks in 4 chunks of 21.
  const cuda::TileRanking r = cuda::plan_tile_ranking(m3_prefill(8192, R::automatic, false));
  EXPECT_TRUE(r.separate);
  EXPECT_EQ(r.chunks, 4);
  EXPECT_EQ(r.chunk_blocks, 21);
  EXPECT_FALSE(cuda::plan_tile_ranking(m3_prefill(8192, R::in_scan, true)).separate);
  // Nothing ranked (topk = local + init blocks): the scan path writes the rows.
  cuda::TileRankingInputs none = m3_prefill(8192, R::separate, true);
  none.ranked = 0;
  EXPECT_FALSE(cuda::plan_tile_ranking(none).separate);
  // One query's maxima over the cap: no pass, in the scan.
  cuda::TileRankingInputs huge = m3_prefill(8192, R::automatic, true);
  huge.passes = ranking_passes(8192, kCap + 1, kCap, 0);
  EXPECT_FALSE(cuda::plan_tile_ranking(huge).separate);
}

TEST(TileRanking, ChunksCoverEveryBlockOnce) {
  using R = cuda::IndexRanking;
  for (int64_t n : {1, 127, 128, 129, 2047, 2048, 2049, 8192, 32768, 131072, 1048576})
    for (R ranking : {R::automatic, R::separate})
      for (bool producer : {false, true}) {
        const cuda::TileRanking r = cuda::plan_tile_ranking(m3_prefill(n, ranking, producer));
        if (!r.separate) continue;
        const int64_t blocks = (n + 127) / 128;
        EXPECT_GE(int64_t{r.chunks} * r.chunk_blocks, blocks) << n;
        EXPECT_LT(int64_t{r.chunks - 1} * r.chunk_blocks, blocks) << "an empty last chunk: " << n;
        EXPECT_GE(r.chunk_blocks, cuda::kMinTileChunk) << n;
        EXPECT_GE(r.pass_tile_bound, 1) << n;
      }
}

// wave_fitted_chunk against a brute-force search of the same wave model, and the 1M pass
// shape the profile found in 7 waves where 6.4 were full.
TEST(TileRanking, WaveFittedChunkMinimisesWholeWaves) {
  const auto cost = [](int64_t tiles, int64_t blocks, int64_t resident, int64_t chunk) {
    const int64_t chunks = (blocks + chunk - 1) / chunk;
    return (tiles * chunks + resident - 1) / resident * (chunk + cuda::kChunkStartBlocks);
  };
  std::mt19937 rng(23);
  for (int trial = 0; trial < 400; ++trial) {
    const int64_t tiles = 1 + rng() % 300, blocks = 1 + rng() % 9000, resident = 1 + rng() % 300;
    const int64_t chunk = cuda::wave_fitted_chunk(tiles, blocks, resident);
    const std::string what = std::to_string(tiles) + " tiles, " + std::to_string(blocks) +
                             " blocks, " + std::to_string(resident) + " resident";
    EXPECT_GE(chunk, std::min<int64_t>(blocks, cuda::kMinTileChunk)) << what;
    EXPECT_LE(chunk, std::max<int64_t>(blocks, cuda::kMinTileChunk)) << what;
    for (int64_t other = cuda::kMinTileChunk; other <= blocks; ++other)
      ASSERT_LE(cost(tiles, blocks, resident, chunk), cost(tiles, blocks, resident, other))
          << what << ": chunk " << chunk << " against " << other;
  }
  // A late 1M pass (65 tiles of ~8190 blocks, 132 SMs x 1 CTA): 2 chunks each, 130 CTAs in
  // one wave, instead of 13 chunks of 631 in 7 waves (6.4 full).
  EXPECT_EQ(cuda::wave_fitted_chunk(65, 8190, 132), 4095);
}

// pass_chunks on one long sequence: every row of a pass finds its blocks within the pass's
// chunks (for any k_len <= max_k_len), late passes get wave-fitted chunks, and the triangle
// (a pass from the sequence's start), a batch or an unfitted plan keep the plan's chunks.
TEST(TileRanking, PassChunksCoverEveryRowOfThePass) {
  using R = cuda::IndexRanking;
  for (int64_t n : {8192, 32768, 131072, 262144, 1048576})
    for (int64_t prefix : {int64_t{0}, int64_t{129}, n}) {  // keys cached before the queries
      cuda::TileRankingInputs in = m3_prefill(n, R::automatic, true);
      in.resident_ctas = 132;
      in.max_k_len = prefix + n;
      in.block_size = 128;
      in.skipped_blocks = 1 + 1;  // M3: init 1, local 1
      in.max_blocks = (in.max_k_len + 127) / 128;
      const cuda::TileRanking r = cuda::plan_tile_ranking(in);
      ASSERT_TRUE(r.separate) << n;
      int fitted = 0;
      for (int64_t pass = 0; pass < in.passes.passes; ++pass) {
        const cuda::PassChunks c = cuda::pass_chunks(r, pass);
        const std::string what = std::to_string(n) + " queries after " + std::to_string(prefix) +
                                 ", pass " + std::to_string(pass);
        ASSERT_GE(c.chunks, 1) << what;
        EXPECT_GE(c.chunk_blocks, cuda::kMinTileChunk) << what;
        fitted += c.chunk_blocks != r.chunk_blocks || c.chunks != r.chunks;
        const int64_t q_last = std::min(n, (pass + 1) * in.passes.pass_queries) - 1;
        for (int64_t k_len : {in.max_k_len, in.max_k_len - 1, n}) {  // k_len <= max_k_len
          const int64_t pos = k_len - n + q_last;                     // the pass's last query
          const int64_t cand_end = pos / 128 - 1 + 1;                 // own block - local + 1
          EXPECT_GE(1 + int64_t{c.chunks} * c.chunk_blocks, cand_end) << what << ", k_len " << k_len;
        }
        EXPECT_LT(int64_t{c.chunks - 1} * c.chunk_blocks, std::max<int64_t>(1, in.max_blocks))
            << "an empty last chunk: " << what;
      }
      if (prefix == 0 && n <= 65536) EXPECT_EQ(fitted, 0) << n << ": one pass, a triangle";
      if (n == 1048576) EXPECT_GT(fitted, 200) << "1M: the late passes are fitted";
    }
  cuda::TileRankingInputs batch = m3_prefill(1048576, R::automatic, true);
  batch.batch = 2;  // extents not known on the host: unfitted
  const cuda::TileRanking r = cuda::plan_tile_ranking(batch);
  for (int64_t pass : {0, 100, 255}) {
    EXPECT_EQ(cuda::pass_chunks(r, pass).chunk_blocks, r.chunk_blocks);
    EXPECT_EQ(cuda::pass_chunks(r, pass).chunks, r.chunks);
  }
}

// The pass tile range the scan's CTAs walk (pass_tile_range, written by tile_prefix_kernel)
// against a plain enumeration of every tile's queries, on varlen batches with empty sequences,
// lengths 1 and qpt +- 1, and passes of 1 query up to all of them; and the grid bound.
TEST(TileRanking, PassTileRangeHoldsExactlyThePassTiles) {
  std::mt19937 rng(22);
  const std::vector<std::vector<int64_t>> fixed = {
      {1}, {63}, {64}, {65}, {0, 5, 0}, {64, 1, 0, 129, 0}, {128, 128, 128}, {3, 0, 0, 0, 200}};
  for (int trial = 0; trial < 60; ++trial) {
    std::vector<int64_t> lens;
    if (trial < int(fixed.size())) {
      lens = fixed[trial];
    } else {
      lens.resize(1 + rng() % 9);
      for (int64_t& l : lens) l = rng() % 4 == 0 ? 0 : 1 + rng() % 300;
    }
    for (int64_t qpt : {1, 32, 64}) {
      const int64_t batch = int64_t(lens.size());
      std::vector<int64_t> q_start(batch + 1, 0), tile_prefix(batch + 1, 0);
      std::vector<int32_t> seq_of_query;
      std::vector<int64_t> tile_first_query, tile_queries;  // per tile, in tile order
      for (int64_t s = 0; s < batch; ++s) {
        q_start[s + 1] = q_start[s] + lens[s];
        seq_of_query.insert(seq_of_query.end(), static_cast<size_t>(lens[s]), static_cast<int32_t>(s));
        tile_prefix[s + 1] = tile_prefix[s] + (lens[s] + qpt - 1) / qpt;
        for (int64_t q = 0; q < lens[s]; q += qpt) {
          tile_first_query.push_back(q_start[s] + q);
          tile_queries.push_back(std::min(qpt, lens[s] - q));
        }
      }
      const int64_t total_q = q_start[batch];
      if (total_q == 0) continue;
      for (int64_t pass_q : {int64_t{1}, int64_t{7}, qpt, qpt + 1, total_q / 2 + 1, total_q}) {
        for (int64_t q_lo = 0; q_lo < total_q; q_lo += pass_q) {
          const int64_t q_hi = std::min(total_q, q_lo + pass_q) - 1;
          const cuda::TileRange r =
              cuda::pass_tile_range(q_start.data(), seq_of_query.data(), tile_prefix.data(), qpt, q_lo, q_hi);
          const std::string what = "trial " + std::to_string(trial) + ", qpt " + std::to_string(qpt) +
                                   ", queries [" + std::to_string(q_lo) + ", " + std::to_string(q_hi) + "]";
          for (int64_t t = 0; t < int64_t(tile_first_query.size()); ++t) {
            const bool holds = tile_first_query[t] <= q_hi && tile_first_query[t] + tile_queries[t] > q_lo;
            EXPECT_EQ(holds, t >= r.first && t <= r.last) << what << ", tile " << t;
          }
          EXPECT_LE(r.last - r.first + 1, cuda::pass_tile_bound(pass_q, qpt, batch)) << what;
        }
      }
    }
  }
}

}  // namespace
}  // namespace msa::testing
