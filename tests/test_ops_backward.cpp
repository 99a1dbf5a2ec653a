// Backward of the main branch and the indexer KL: the optimised CPU code against the f64
// reference, the reference against finite differences, determinism and empty rows.
// Suites are named after the ops (snake case) so that `ctest -R backward` selects them all.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "msa/ops.h"
#include "test_util.h"

namespace msa {
namespace {

using testing::cu_seqlens;
using testing::random_normal;
using testing::relative_error;

// f32 accumulation over at most a few thousand terms (k*B keys x G heads per dQ/dK row,
// D per dot product) keeps the relative error around 1e-7..1e-6; 1e-5 leaves room while
// still catching any wrong term (a missing or extra key changes the result by ~1e-2).
constexpr double kTolerance = 1e-5;

struct Case {
  int64_t group_size, kv_heads, head_dim, index_dim;
  MsaParams params;
  std::vector<std::pair<int64_t, int64_t>> seqs;  // (q_len, k_len), queries a suffix of keys

  std::string name() const {
    std::string out = "G=" + std::to_string(group_size) + " Hkv=" + std::to_string(kv_heads) +
                      " D=" + std::to_string(head_dim) + " B=" + std::to_string(params.block_size) +
                      " k=" + std::to_string(params.topk) +
                      " local=" + std::to_string(params.local_blocks) +
                      " init=" + std::to_string(params.init_blocks) + " seqs=";
    for (auto [q_len, k_len] : seqs)
      out += std::to_string(q_len) + "/" + std::to_string(k_len) + " ";
    return out;
  }
};

MsaParams params_of(int block_size, int topk, int local, int init) {
  MsaParams params;
  params.block_size = block_size;
  params.topk = topk;
  params.local_blocks = local;
  params.init_blocks = init;
  return params;
}

// Sequences of length n (q_len == k_len) for every n in `lengths`.
std::vector<std::pair<int64_t, int64_t>> full(std::vector<int64_t> lengths) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t n : lengths) out.push_back({n, n});
  return out;
}

std::vector<std::pair<int64_t, int64_t>> plus(std::vector<std::pair<int64_t, int64_t>> a,
                                              std::vector<std::pair<int64_t, int64_t>> b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// Lengths 1, B-1, B, B+1, kB-1, kB, kB+1 and a chunked-prefill sequence, packed together.
std::vector<std::pair<int64_t, int64_t>> edge_lengths(int64_t B, int64_t k,
                                                      std::pair<int64_t, int64_t> chunk) {
  return plus(full({1, B - 1, B, B + 1, k * B - 1, k * B, k * B + 1}), {chunk});
}

std::vector<Case> shape_matrix() {
  return {
      {1, 1, 16, 16, params_of(4, 2, 1, 0), edge_lengths(4, 2, {20, 37})},
      {2, 2, 16, 32, params_of(8, 3, 1, 1), edge_lengths(8, 3, {10, 50})},
      {4, 4, 64, 16, params_of(4, 4, 2, 1), edge_lengths(4, 4, {9, 40})},
      {8, 1, 128, 32, params_of(8, 2, 1, 0), plus(full({1, 7, 15, 16, 17}), {{5, 60}})},
      {16, 2, 16, 16, params_of(4, 3, 2, 0), edge_lengths(4, 3, {6, 30})},
      {16, 4, 64, 16, params_of(8, 2, 1, 1), plus(full({9, 17}), {{3, 40}})},
      {1, 4, 64, 16, params_of(8, 4, 1, 1), plus(full({2, 31, 33}), {{12, 70}, {1, 45}})},
      {2, 2, 16, 16, params_of(64, 2, 1, 0), plus(full({63, 64, 65, 129}), {{70, 200}})},
  };
}

struct Inputs {
  Tensor q, k, v, qi, ki, grad_o, cu_q, cu_k, topk;
  AttentionOutput forward;  // reference O and LSE over `topk`
};

Inputs make_inputs(const Case& c, DType dtype = DType::f32) {
  std::vector<int64_t> q_lens, k_lens;
  int64_t total_q = 0, total_k = 0;
  for (auto [q_len, k_len] : c.seqs) {
    q_lens.push_back(q_len);
    k_lens.push_back(k_len);
    total_q += q_len;
    total_k += k_len;
  }
  const int64_t q_heads = c.group_size * c.kv_heads;
  Inputs in;
  in.q = random_normal({total_q, q_heads, c.head_dim}, 1.0, dtype);
  in.k = random_normal({total_k, c.kv_heads, c.head_dim}, 1.0, dtype);
  in.v = random_normal({total_k, c.kv_heads, c.head_dim}, 1.0, dtype);
  in.qi = random_normal({total_q, c.kv_heads, c.index_dim}, 1.0, dtype);
  in.ki = random_normal({total_k, c.index_dim}, 1.0, dtype);
  in.grad_o = random_normal({total_q, q_heads, c.head_dim}, 1.0, dtype);
  in.cu_q = cu_seqlens(q_lens);
  in.cu_k = cu_seqlens(k_lens);
  in.topk = indexer(in.qi, in.ki, in.cu_q, in.cu_k, c.params, Impl::reference).topk;
  in.forward =
      sparse_attention(in.q, in.k, in.v, in.topk, in.cu_q, in.cu_k, c.params, Impl::reference);
  return in;
}

AttentionGrads sparse_backward(const Inputs& in, const MsaParams& params, Impl impl) {
  return sparse_attention_backward(in.q, in.k, in.v, in.topk, in.forward.o, in.forward.lse,
                                   in.grad_o, in.cu_q, in.cu_k, params, impl);
}

IndexerKlOutput kl(const Inputs& in, const MsaParams& params, Impl impl) {
  return indexer_kl(in.q, in.k, in.forward.lse, in.qi, in.ki, in.topk, in.cu_q, in.cu_k, params,
                    impl);
}

// Worst relative error seen per quantity, printed at the end of a test for the record.
struct Worst {
  std::vector<std::pair<std::string, double>> entries;
  void check(const std::string& what, const Tensor& got, const Tensor& want) {
    const double error = relative_error(got, want);
    EXPECT_LT(error, kTolerance) << what;
    for (auto& [name, worst] : entries)
      if (name == what) {
        worst = std::max(worst, error);
        return;
      }
    entries.push_back({what, error});
  }
  void print() const {
    for (const auto& [name, worst] : entries)
      std::printf("  worst relative error %-8s %.3g\n", name.c_str(), worst);
  }
};

TEST(sparse_attention_backward, CpuMatchesReference) {
  Worst worst;
  for (const Case& c : shape_matrix()) {
    SCOPED_TRACE(c.name());
    const Inputs in = make_inputs(c);
    const AttentionGrads want = sparse_backward(in, c.params, Impl::reference);
    const AttentionGrads got = sparse_backward(in, c.params, Impl::cpu);
    worst.check("dq", got.dq, want.dq);
    worst.check("dk", got.dk, want.dk);
    worst.check("dv", got.dv, want.dv);
  }
  worst.print();
}

TEST(dense_attention_backward, CpuMatchesReference) {
  Worst worst;
  for (const Case& c : shape_matrix()) {
    SCOPED_TRACE(c.name());
    const Inputs in = make_inputs(c);
    const AttentionOutput fwd =
        dense_attention(in.q, in.k, in.v, in.cu_q, in.cu_k, c.params, Impl::reference);
    auto run = [&](Impl impl) {
      return dense_attention_backward(in.q, in.k, in.v, fwd.o, fwd.lse, in.grad_o, in.cu_q, in.cu_k,
                                      c.params, impl);
    };
    const AttentionGrads want = run(Impl::reference), got = run(Impl::cpu);
    worst.check("dq", got.dq, want.dq);
    worst.check("dk", got.dk, want.dk);
    worst.check("dv", got.dv, want.dv);
  }
  worst.print();
}

TEST(indexer_kl_backward, CpuMatchesReference) {
  Worst worst;
  for (Case c : shape_matrix()) {
    c.params.temperature = 1.5;
    c.params.kl_coefficient = 0.7;
    SCOPED_TRACE(c.name());
    const Inputs in = make_inputs(c);
    const IndexerKlOutput want = kl(in, c.params, Impl::reference);
    const IndexerKlOutput got = kl(in, c.params, Impl::cpu);
    worst.check("loss", got.loss, want.loss);
    worst.check("dqi", got.dqi, want.dqi);
    worst.check("dki", got.dki, want.dki);
  }
  worst.print();
}

// ---- finite differences of the f64 reference ----

// A small case with sparse selection (some blocks skipped) and a chunked sequence.
Case small_case() { return {2, 2, 8, 8, params_of(4, 2, 1, 0), {{5, 11}, {9, 9}, {3, 14}}}; }

// Central difference of `loss` along element `index` of `x` (f64), step 1e-6.
template <class Loss>
double central_difference(Tensor& x, int64_t index, Loss loss) {
  constexpr double step = 1e-6;
  const double saved = x.get(index);
  x.set(index, saved + step);
  const double up = loss();
  x.set(index, saved - step);
  const double down = loss();
  x.set(index, saved);
  return (up - down) / (2 * step);
}

// Checks a few random entries of `grad` against central differences of `loss` along `x`.
template <class Loss>
void check_gradient(const char* name, Tensor& x, const Tensor& grad, Loss loss) {
  std::uniform_int_distribution<int64_t> pick(0, x.numel() - 1);
  for (int trial = 0; trial < 8; ++trial) {
    const int64_t index = pick(testing::rng());
    const double numeric = central_difference(x, index, loss);
    const double analytic = grad.get(index);
    // Truncation error ~step^2, rounding ~1e-16 |L| / step: far below both bounds when |L|
    // is small near the base point (loss_against; the KL loss is O(1)).
    EXPECT_NEAR(analytic, numeric, std::max(1e-8, 1e-6 * std::fabs(numeric)))
        << name << "[" << index << "]";
  }
}

// L = sum(dO * (O - O0)) for a fixed O0 (the unperturbed output): the gradient of sum(dO * O),
// but near 0 at the base point, and outputs a perturbation leaves unchanged cancel exactly.
// So f64 rounding in L scales with the few changed terms, not with |sum(dO * O)| (~30 here,
// ~3e-9 after dividing by the step: up to 0.96 of the 1e-8 bound in 1,920 checks; now 0.07).
double loss_against(const Tensor& grad_o, const Tensor& o, const Tensor& base_o) {
  double sum = 0;
  for (int64_t i = 0; i < grad_o.numel(); ++i) sum += grad_o.get(i) * (o.get(i) - base_o.get(i));
  return sum;
}

TEST(sparse_attention_backward, ReferenceMatchesFiniteDifferences) {
  const Case c = small_case();
  Inputs in = make_inputs(c, DType::f64);
  ASSERT_EQ(in.forward.o.dtype(), DType::f64);
  // L = sum(dO * (O - O0)): its gradient is the backward given dO. The selection stays fixed.
  auto forward = [&] {
    return sparse_attention(in.q, in.k, in.v, in.topk, in.cu_q, in.cu_k, c.params, Impl::reference);
  };
  const Tensor base_o = forward().o;
  auto loss = [&] { return loss_against(in.grad_o, forward().o, base_o); };
  const AttentionGrads grads = sparse_backward(in, c.params, Impl::reference);
  check_gradient("dq", in.q, grads.dq, loss);
  check_gradient("dk", in.k, grads.dk, loss);
  check_gradient("dv", in.v, grads.dv, loss);
}

TEST(dense_attention_backward, ReferenceMatchesFiniteDifferences) {
  const Case c = small_case();
  Inputs in = make_inputs(c, DType::f64);
  auto forward = [&] {
    return dense_attention(in.q, in.k, in.v, in.cu_q, in.cu_k, c.params, Impl::reference);
  };
  const AttentionOutput fwd = forward();
  auto loss = [&] { return loss_against(in.grad_o, forward().o, fwd.o); };
  const AttentionGrads grads = dense_attention_backward(
      in.q, in.k, in.v, fwd.o, fwd.lse, in.grad_o, in.cu_q, in.cu_k, c.params, Impl::reference);
  check_gradient("dq", in.q, grads.dq, loss);
  check_gradient("dk", in.k, grads.dk, loss);
  check_gradient("dv", in.v, grads.dv, loss);
}

TEST(indexer_kl_backward, ReferenceMatchesFiniteDifferences) {
  Case c = small_case();
  c.params.temperature = 0.8;
  Inputs in = make_inputs(c, DType::f64);
  // The teacher must sum to 1: the main LSE comes from the same selection (make_inputs).
  auto loss = [&] { return kl(in, c.params, Impl::reference).loss.get(0); };
  const IndexerKlOutput out = kl(in, c.params, Impl::reference);
  EXPECT_GT(out.loss.get(0), 0.0);
  check_gradient("dqi", in.qi, out.dqi, loss);
  check_gradient("dki", in.ki, out.dki, loss);
}

// ---- determinism ----

// Bitwise identical across runs and thread counts (each gradient element has one writer
// that sums in a fixed order, see attention_backward_cpu.cpp).
TEST(sparse_attention_backward, CpuIsDeterministic) {
  const Case c = shape_matrix()[4];
  const Inputs in = make_inputs(c);
  const int threads = num_threads();
  const AttentionGrads first = sparse_backward(in, c.params, Impl::cpu);
  for (int run_threads : {threads, 1, 3}) {
    set_num_threads(run_threads);
    const AttentionGrads again = sparse_backward(in, c.params, Impl::cpu);
    EXPECT_TRUE(testing::bitwise_equal(first.dq, again.dq)) << run_threads << " threads";
    EXPECT_TRUE(testing::bitwise_equal(first.dk, again.dk)) << run_threads << " threads";
    EXPECT_TRUE(testing::bitwise_equal(first.dv, again.dv)) << run_threads << " threads";
  }
  set_num_threads(threads);
}

TEST(indexer_kl_backward, CpuIsDeterministic) {
  const Case c = shape_matrix()[4];
  const Inputs in = make_inputs(c);
  const int threads = num_threads();
  const IndexerKlOutput first = kl(in, c.params, Impl::cpu);
  for (int run_threads : {threads, 1, 3}) {
    set_num_threads(run_threads);
    const IndexerKlOutput again = kl(in, c.params, Impl::cpu);
    EXPECT_TRUE(testing::bitwise_equal(first.loss, again.loss)) << run_threads << " threads";
    EXPECT_TRUE(testing::bitwise_equal(first.dqi, again.dqi)) << run_threads << " threads";
    EXPECT_TRUE(testing::bitwise_equal(first.dki, again.dki)) << run_threads << " threads";
  }
  set_num_threads(threads);
}

// ---- empty selection rows ----

// Empties the selection row of (group, row) and recomputes the reference forward.
void empty_row(Inputs& in, const Case& c, int64_t group, int64_t row) {
  const int64_t total_q = in.topk.size(1), slots = in.topk.size(2);
  int32_t* ids = in.topk.data<int32_t>() + (group * total_q + row) * slots;
  std::fill(ids, ids + slots, -1);
  in.forward =
      sparse_attention(in.q, in.k, in.v, in.topk, in.cu_q, in.cu_k, c.params, Impl::reference);
}

TEST(sparse_attention_backward, EmptyRowGivesZeroAndContributesNothing) {
  const Case c = shape_matrix()[1];
  Inputs in = make_inputs(c);
  const int64_t group = 1, row = in.q.size(0) - 2, G = c.group_size, D = c.head_dim;
  empty_row(in, c, group, row);
  const AttentionGrads want = sparse_backward(in, c.params, Impl::reference);
  const AttentionGrads got = sparse_backward(in, c.params, Impl::cpu);
  EXPECT_LT(relative_error(got.dq, want.dq), kTolerance);
  EXPECT_LT(relative_error(got.dk, want.dk), kTolerance);
  EXPECT_LT(relative_error(got.dv, want.dv), kTolerance);
  const int64_t first = (row * in.q.size(1) + group * G) * D;
  for (int64_t i = first; i < first + G * D; ++i) ASSERT_EQ(got.dq.get(i), 0.0) << i;
  // That query's dO no longer matters to dK/dV.
  for (int64_t i = first; i < first + G * D; ++i) in.grad_o.set(i, 100.0 + i);
  const AttentionGrads changed = sparse_backward(in, c.params, Impl::cpu);
  EXPECT_TRUE(testing::bitwise_equal(got.dk, changed.dk));
  EXPECT_TRUE(testing::bitwise_equal(got.dv, changed.dv));
}

TEST(indexer_kl_backward, EmptyRowGivesZeroAndContributesNothing) {
  const Case c = shape_matrix()[1];
  Inputs in = make_inputs(c);
  const int64_t group = 0, row = in.q.size(0) - 3, Di = c.index_dim;
  empty_row(in, c, group, row);
  const IndexerKlOutput want = kl(in, c.params, Impl::reference);
  const IndexerKlOutput got = kl(in, c.params, Impl::cpu);
  EXPECT_LT(relative_error(got.loss, want.loss), kTolerance);
  EXPECT_LT(relative_error(got.dqi, want.dqi), kTolerance);
  EXPECT_LT(relative_error(got.dki, want.dki), kTolerance);
  const int64_t first = (row * c.kv_heads + group) * Di;
  for (int64_t i = first; i < first + Di; ++i) ASSERT_EQ(got.dqi.get(i), 0.0) << i;
  // That query's index query no longer matters to the loss or dki.
  for (int64_t i = first; i < first + Di; ++i) in.qi.set(i, 3.0 + i);
  const IndexerKlOutput changed = kl(in, c.params, Impl::cpu);
  EXPECT_TRUE(testing::bitwise_equal(got.loss, changed.loss));
  EXPECT_TRUE(testing::bitwise_equal(got.dki, changed.dki));
}

}  // namespace
}  // namespace msa
