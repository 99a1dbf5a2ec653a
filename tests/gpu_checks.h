// Tolerances and comparisons of the GPU tests (CUDA ops against the CPU on the same
// bf16-rounded inputs), shared by test_cuda_ops.cpp, test_cuda_graph.cpp and
// test_cuda_quantized.cpp.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <iostream>
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

// A varlen case whose float inputs are exactly representable in bf16.
inline VarlenCase gpu_case(const CaseShape& shape, std::vector<Seq> seqs) {
  VarlenCase c = make_varlen_case(shape, std::move(seqs));
  for (Tensor* t : {&c.q, &c.k, &c.v, &c.qi, &c.ki}) *t = bf16_rounded(*t);
  return c;
}

inline void expect_attention_close(const AttentionOutput& got, const AttentionOutput& want,
                                   const std::string& what) {
  expect_close(got.o, want.o, kOutputRelative, kOutputAbsolute, what + ": o");
  expect_close(got.lse, want.lse, kLseRelative, kLseAbsolute, what + ": lse");
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
