// The prefill index scan's separate-ranking passes (src/cuda/indexer/ranking_passes.h): plain
// C++, checked on the CPU. Every query is in exactly one pass, each pass's maxima fit the cap,
// the passes are equal (no small tail), and M3's contexts take the passes the docs state.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

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

}  // namespace
}  // namespace msa::testing
