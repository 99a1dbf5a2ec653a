// The warpgroup-MMA prefill index scan (MSA_INDEXER_WGMMA=1: wgmma_tile_scan_kernel, Di =
// B = 128, 256 rows per CTA) against the CPU: selection rows compared as sets with the
// near-tie tolerance of gpu_checks.h, twice for bitwise determinism. Its two modes are both
// covered: split tiles (few tiles: block maxima + select_rows_kernel) and fused tiles (many
// tiles, >= 2 per SM: lists in shared memory). Index heads 4 (M3), 1 and 3 (256 rows per
// tile not a multiple of the heads). Skipped without a CUDA device; ctest label "gpu".
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "gpu_checks.h"

namespace msa::testing {
namespace {

// MSA_INDEXER_WGMMA=value for one scope (the indexer reads it per call); the previous
// value (or its absence) is restored after.
class ScopedIndexerEngine {
 public:
  explicit ScopedIndexerEngine(const char* value) {
    const char* old = std::getenv("MSA_INDEXER_WGMMA");
    had_old_ = old != nullptr;
    if (had_old_) old_ = old;
    setenv("MSA_INDEXER_WGMMA", value, 1);
  }
  ~ScopedIndexerEngine() {
    if (had_old_)
      setenv("MSA_INDEXER_WGMMA", old_.c_str(), 1);
    else
      unsetenv("MSA_INDEXER_WGMMA");
  }
  ScopedIndexerEngine(const ScopedIndexerEngine&) = delete;
  ScopedIndexerEngine& operator=(const ScopedIndexerEngine&) = delete;

 private:
  bool had_old_ = false;
  std::string old_;
};

IndexerOutput wgmma_indexer(const VarlenCase& c) {
  const ScopedIndexerEngine engine("1");
  return indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), Impl::cuda);
}

// The wgmma scan vs the CPU, then a second run bitwise identical to the first.
void expect_wgmma_matches_cpu(const VarlenCase& c, const std::string& what) {
  const DoubleInputs in(c);
  const IndexerOutput cpu =
      indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), Impl::cpu);
  const IndexerOutput first = wgmma_indexer(c), second = wgmma_indexer(c);
  expect_indexer_close(first, cpu, c, in, what + " (MSA_INDEXER_WGMMA=1)");
  EXPECT_TRUE(bitwise_equal(first.topk, second.topk)) << what << ": repeated runs differ";
}

// Index heads Hi (the shape's KV heads) with Di = B = 128 and topk 16: the head dim and
// group of the main branch do not matter to the indexer (kept small).
CaseShape index_shape(int64_t index_heads, int local, int init) {
  return make_shape(index_heads, 1, 64, 128, 128, 16, local, init);
}

class GpuIndexerWgmma : public ::testing::TestWithParam<CaseShape> {};

// Edge lengths (1, B-1, B, B+1, kB-1, kB, kB+1, kB + 5.5 B), whole and suffix prefills: few
// tiles, so the split mode runs (chunks of blocks, ragged chain tails).
TEST_P(GpuIndexerWgmma, EdgeLengthsSplitTilesMatchCpu) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  const MsaParams& p = GetParam().params;
  expect_wgmma_matches_cpu(gpu_case(GetParam(), mixed_sequences(edge_lengths(p.block_size, p.topk))),
                           "edge lengths");
}

// The edge-length sequences plus 320 chunked prefills (1..64 new queries over 1..24 blocks
// of keys, so rankings decide): >= 2 tiles per SM, the fused mode (lists in shared memory),
// whole chains and every tail length.
TEST_P(GpuIndexerWgmma, ManySequencesFusedTilesMatchCpu) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  const MsaParams& p = GetParam().params;
  std::vector<Seq> seqs = mixed_sequences(edge_lengths(p.block_size, p.topk));
  for (int i = 0; i < 320; ++i) {
    const int64_t k_len = uniform_int(1, 24 * p.block_size + 3);
    seqs.push_back({.q_len = uniform_int(1, std::min<int64_t>(64, k_len)), .k_len = k_len});
  }
  std::shuffle(seqs.begin(), seqs.end(), rng());
  expect_wgmma_matches_cpu(gpu_case(GetParam(), seqs), "many sequences");
}

std::string shape_name(const ::testing::TestParamInfo<CaseShape>& info) {
  return info.param.describe();
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
  expect_wgmma_matches_cpu(gpu_case(shape, {{.q_len = 20000, .k_len = 32768}}), "32K fused");
  expect_wgmma_matches_cpu(gpu_case(shape, {{.q_len = 300, .k_len = 32768}}), "32K split");
}

TEST(GpuIndexerWgmmaSetting, UnknownValueIsAClearError) {
  MSA_REQUIRE_CUDA();
  const VarlenCase c = gpu_case(index_shape(4, 1, 0), {{.q_len = 300, .k_len = 3000}});
  std::string message;
  {
    const ScopedIndexerEngine engine("yes");
    message = error_of(
        [&] { indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), Impl::cuda); });
  }
  EXPECT_NE(message.find("MSA_INDEXER_WGMMA"), std::string::npos) << message;
}

}  // namespace
}  // namespace msa::testing
