// The CUDA indexer's selected LSE (training, docs/msa.md §3.6) on its fused path: the mma.sync
// tile scan keeps each ranked block's (max, sum-exp) in its top lists and writes the ranked
// blocks' LSE, then selected_lse_kernel adds the forced (init, local) blocks (see
// src/cuda/indexer/indexer.cu). Long packed batches (4K..32K contexts, whole and chunked prefill,
// lengths around B and kB, many sequences, temperature != 1) so that the plan takes the
// fused path; rows against the CPU op, the LSE against an f64 recomputation over the GPU's
// own rows, and bitwise-identical repeated runs. Skipped without a CUDA device; label "gpu".
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <iostream>
#include <string>

#include "cuda/common/sm_count.h"
#include "gpu_checks.h"

namespace msa::testing {
namespace {

// (query, index head) rows per tile of the mma.sync scan (TileScanTraits::kRows).
constexpr int64_t kTileRows = 256;
// f32 scores from bf16 inputs, ex2.approx sums: ~1e-6 expected; the bar leaves room.
constexpr double kLseAbsoluteVsF64 = 5e-4;

int64_t index_heads(const CaseShape& shape) { return shape.kv_heads; }

// make_plan (src/cuda/indexer/indexer.cu) splits tiles into chunks, and then keeps the per-row
// selected_lse_kernel for the LSE, only while its tile bound min(total_q,
// ceil(total_q / queries_per_tile) + batch) is below 2 x SMs (and the longest context has
// more than 8 blocks, true here). So: long sequences, lengths around B and kB, and then
// short whole-prefill fillers (1..2B tokens; early rows without candidates) until the
// bound is at least 2 x SMs + 16 on this device.
std::vector<Seq> fused_path_sequences(const CaseShape& shape) {
  const int64_t B = shape.params.block_size, kb = B * shape.params.topk;
  std::vector<Seq> seqs = {
      {.q_len = 4096, .k_len = 4096},             // whole prefill
      {.q_len = 300, .k_len = 32768},             // chunked prefill: the last 300 of 32K
      {.q_len = 700, .k_len = 16384 + B / 2},     // chunked, a partial last block
      {.q_len = 1000, .k_len = 8192 + 1},         // chunked, one token into a new block
      {.q_len = 1, .k_len = 4 * kb + 3},          // one query after a long prefix
      {.q_len = kb + 1, .k_len = kb + 1},
      {.q_len = kb, .k_len = kb},
      {.q_len = kb - 1, .k_len = kb - 1},
      {.q_len = B + 1, .k_len = B + 1},
      {.q_len = B, .k_len = B},
      {.q_len = B - 1, .k_len = B - 1},
      {.q_len = 1, .k_len = 1},
  };
  const int64_t queries_per_tile = kTileRows / index_heads(shape);
  const int64_t needed = 2 * int64_t{cuda::sm_count()} + 16;
  const auto tile_bound = [&] {
    int64_t total_q = 0;
    for (const Seq& s : seqs) total_q += s.q_len;
    return std::min<int64_t>(total_q, (total_q + queries_per_tile - 1) / queries_per_tile +
                                          static_cast<int64_t>(seqs.size()));
  };
  for (int64_t i = 0; tile_bound() < needed; ++i) {
    const int64_t length = 1 + (i * 37) % (2 * B);
    seqs.push_back({.q_len = length, .k_len = length});
  }
  std::shuffle(seqs.begin(), seqs.end(), rng());
  return seqs;
}

struct LseShape {
  CaseShape shape;
  double temperature, index_scale;  // index_scale 0: 1 / sqrt(Di)
};

void PrintTo(const LseShape& s, std::ostream* out) {
  *out << s.shape.describe() << " T " << s.temperature << " index_scale " << s.index_scale;
}

class GpuIndexerFusedLse : public ::testing::TestWithParam<LseShape> {};

TEST_P(GpuIndexerFusedLse, LongBatchesMatchReference) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  CaseShape shape = GetParam().shape;
  // The fused per-block LSE lives in the mma.sync scan (the default with an LSE wanted).
  shape.params.cuda.index_scan = cuda::Engine::mma_sync;
  shape.params.temperature = GetParam().temperature;
  shape.params.index_scale = GetParam().index_scale;
  const VarlenCase c = gpu_case(shape, fused_path_sequences(shape));
  std::cout << "[ fused lse ] " << shape.describe() << ": " << c.seqs.size() << " sequences, "
            << c.total_q() << " queries\n";
  const DoubleInputs in(c);
  const MsaParams& p = c.params();
  const auto run = [&](Impl impl) {
    return indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, p, impl);
  };
  const IndexerOutput got = run(Impl::cuda);
  ASSERT_TRUE(got.lse.defined());
  expect_indexer_close(got, run(Impl::cpu), c, in, "fused lse");

  // The LSE over the GPU's own rows, recomputed in f64 from the same bf16 inputs.
  const Tensor expected =
      expected_index_lse(c, in, got.topk, default_index_scale(shape), p.temperature);
  EXPECT_TRUE(same_neg_inf_positions(got.lse, expected));
  double worst = 0;
  int64_t worst_index = -1;
  for (int64_t i = 0; i < expected.numel(); ++i) {
    const double x = got.lse.get(i), y = expected.get(i);
    if (x == kNegInf && y == kNegInf) continue;
    const double error = std::isfinite(x) ? std::fabs(x - y) : HUGE_VAL;
    if (error > worst || worst_index < 0) {
      worst = error;
      worst_index = i;
    }
  }
  const int64_t rows = got.topk.size(1);
  std::cout << "[ fused lse ] max |lse - f64| " << worst << " at head " << worst_index / rows
            << " row " << worst_index % rows << "\n";
  EXPECT_LT(worst, kLseAbsoluteVsF64)
      << "head " << worst_index / rows << " row " << worst_index % rows << " (pos "
      << c.row_pos[worst_index % rows] << "): got " << got.lse.get(worst_index) << ", want "
      << expected.get(worst_index) << ", selection "
      << row_string(selection_row(got.topk, worst_index / rows, worst_index % rows));

  const IndexerOutput again = run(Impl::cuda);
  EXPECT_TRUE(bitwise_equal(got.topk, again.topk)) << "rows differ between two runs";
  EXPECT_TRUE(bitwise_equal(got.lse, again.lse)) << "lse differs between two runs";
}

std::string lse_shape_name(const ::testing::TestParamInfo<LseShape>& info) {
  return info.param.shape.describe() + (info.param.temperature == 1 ? "_T1" : "_T07");
}

// make_shape(Hkv = Hi, G, D, Di, B, topk, local, init); G and D only size unused q/k/v.
INSTANTIATE_TEST_SUITE_P(
    Shapes, GpuIndexerFusedLse,
    ::testing::Values(
        LseShape{make_shape(4, 1, 64, 128, 128, 16, 1, 0), 0.7, 0},     // MiniMax-M3
        LseShape{make_shape(4, 1, 64, 128, 128, 16, 1, 0), 1.0, 0.05},  // M3, custom scale
        LseShape{make_shape(2, 1, 64, 64, 64, 8, 2, 1), 0.7, 0.05},     // init + 2 local blocks
        // 3 heads: 85 queries = 255 rows per tile (one idle lane); k 32 with 2 init blocks.
        LseShape{make_shape(3, 1, 64, 128, 64, 32, 1, 2), 0.7, 0}),
    lse_shape_name);

}  // namespace
}  // namespace msa::testing
