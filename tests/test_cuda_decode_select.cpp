// The selection kernels on crafted block maxima, row for row against the CPU: qi = e0 and
// every key token of block b = value(b) * e0, so block b's max is value(b) exactly (bf16
// values) and the ranking alone decides the rows. The decode path's decode_select_kernel
// (<= 16 queries per request; GpuDecodeSelect) and the prefill split path's select_rows_kernel
// (few query tiles over long rows; GpuSelectRows). Covers ties (equal maxima: ascending ids),
// -inf, NaN blocks (NaN ranks as -inf; a whole-NaN block so that the CPU's max and the scan's
// agree on -inf or NaN), rows with fewer candidates than slots, rows longer than the kernels'
// registers hold, each kernel's candidate-overflow fallback (the top blocks all in a few of
// the kernel's lanes or groups) and, for the decode select, grids of few rows (speculative
// loads) and many. Skipped without a CUDA device; ctest label "gpu".
#include <gtest/gtest.h>

#include <sstream>

#include <cmath>
#include <functional>
#include <limits>

#include "gpu_checks.h"

namespace msa::testing {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// value(sequence, block) -> block max (bf16-exact, +-inf or NaN).
using BlockValue = std::function<double(int64_t, int64_t)>;

VarlenCase crafted_case(const CaseShape& shape, std::vector<Seq> seqs, const BlockValue& value) {
  VarlenCase c = gpu_case(shape, std::move(seqs));
  const int64_t Di = shape.index_dim, B = shape.params.block_size;
  for (int64_t i = 0; i < c.qi.numel(); ++i) c.qi.set(i, i % Di == 0 ? 1.0 : 0.0);
  for (size_t s = 0; s < c.seqs.size(); ++s)
    for (int64_t t = 0; t < c.seqs[s].k_len; ++t)
      for (int64_t d = 0; d < Di; ++d)
        c.ki.set((c.k_start[s] + t) * Di + d, d == 0 ? value(static_cast<int64_t>(s), t / B) : 0.0);
  return c;
}

// Selection rows of the CUDA indexer (decode path) on `c` equal the CPU's on `cpu_case`
// (the same case, or one with NaN blocks replaced by -inf), slot for slot.
void expect_same_rows(const VarlenCase& c, const VarlenCase& cpu_case, const std::string& what) {
  SCOPED_TRACE(what);
  const MsaParams& p = c.params();
  const VarlenCase& r = cpu_case;
  const Tensor want = indexer(r.qi, r.ki, r.cu_seqlens_q, r.cu_seqlens_k, p, Impl::cpu).topk;
  const Tensor got = indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, p, Impl::cuda).topk;
  ASSERT_EQ(got.shape(), want.shape());
  const int64_t slots = want.size(2), rows = want.numel() / slots;
  int64_t differing = 0;
  for (int64_t r = 0; r < rows; ++r) {
    bool same = true;
    for (int64_t s = 0; s < slots; ++s) same = same && got.get(r * slots + s) == want.get(r * slots + s);
    if (!same && differing++ == 0) {
      std::ostringstream out;
      out << "first differing row " << r << " (head " << r / want.size(1) << ", query "
          << r % want.size(1) << "): got";
      for (int64_t s = 0; s < slots; ++s) out << ' ' << got.get(r * slots + s);
      out << " want";
      for (int64_t s = 0; s < slots; ++s) out << ' ' << want.get(r * slots + s);
      ADD_FAILURE() << out.str();
    }
  }
  EXPECT_EQ(differing, 0) << "of " << rows << " rows";
}
void expect_same_rows(const VarlenCase& c, const std::string& what) { expect_same_rows(c, c, what); }

// make_shape(Hkv, G, D, Di, B, topk, local, init): 4 index heads like M3, B = 64 so that
// 1M-like rows (8192+ blocks) stay small on the CPU.
CaseShape select_shape(int topk, int local, int init) {
  return make_shape(4, 1, 64, 64, 64, topk, local, init);
}

// Ties over rows of every length class: all maxima equal; five values repeated over the row
// (ties across threads and groups); -0 keys (their scores are +-0: zeros tie). `q` queries
// per request (the five-values case: `q_first` and `q` over `five_blocks` and 700 blocks).
void expect_ties_rank_by_ascending_id(int64_t q, int64_t q_first, int64_t five_blocks) {
  for (const CaseShape& shape : {select_shape(16, 1, 0), select_shape(32, 2, 3)}) {
    SCOPED_TRACE(shape.describe());
    expect_same_rows(crafted_case(shape, {{.q_len = q, .k_len = 1000 * 64 + 5}}, [](int64_t, int64_t) { return 1.0; }),
                     "all equal");
    expect_same_rows(crafted_case(shape, {{.q_len = q_first, .k_len = five_blocks * 64 + 1}, {.q_len = q, .k_len = 700 * 64}},
                                  [](int64_t s, int64_t b) { return 0.5 * double((b * 7 + s) % 5); }),
                     "five values");
    expect_same_rows(crafted_case(shape, {{.q_len = q, .k_len = 400 * 64 + 9}},
                                  [](int64_t, int64_t b) { return b % 3 == 0 ? -0.0 : (b % 3 == 1 ? 0.0 : -1.0); }),
                     "signed zeros");
  }
}

TEST(GpuDecodeSelect, TiesRankByAscendingId) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  expect_ties_rank_by_ascending_id(1, 2, 3000);
}

// NaN maxima rank as -inf (the CPU's comparator has no NaN rule: it gets -inf there).
TEST(GpuDecodeSelect, InfinityAndNaNBlocks) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  const CaseShape shape = select_shape(16, 1, 1);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  // Mostly -inf / NaN blocks with a few finite ones: the finite ones first, then the
  // -inf and NaN blocks by ascending id.
  const auto sparse_finite = [&](double nan_as) {
    return [=](int64_t, int64_t b) { return b % 97 == 5 ? double(b % 13) : (b % 2 ? -kInf : nan_as); };
  };
  const auto mixed_inf = [&](double nan_as) {
    return [=](int64_t, int64_t b) { return b % 4 == 0 ? nan_as : (b % 4 == 1 ? kInf : -kInf); };
  };
  const auto all_nan = [&](double nan_as) { return [=](int64_t, int64_t) { return nan_as; }; };
  const std::vector<Seq> long_row{{.q_len = 1, .k_len = 2048 * 64 + 3}};
  const std::vector<Seq> mid_row{{.q_len = 1, .k_len = 600 * 64}};
  const std::vector<Seq> short_row{{.q_len = 1, .k_len = 300 * 64 + 1}};
  expect_same_rows(crafted_case(shape, long_row, sparse_finite(nan)),
                   crafted_case(shape, long_row, sparse_finite(-kInf)), "-inf and NaN");
  expect_same_rows(crafted_case(shape, mid_row, mixed_inf(nan)),
                   crafted_case(shape, mid_row, mixed_inf(-kInf)), "+inf, -inf and NaN");
  expect_same_rows(crafted_case(shape, short_row, all_nan(nan)),
                   crafted_case(shape, short_row, all_nan(-kInf)), "all NaN");
  expect_same_rows(crafted_case(shape, long_row, sparse_finite(-kInf)), "-inf only");
}

// Rows with fewer candidates than slots: one request per length of min_blocks..max_blocks
// blocks (minus 3 tokens), `q_len` queries each.
void expect_short_rows_as_on_the_cpu(const CaseShape& shape, int64_t q_len, int64_t min_blocks, int64_t max_blocks) {
  std::vector<Seq> seqs;
  for (int64_t blocks = min_blocks; blocks <= max_blocks; ++blocks) seqs.push_back({.q_len = q_len, .k_len = blocks * 64 - 3});
  expect_same_rows(crafted_case(shape, seqs, [](int64_t s, int64_t b) { return double((b * 5 + s) % 7) - 3.0; }),
                   "short rows");
}

TEST(GpuDecodeSelect, FewerCandidatesThanSlots) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  expect_short_rows_as_on_the_cpu(select_shape(16, 2, 2), 1, 1, 20);
}

// Rows beyond the registers (> 8192 blocks: the reloading loop) and the candidate overflow:
// value = 32 - group, group = (block / 4) % 32 (the kernel's groups with init = 0), so the
// threshold admits whole groups (> 1024 candidates: the exact one-warp fallback).
TEST(GpuDecodeSelect, LongRowsAndCandidateOverflow) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  const CaseShape shape = select_shape(16, 1, 0);
  const auto group_value = [](int64_t, int64_t b) { return 32.0 - double((b / 4) % 32); };
  for (int64_t blocks : {int64_t{4096}, int64_t{8192}, int64_t{9000}}) {
    SCOPED_TRACE("blocks " + std::to_string(blocks));
    expect_same_rows(crafted_case(shape, {{.q_len = 1, .k_len = blocks * 64 + 17}}, group_value),
                     "one group on top");
    expect_same_rows(crafted_case(shape, {{.q_len = 1, .k_len = blocks * 64 + 17}},
                                  [](int64_t, int64_t b) { return double((b * 2654435761u) % 251) / 8.0; }),
                     "hashed values");
  }
}

// Many rows (> SM count: no speculative loads) next to few: 3 requests x 16 queries x 4 heads.
TEST(GpuDecodeSelect, ManyRows) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  const CaseShape shape = select_shape(16, 1, 0);
  expect_same_rows(crafted_case(shape,
                                {{.q_len = 16, .k_len = 2500 * 64 + 7},
                                 {.q_len = 16, .k_len = 40 * 64},
                                 {.q_len = 16, .k_len = 1100 * 64 + 63}},
                                [](int64_t s, int64_t b) { return double((b * 31 + s * 7) % 64) / 4.0; }),
                   "many rows");
}

// ---- select_rows_kernel (prefill, split tiles: 40 queries over up to 3000 blocks) ----

TEST(GpuSelectRows, TiesInfinitiesAndNaNRankAsOnTheCpu) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  expect_ties_rank_by_ascending_id(40, 17, 300);
  const CaseShape shape = select_shape(16, 1, 1);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const auto mixed = [](double nan_as) {
    return [=](int64_t, int64_t b) {
      return b % 97 == 5 ? double(b % 13) : (b % 4 == 0 ? nan_as : (b % 4 == 1 ? kInf : -kInf));
    };
  };
  const std::vector<Seq> rows{{.q_len = 40, .k_len = 900 * 64 + 3}};
  expect_same_rows(crafted_case(shape, rows, mixed(nan)), crafted_case(shape, rows, mixed(-kInf)),
                   "+inf, -inf and NaN");
}

// Short rows (fewer candidates than slots), rows beyond the registers (> 128 blocks: the
// reloading loops), and the candidate overflow: the larger values in lanes 0..13 of the
// kernel's warp (block % 32 < 14 with init = 0), so the threshold (the 15th best lane best)
// admits about 14 x 31 candidates, more than the warp's buffer: the exact list scan.
TEST(GpuSelectRows, ShortAndLongRowsAndCandidateOverflow) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  const CaseShape shape = select_shape(16, 1, 0);
  expect_short_rows_as_on_the_cpu(shape, 20, 2, 12);
  expect_same_rows(crafted_case(shape, {{.q_len = 40, .k_len = 3000 * 64 + 17}},
                                [](int64_t, int64_t b) { return double((b * 2654435761u) % 251) / 8.0; }),
                   "hashed values");
  expect_same_rows(crafted_case(shape, {{.q_len = 40, .k_len = 1000 * 64 + 17}},
                                [](int64_t, int64_t b) { return b % 32 < 14 ? 100.0 - double(b % 7) : double(b % 5); }),
                   "lanes 0..13 on top");
}

}  // namespace
}  // namespace msa::testing
