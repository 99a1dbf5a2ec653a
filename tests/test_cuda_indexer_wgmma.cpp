// The two prefill index-scan engines of Di = B = 128 (the warpgroup-MMA
// producer_tile_scan_kernel<false>, 256 rows per CTA, default without lse_out; the mma.sync
// tile_scan_kernel) against the CPU,
// each pinned with MsaParams::cuda.index_scan: selection rows compared as sets with the near-tie
// tolerance of gpu_checks.h, twice for bitwise determinism. Both scan modes are
// covered, each pinned with MsaParams::cuda.index_ranking: split tiles (block maxima +
// select_rows_kernel) and fused tiles (lists in shared memory), over few and many tiles. Index heads 4 (M3), 1 and 3 (256 rows per
// tile not a multiple of the heads). Skipped without a CUDA device; ctest label "gpu".
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "gpu_checks.h"
#include "index_scan_cases.h"

namespace msa::testing {
namespace {

// Both prefill scan engines (wgmma: the default without lse_out; mma_sync) vs the CPU, each
// run twice for bitwise determinism; the wgmma scan with each ranking pinned (in the scan:
// the fused path; separate: block maxima + select_rows), the mma.sync scan as automatic
// picks (its fused path with lse_out is the training one, test_cuda_indexer_lse).
void expect_both_engines_match_cpu(const VarlenCase& c, const std::string& what) {
  const DoubleInputs in(c);
  const IndexerOutput cpu =
      indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), Impl::cpu);
  for (const auto& [engine, ranking] :
       {std::pair{cuda::Engine::wgmma, cuda::IndexRanking::in_scan},
        std::pair{cuda::Engine::wgmma, cuda::IndexRanking::separate},
        std::pair{cuda::Engine::mma_sync, cuda::IndexRanking::automatic}}) {
    const std::string label = what + (engine == cuda::Engine::wgmma ? " (wgmma scan" : " (mma.sync scan") +
                              (ranking == cuda::IndexRanking::in_scan    ? ", ranked in the scan)"
                               : ranking == cuda::IndexRanking::separate ? ", ranked separately)"
                                                                         : ")");
    MsaParams p = c.params();
    p.cuda.index_scan = engine;
    p.cuda.index_ranking = ranking;
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

INSTANTIATE_TEST_SUITE_P(Shapes, GpuIndexerWgmma,
                         ::testing::Values(index_shape(4, 1, 0),   // M3
                                           index_shape(1, 1, 0),   // 256 queries per tile
                                           index_shape(3, 1, 0),   // 85 queries = 255 rows
                                           index_shape(3, 2, 1)),  // init + 2 local blocks
                         shape_name);

// A 32K context in M3's shape: 20000 queries (fused tiles, long chains and lists) and the
// last 300 queries alone (split tiles over 8-block chunks).
TEST(GpuIndexerWgmmaLong, Context32KMatchesCpu) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  const CaseShape shape = index_shape(4, 1, 0);
  expect_both_engines_match_cpu(gpu_case(shape, {{.q_len = 20000, .k_len = 32768}}), "32K fused");
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

}  // namespace
}  // namespace msa::testing
