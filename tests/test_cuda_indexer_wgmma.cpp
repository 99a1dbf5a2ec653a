// The two prefill index-scan engines of Di = B = 128 (the warpgroup-MMA
// producer_tile_scan_kernel<false>, 256 rows per CTA, default without lse_out; the mma.sync
// tile_scan_kernel) against the CPU,
// each pinned with MsaParams::cuda.index_scan: selection rows compared as sets with the near-tie
// tolerance of gpu_checks.h, twice for bitwise determinism. Both scan modes are
// covered, each pinned with MsaParams::cuda.index_ranking: split tiles (block maxima +
// select_rows_kernel, in one pass or in passes of a few queries) and fused tiles (lists in
// shared memory), over few and many tiles. Index heads 4 (M3), 1 and 3 (256 rows per tile
// not a multiple of the heads). Skipped without a CUDA device; ctest label "gpu".
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "gpu_checks.h"
#include "index_scan_cases.h"

namespace msa::testing {
namespace {

// A pinned scan engine and ranking; max_chunk_queries > 0: separate ranking in passes of at
// most that many queries.
struct ScanChoice {
  cuda::Engine engine;
  cuda::IndexRanking ranking;
  int64_t max_chunk_queries = 0;
};

// Prefill scan engines (wgmma: the default without lse_out; mma_sync) vs the CPU (one
// reference for every choice), each run twice for bitwise determinism. By default the wgmma
// scan with each ranking pinned (in the scan: the fused path; separate: block maxima +
// select_rows) and the mma.sync scan as automatic picks (its fused path with lse_out is the
// training one, test_cuda_indexer_lse).
void expect_both_engines_match_cpu(const VarlenCase& c, const std::string& what,
                                   std::vector<ScanChoice> choices = {}) {
  if (choices.empty())
    choices = {{cuda::Engine::wgmma, cuda::IndexRanking::in_scan},
               {cuda::Engine::wgmma, cuda::IndexRanking::separate},
               {cuda::Engine::mma_sync, cuda::IndexRanking::automatic}};
  const DoubleInputs in(c);
  const IndexerOutput cpu =
      indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), Impl::cpu);
  for (const auto& [engine, ranking, max_chunk_queries] : choices) {
    const std::string label = what +
                              (engine == cuda::Engine::wgmma      ? " (wgmma scan"
                               : engine == cuda::Engine::mma_sync ? " (mma.sync scan"
                                                                  : " (automatic scan") +
                              (ranking == cuda::IndexRanking::in_scan    ? ", ranked in the scan"
                               : ranking == cuda::IndexRanking::separate ? ", ranked separately"
                                                                         : "") +
                              (max_chunk_queries > 0 ? ", passes of " + std::to_string(max_chunk_queries) + ")"
                                                     : std::string(")"));
    MsaParams p = c.params();
    p.cuda.index_scan = engine;
    p.cuda.index_ranking = ranking;
    p.cuda.max_chunk_queries = max_chunk_queries;
    const IndexerOutput first = indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, p, Impl::cuda);
    const IndexerOutput second = indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, p, Impl::cuda);
    expect_indexer_close(first, cpu, c, in, label);
    EXPECT_TRUE(bitwise_equal(first.topk, second.topk)) << label << ": repeated runs differ";
  }
}

class GpuIndexerWgmma : public ::testing::TestWithParam<CaseShape> {};

// Edge lengths (1, B-1, B, B+1, kB-1, kB, kB+1, kB + 5.5 B), whole and suffix prefills: few
// tiles, so the split mode runs (chunks of blocks, ragged chain tails).
TEST_P(GpuIndexerWgmma, EdgeLengthsSplitTilesMatchCpu) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  const MsaParams& p = GetParam().params;
  expect_both_engines_match_cpu(gpu_case(GetParam(), mixed_sequences(edge_lengths(p.block_size, p.topk))),
                           "edge lengths");
}

// The edge-length sequences plus 320 chunked prefills (1..64 new queries over 1..24 blocks
// of keys, so rankings decide): >= 2 tiles per SM, the fused mode (lists in shared memory),
// whole chains and every tail length.
TEST_P(GpuIndexerWgmma, ManySequencesFusedTilesMatchCpu) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  expect_both_engines_match_cpu(gpu_case(GetParam(), edge_and_many_prefills(GetParam().params)),
                                "many sequences");
}

// Separate ranking in passes (max_chunk_queries: the workspace bound that splits prefills
// beyond ~64K tokens at M3's shape into passes of 512 MiB of maxima): passes of 37 queries cut
// tiles (64 or 32 queries at 4 heads) and sequences, 1 query per pass is the extreme; both
// scans, against the CPU.
TEST_P(GpuIndexerWgmma, RankingPassesMatchCpu) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  const VarlenCase c = gpu_case(GetParam(), edge_and_many_prefills(GetParam().params));
  expect_both_engines_match_cpu(c, "many sequences", {{cuda::Engine::wgmma, cuda::IndexRanking::separate, 37},
                                                      {cuda::Engine::mma_sync, cuda::IndexRanking::separate, 37}});
  const VarlenCase edges = gpu_case(GetParam(), mixed_sequences(edge_lengths(GetParam().params.block_size,
                                                                             GetParam().params.topk)));
  expect_both_engines_match_cpu(edges, "edge lengths", {{cuda::Engine::wgmma, cuda::IndexRanking::separate, 1},
                                                       {cuda::Engine::mma_sync, cuda::IndexRanking::separate, 1}});
}

INSTANTIATE_TEST_SUITE_P(Shapes, GpuIndexerWgmma,
                         ::testing::Values(index_shape(4, 1, 0),   // M3
                                           index_shape(1, 1, 0),   // 256 queries per tile
                                           index_shape(3, 1, 0),   // 85 queries = 255 rows
                                           index_shape(3, 2, 1)),  // init + 2 local blocks
                         shape_name);

// A 32K context in M3's shape: 20000 queries (fused tiles, long chains and lists; and in
// passes) and the last 300 queries alone (split tiles over 8-block chunks).
TEST(GpuIndexerWgmmaLong, Context32KMatchesCpu) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  const CaseShape shape = index_shape(4, 1, 0);
  // Both scans ranked in the scan and separately, and the automatic choice over many tiles
  // (the wgmma scan, ranked separately) in passes; one CPU reference for the four.
  expect_both_engines_match_cpu(gpu_case(shape, {{.q_len = 20000, .k_len = 32768}}), "32K",
                                {{cuda::Engine::wgmma, cuda::IndexRanking::in_scan},
                                 {cuda::Engine::wgmma, cuda::IndexRanking::separate},
                                 {cuda::Engine::mma_sync, cuda::IndexRanking::automatic},
                                 {cuda::Engine::automatic, cuda::IndexRanking::automatic, 6000}});
  expect_both_engines_match_cpu(gpu_case(shape, {{.q_len = 300, .k_len = 32768}}), "32K split");
}

// Pinning the wgmma scan where it cannot run (Di = 64) is an error naming the field.
TEST(GpuIndexerWgmmaSetting, PinnedEngineThatCannotRunIsAClearError) {
  MSA_REQUIRE_CUDA();
  const VarlenCase c = gpu_case(make_shape(1, 4, 64, 64, 128, 4, 1, 0), {{.q_len = 300, .k_len = 3000}});
  MsaParams p = c.params();
  p.cuda.index_scan = cuda::Engine::wgmma;
  const std::string message =
      error_of([&] { indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, p, Impl::cuda); });
  EXPECT_NE(message.find("scan_engine"), std::string::npos) << message;
}

// A negative pass cap is an error naming the field.
TEST(GpuIndexerWgmmaSetting, NegativeChunkCapIsAClearError) {
  MSA_REQUIRE_CUDA();
  const VarlenCase c = gpu_case(index_shape(4, 1, 0), {{.q_len = 300, .k_len = 3000}});
  MsaParams p = c.params();
  p.cuda.max_chunk_queries = -1;
  const std::string message =
      error_of([&] { indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, p, Impl::cuda); });
  EXPECT_NE(message.find("max_chunk_queries"), std::string::npos) << message;
}

}  // namespace
}  // namespace msa::testing
