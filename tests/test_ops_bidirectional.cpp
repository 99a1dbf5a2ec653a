// Bidirectional dense attention (MsaParams::causal = false, what the vision tower runs within
// each image): the optimised CPU forward and backward against the f64 reference over a shape
// matrix (lengths 1, B-1, B, B+1, several blocks; several sequences; group sizes 1..16; head
// dims 16..128 including the ViT's 80), varlen and paged; the reference itself against the
// causal op (a bidirectional query sees what a causal query at the sequence's last position
// sees); and every causal-only op rejecting causal = false.
#include <gtest/gtest.h>

#include "op_cases.h"

namespace msa::testing {
namespace {

// Same budget as the causal forward tests (test_ops_forward.cpp): f32 against f64 over at
// most a few hundred keys stays near 1e-6 relative; a missing or extra key is O(1e-2).
constexpr double kF32Tolerance = 1e-5;
constexpr double kF32AbsTolerance = 1e-4;

MsaParams bidirectional(MsaParams params) {
  params.causal = false;
  return params;
}

struct BidirectionalCase {
  CaseShape shape;
  std::vector<int64_t> lengths;
};

void PrintTo(const BidirectionalCase& c, std::ostream* out) { *out << c.shape.describe(); }

std::vector<BidirectionalCase> shape_matrix() {
  // make_shape(Hkv, G, D, Di, B, topk, local, init); topk/local/init are unused by dense ops.
  const auto lengths = [](int64_t B) {
    return std::vector<int64_t>{1, B - 1, B, B + 1, 3 * B + 5, 2};
  };
  return {
      {make_shape(1, 1, 16, 16, 4, 2, 1, 0), lengths(4)},
      {make_shape(16, 1, 80, 16, 16, 2, 1, 0), lengths(16)},  // the ViT: 16 heads of 80, MHA
      {make_shape(2, 1, 80, 16, 8, 2, 1, 0), lengths(8)},
      {make_shape(2, 4, 64, 16, 8, 2, 1, 0), lengths(8)},
      {make_shape(1, 16, 128, 16, 4, 2, 1, 0), lengths(4)},  // two lane vectors of heads
      {make_shape(4, 2, 16, 16, 128, 2, 1, 0), {1, 127, 128, 129, 300}},
      {make_shape(3, 3, 80, 16, 4, 2, 1, 0), {1, 3, 4, 5, 40}},  // odd group and head counts
  };
}

std::string case_name(const ::testing::TestParamInfo<BidirectionalCase>& info) {
  return info.param.shape.describe();
}

class Bidirectional : public ::testing::TestWithParam<BidirectionalCase> {};

// Whole sequences (the ViT) and, mixed in, query suffixes of longer key sequences.
VarlenCase whole_case(const BidirectionalCase& bc) {
  return make_varlen_case(bc.shape, whole_prefills(bc.lengths));
}
VarlenCase mixed_case(const BidirectionalCase& bc) {
  return make_varlen_case(bc.shape, mixed_sequences(bc.lengths));
}

void expect_attention_matches(const AttentionOutput& got, const AttentionOutput& want,
                              const std::string& what) {
  expect_close(got.o, want.o, kF32Tolerance, kF32AbsTolerance, what + ": o");
  expect_close(got.lse, want.lse, kF32Tolerance, kF32AbsTolerance, what + ": lse");
}

TEST_P(Bidirectional, CpuMatchesReference) {
  MSA_RESEED_AND_TRACE();
  for (const VarlenCase& c : {whole_case(GetParam()), mixed_case(GetParam())}) {
    const MsaParams p = bidirectional(c.params());
    const auto run = [&](Impl impl) {
      return dense_attention(c.q, c.k, c.v, c.cu_seqlens_q, c.cu_seqlens_k, p, impl);
    };
    expect_attention_matches(run(Impl::cpu), run(Impl::reference), "bidirectional dense");
  }
}

TEST_P(Bidirectional, PagedMatchesVarlenAndReference) {
  MSA_RESEED_AND_TRACE();
  const VarlenCase c = mixed_case(GetParam());
  const MsaParams p = bidirectional(c.params());
  PagedRequests paged = page_varlen_case(c);
  poison_unused_cache_slots(paged.cache);  // a read beyond a sequence's keys gives NaN
  const AttentionOutput got =
      paged_dense_attention(c.q, paged.cache, paged.cu_seqlens_q, p, Impl::cpu);
  expect_attention_matches(
      got, paged_dense_attention(c.q, paged.cache, paged.cu_seqlens_q, p, Impl::reference),
      "paged vs reference");
  expect_attention_matches(
      got, dense_attention(c.q, c.k, c.v, c.cu_seqlens_q, c.cu_seqlens_k, p, Impl::cpu),
      "paged vs varlen");
}

// The reference's bidirectional rule checked through the causal op: query row r of sequence b
// sees all k_len keys, which is what a causal query at position k_len - 1 sees. So the
// bidirectional output of every row equals a causal run whose only query (q_len = 1) is that
// row, placed at the end of the same keys.
TEST_P(Bidirectional, EveryQuerySeesWhatTheLastCausalQuerySees) {
  MSA_RESEED_AND_TRACE();
  const VarlenCase c = whole_case(GetParam());
  const AttentionOutput all = dense_attention(c.q, c.k, c.v, c.cu_seqlens_q, c.cu_seqlens_k,
                                              bidirectional(c.params()), Impl::reference);
  for (int64_t row = 0; row < c.total_q(); ++row) {
    const int64_t seq = c.row_seq[row], k_len = c.seqs[seq].k_len;
    const Tensor k = gather_rows(c.k, [&] {
      std::vector<int64_t> rows(k_len);
      for (int64_t t = 0; t < k_len; ++t) rows[t] = c.k_start[seq] + t;
      return rows;
    }());
    const Tensor v = gather_rows(c.v, [&] {
      std::vector<int64_t> rows(k_len);
      for (int64_t t = 0; t < k_len; ++t) rows[t] = c.k_start[seq] + t;
      return rows;
    }());
    const AttentionOutput one =
        dense_attention(gather_rows(c.q, {row}), k, v, cu_seqlens({1}), cu_seqlens({k_len}),
                        c.params(), Impl::reference);
    expect_attention_matches(one, {gather_rows(all.o, {row}), gather_rows(all.lse, {row})},
                             "row " + std::to_string(row));
    if (::testing::Test::HasFailure()) return;
  }
}

// Causal and bidirectional differ wherever a query has keys after it (tests can fail).
TEST_P(Bidirectional, DiffersFromCausalWhereKeysFollowTheQuery) {
  MSA_RESEED_AND_TRACE();
  const VarlenCase c = whole_case(GetParam());
  const AttentionOutput causal =
      dense_attention(c.q, c.k, c.v, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), Impl::cpu);
  const AttentionOutput both = dense_attention(c.q, c.k, c.v, c.cu_seqlens_q, c.cu_seqlens_k,
                                               bidirectional(c.params()), Impl::cpu);
  const int64_t per_row = c.q.numel() / c.total_q();
  for (int64_t row = 0; row < c.total_q(); ++row) {
    const bool last = c.row_pos[row] == c.seqs[c.row_seq[row]].k_len - 1;
    double diff = 0;
    for (int64_t e = 0; e < per_row; ++e)
      diff = std::max(diff, std::fabs(causal.o.get(row * per_row + e) - both.o.get(row * per_row + e)));
    if (last) EXPECT_LT(diff, 1e-5) << "row " << row << " (last of its sequence)";
    else EXPECT_GT(diff, 1e-4) << "row " << row;
  }
}

TEST_P(Bidirectional, BackwardCpuMatchesReference) {
  MSA_RESEED_AND_TRACE();
  const VarlenCase c = mixed_case(GetParam());
  const MsaParams p = bidirectional(c.params());
  const AttentionOutput fwd =
      dense_attention(c.q, c.k, c.v, c.cu_seqlens_q, c.cu_seqlens_k, p, Impl::reference);
  const Tensor grad_o = random_normal(c.q.shape());
  const auto run = [&](Impl impl) {
    return dense_attention_backward(c.q, c.k, c.v, fwd.o, fwd.lse, grad_o, c.cu_seqlens_q,
                                    c.cu_seqlens_k, p, impl);
  };
  const AttentionGrads want = run(Impl::reference), got = run(Impl::cpu);
  expect_close(got.dq, want.dq, kF32Tolerance, kF32AbsTolerance, "dq");
  expect_close(got.dk, want.dk, kF32Tolerance, kF32AbsTolerance, "dk");
  expect_close(got.dv, want.dv, kF32Tolerance, kF32AbsTolerance, "dv");
}

INSTANTIATE_TEST_SUITE_P(Shapes, Bidirectional, ::testing::ValuesIn(shape_matrix()), case_name);

// The reference's backward of the bidirectional mode against central differences of its
// forward (f64): a loss L = sum(grad_o * o) perturbed in a few q, k and v elements.
TEST(BidirectionalBackward, ReferenceMatchesFiniteDifferences) {
  MSA_RESEED_AND_TRACE();
  const VarlenCase c = make_varlen_case(make_shape(2, 2, 8, 8, 4, 2, 1, 0),
                                        {{.q_len = 3, .k_len = 7}, {.q_len = 5, .k_len = 5}});
  const MsaParams p = bidirectional(c.params());
  const Tensor q = c.q.to(DType::f64), k = c.k.to(DType::f64), v = c.v.to(DType::f64);
  const Tensor grad_o = random_normal(q.shape(), 1.0, DType::f64);
  const auto loss = [&](const Tensor& qq, const Tensor& kk, const Tensor& vv) {
    const Tensor o =
        dense_attention(qq, kk, vv, c.cu_seqlens_q, c.cu_seqlens_k, p, Impl::reference).o;
    double sum = 0;
    for (int64_t i = 0; i < o.numel(); ++i) sum += o.get(i) * grad_o.get(i);
    return sum;
  };
  const AttentionOutput fwd =
      dense_attention(q, k, v, c.cu_seqlens_q, c.cu_seqlens_k, p, Impl::reference);
  const AttentionGrads grads = dense_attention_backward(q, k, v, fwd.o, fwd.lse, grad_o,
                                                        c.cu_seqlens_q, c.cu_seqlens_k, p,
                                                        Impl::reference);
  constexpr double kStep = 1e-6;
  const auto check = [&](const Tensor& x, const Tensor& grad, int which, const char* name) {
    for (int64_t i = 0; i < x.numel(); i += 7) {
      Tensor plus = x.clone(), minus = x.clone();
      plus.set(i, x.get(i) + kStep);
      minus.set(i, x.get(i) - kStep);
      const double numeric =
          which == 0 ? (loss(plus, k, v) - loss(minus, k, v)) / (2 * kStep)
          : which == 1 ? (loss(q, plus, v) - loss(q, minus, v)) / (2 * kStep)
                       : (loss(q, k, plus) - loss(q, k, minus)) / (2 * kStep);
      EXPECT_NEAR(grad.get(i), numeric, 1e-6 + 1e-5 * std::fabs(numeric)) << name << "[" << i << "]";
    }
  };
  check(q, grads.dq, 0, "dq");
  check(k, grads.dk, 1, "dk");
  check(v, grads.dv, 2, "dv");
}

// Every op whose math is causal refuses causal = false, naming the field.
TEST(BidirectionalErrors, CausalOnlyOpsRejectIt) {
  MSA_RESEED_AND_TRACE();
  const VarlenCase c = make_varlen_case(make_shape(2, 2, 8, 8, 2, 3, 1, 0),
                                        {{.q_len = 3, .k_len = 6}, {.q_len = 2, .k_len = 2}});
  const MsaParams causal = c.params(), p = bidirectional(c.params());
  const Tensor topk =
      indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, causal, Impl::reference).topk;
  const PagedRequests paged = page_varlen_case(c);
  const AttentionOutput fwd =
      sparse_attention(c.q, c.k, c.v, topk, c.cu_seqlens_q, c.cu_seqlens_k, causal, Impl::cpu);
  const std::string words = "argument 'causal': expected true for ";
  for (const Impl impl : {Impl::reference, Impl::cpu}) {
    SCOPED_TRACE(std::string(impl_name(impl)));
    expect_error([&] { indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, p, impl); },
                 words + "indexer");
    expect_error([&] { sparse_attention(c.q, c.k, c.v, topk, c.cu_seqlens_q, c.cu_seqlens_k, p, impl); },
                 words + "sparse_attention");
    expect_error([&] {
      sparse_attention_backward(c.q, c.k, c.v, topk, fwd.o, fwd.lse, fwd.o, c.cu_seqlens_q,
                                c.cu_seqlens_k, p, impl);
    }, words + "sparse_attention_backward");
    expect_error([&] {
      indexer_kl(c.q, c.k, fwd.lse, c.qi, c.ki, topk, c.cu_seqlens_q, c.cu_seqlens_k, p, impl);
    }, words + "indexer_kl");
    expect_error([&] { paged_indexer(c.qi, paged.cache, paged.cu_seqlens_q, p, impl); },
                 words + "paged_indexer");
    expect_error([&] { paged_sparse_attention(c.q, paged.cache, topk, paged.cu_seqlens_q, p, impl); },
                 words + "paged_sparse_attention");
    expect_error([&] { paged_msa_attention(c.q, c.qi, paged.cache, paged.cu_seqlens_q, p, impl); },
                 words + "paged_msa_attention");
    // The dense ops take it.
    EXPECT_NO_THROW(dense_attention(c.q, c.k, c.v, c.cu_seqlens_q, c.cu_seqlens_k, p, impl));
    EXPECT_NO_THROW(paged_dense_attention(c.q, paged.cache, paged.cu_seqlens_q, p, impl));
  }
}

}  // namespace
}  // namespace msa::testing
