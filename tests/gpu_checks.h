// What the GPU tests share: MSA_REQUIRE_CUDA (skip without a device), and the tolerances and
// comparisons of the CUDA ops against the CPU on the same bf16-rounded inputs.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "op_cases.h"

namespace msa::testing {

// Selection: CPU and GPU sum the same bf16 products in different orders (~1e-6 relative),
// so only blocks that close to the k-th best may swap.
inline constexpr double kTieTolerance = 1e-4;
inline constexpr double kMaxDifferingRowFraction = 0.01;
// O: the GPU rounds P to bf16 for the P.V product (2^-9 relative per term); 1e-2 norm-wise
// relative is the bf16 bar of the issue. LSE comes from f32 scores: ~1e-6.
inline constexpr double kOutputRelative = 1e-2, kOutputAbsolute = 3e-2;
inline constexpr double kLseRelative = 1e-4, kLseAbsolute = 2e-3;

#define MSA_REQUIRE_CUDA() \
  if (!impl_available(Impl::cuda)) GTEST_SKIP() << "no CUDA device"

inline Tensor bf16_rounded(const Tensor& t) { return t.to(DType::bf16).to(DType::f32); }

// First differing byte of two tensors (bitwise comparisons of device and host outputs), -1
// when they are equal; 0 when their sizes differ.
inline int64_t first_difference(const Tensor& a, const Tensor& b) {
  if (a.nbytes() != b.nbytes()) return 0;
  const auto* x = static_cast<const uint8_t*>(a.raw());
  const auto* y = static_cast<const uint8_t*>(b.raw());
  for (size_t i = 0; i < a.nbytes(); ++i)
    if (x[i] != y[i]) return static_cast<int64_t>(i);
  return -1;
}

// A varlen case whose float inputs are exactly representable in bf16.
inline VarlenCase gpu_case(const CaseShape& shape, std::vector<Seq> seqs) {
  VarlenCase c = make_varlen_case(shape, std::move(seqs));
  for (Tensor* t : {&c.q, &c.k, &c.v, &c.qi, &c.ki}) *t = bf16_rounded(*t);
  return c;
}

// make_shape(Hkv, G, D, Di, B, topk, local, init) at D = B = 128 for the groups whose tiles
// hold whole queries (16: M3; 8; 4 with an init block): the wgmma sparse kernels' and the
// query-major order's shapes (test_cuda_ops, test_cuda_sparse_order).
inline std::vector<CaseShape> whole_query_tile_shapes() {
  return {make_shape(4, 16, 128, 128, 128, 16, 1, 0), make_shape(2, 8, 128, 64, 128, 5, 1, 0),
          make_shape(2, 4, 128, 64, 128, 4, 1, 1)};
}

inline void expect_attention_close(const AttentionOutput& got, const AttentionOutput& want,
                                   const std::string& what) {
  expect_close(got.o, want.o, kOutputRelative, kOutputAbsolute, what + ": o");
  expect_close(got.lse, want.lse, kLseRelative, kLseAbsolute, what + ": lse");
}

// On a mismatch, where: the first output row (query, head) whose O differs from the CPU by
// more than the absolute bar, with its request, position and both LSEs.
inline void describe_first_bad_row(const AttentionOutput& got, const AttentionOutput& want,
                                   const VarlenCase& c, const std::string& what) {
  if (got.o.shape() != want.o.shape() || got.o.dim() != 3) return;
  const int64_t rows = got.o.size(0) * got.o.size(1), D = got.o.size(2), heads = got.o.size(1);
  double worst = 0;
  int64_t worst_row = -1, first_bad = -1;
  for (int64_t row = 0; row < rows; ++row) {
    double row_diff = 0;
    for (int64_t d = 0; d < D; ++d) {
      const double x = got.o.get(row * D + d), y = want.o.get(row * D + d);
      const double diff = std::isnan(x) || std::isnan(y) ? INFINITY : std::fabs(x - y);
      row_diff = std::max(row_diff, diff);
    }
    if (row_diff > worst) worst = row_diff, worst_row = row;
    if (first_bad < 0 && row_diff >= kOutputAbsolute) first_bad = row;
  }
  if (first_bad < 0) return;
  const int64_t query = first_bad / heads, head = first_bad % heads;
  std::ostringstream out;
  out << what << ": first bad O row: query " << query << " (request " << c.row_seq[query] << ", pos "
      << c.row_pos[query] << ", k_len " << c.seqs[c.row_seq[query]].k_len << "), q head " << head
      << ", lse got " << got.lse.get(first_bad) << " want " << want.lse.get(first_bad)
      << "; worst row " << worst_row << " max |diff| " << worst;
  ADD_FAILURE() << out.str();
}

inline void expect_dense_close(const AttentionOutput& got, const AttentionOutput& want,
                               const VarlenCase& c, const std::string& what) {
  expect_attention_close(got, want, what);
  describe_first_bad_row(got, want, c, what);
}

// Selection rows against the CPU's: only near-ties may swap, in at most 1% of the rows.
inline void expect_selection_close(const Tensor& got, const Tensor& want, const VarlenCase& c,
                                   const DoubleInputs& in, const std::string& what) {
  const double differing = expect_same_selection(got, want, c, in, kTieTolerance);
  std::cout << "[ selection ] " << what << " " << c.shape.describe() << ": " << differing * 100
            << "% of rows differ from the cpu\n";
  EXPECT_LE(differing, kMaxDifferingRowFraction) << what;
}

inline void expect_indexer_close(const IndexerOutput& got, const IndexerOutput& want,
                                 const VarlenCase& c, const DoubleInputs& in,
                                 const std::string& what) {
  expect_selection_close(got.topk, want.topk, c, in, what);
  if (got.lse.defined() && want.lse.defined()) {
    const Tensor expected = expected_lse_for_rows(c, in, got.topk, want.topk, want.lse);
    expect_close(got.lse, expected, kLseRelative, kLseAbsolute, what + ": lse");
  }
}

// 64 decode requests of different lengths for `shape`: mostly Q = 1, some Q up to 16, from
// a single key up to ~9 selections' worth of blocks.
inline std::vector<Seq> mixed_decode_batch64(const CaseShape& shape) {
  const int64_t B = shape.params.block_size, kb = B * shape.params.topk;
  std::vector<Seq> seqs;
  for (int64_t i = 0; i < 64; ++i) {
    const int64_t q_len = i % 5 == 0 ? 1 + i % 16 : 1;
    const int64_t k_len = std::max<int64_t>(q_len, 1 + (i * 7919) % (9 * kb) + (i % 3) * B);
    seqs.push_back({.q_len = q_len, .k_len = k_len});
  }
  return seqs;
}

}  // namespace msa::testing
