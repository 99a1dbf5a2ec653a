// The CUDA backward of the main branch (sparse_attention_backward and
// dense_attention_backward, Impl::cuda) against the optimised CPU op (itself checked against
// the f64 reference and finite differences in test_ops_backward.cpp) on the same bf16
// inputs: q, k, v, dO and the forward's O rounded to bf16, the forward's LSE in f32, the
// selection rows from the CPU indexer. Shape matrix: group sizes 1..16 (incl. 3), Hkv 1..4,
// D 64 / 128, B 64 / 128, k 2..16, lengths 1, B-1, B, B+1, kB-1, kB, kB+1 and beyond, several
// sequences per batch, chunked prefill (q_len < k_len); both modes (deterministic: partials /
// query-major dQ; fast: atomic dQ); query chunking of the sparse path; empty selection rows;
// a long context; bitwise-identical repeated runs. Where both dK / dV tile engines run (D = B =
// 128) every CUDA check runs on each (wgmma and mma.sync). Outputs are poisoned (NaN) before the
// kernels run (cuda_glue), so an unwritten element fails. Skipped without a CUDA device;
// ctest label "gpu".
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <iostream>
#include <sstream>

#include "gpu_checks.h"

namespace msa::testing {
namespace {

// The GPU rounds P and dS to bf16 for the tensor-core products (2^-9 relative per term) and
// sums in f32 in another order than the CPU: ~1e-3 norm-wise. The bars are the issue's:
// 1e-2 norm-wise relative error per tensor and cosine similarity > 0.999. A dK or dV not
// summed over the group's heads, a missing block or a wrong mask is off by O(1).
constexpr double kGradRelative = 1e-2;
constexpr double kMinCosine = 0.999;

// Norm-wise relative error, cosine similarity, the first NaN and the largest difference of
// two f32 tensors in one pass over the raw data (Tensor::get per element is too slow for the
// tens of millions of elements of the long cases).
struct Comparison {
  double relative = 0, cosine = 1;
  int64_t first_nan = -1, worst = -1;
};

Comparison compare(const Tensor& got, const Tensor& want) {
  Comparison out;
  const float* g = got.data<float>();
  const float* w = want.data<float>();
  double diff = 0, dot = 0, ng = 0, nw = 0, worst = -1;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double x = g[i], y = w[i];
    if (std::isnan(x) || std::isnan(y)) {
      if (out.first_nan < 0) out.first_nan = i;
      continue;
    }
    diff += (x - y) * (x - y);
    dot += x * y;
    ng += x * x;
    nw += y * y;
    if (std::fabs(x - y) > worst) {
      worst = std::fabs(x - y);
      out.worst = i;
    }
  }
  out.relative = out.first_nan >= 0 ? std::nan("") : nw == 0 ? std::sqrt(diff) : std::sqrt(diff / nw);
  out.cosine = out.first_nan >= 0 ? std::nan("") : (ng == 0 && nw == 0) ? 1.0 : dot / std::sqrt(ng * nw);
  return out;
}

// "[row, head, d]" of a flat index into a [rows, heads, dim] tensor.
std::string where(const Tensor& t, int64_t flat) {
  const int64_t dim = t.size(2), heads = t.size(1);
  std::ostringstream out;
  out << "[" << flat / (heads * dim) << ", " << (flat / dim) % heads << ", " << flat % dim << "]";
  return out.str();
}

std::string diagnose(const Tensor& got, const Tensor& want, const Comparison& c) {
  const float* g = got.data<float>();
  const float* w = want.data<float>();
  std::ostringstream out;
  if (c.first_nan >= 0)
    out << "first NaN at " << where(got, c.first_nan) << " (got " << g[c.first_nan] << ", want "
        << w[c.first_nan] << "; NaN = an element no kernel wrote, or a NaN result); ";
  if (c.worst >= 0)
    out << "largest difference at " << where(got, c.worst) << ": got " << g[c.worst] << ", want " << w[c.worst];
  return out.str();
}

void expect_grads_close(const AttentionGrads& got, const AttentionGrads& want, const std::string& what) {
  SCOPED_TRACE(what);
  const std::pair<const char*, std::pair<const Tensor*, const Tensor*>> tensors[] = {
      {"dq", {&got.dq, &want.dq}}, {"dk", {&got.dk, &want.dk}}, {"dv", {&got.dv, &want.dv}}};
  std::cout << "[ backward ] " << what << ":";
  for (const auto& [name, pair] : tensors) {
    const Tensor& g = *pair.first;
    const Tensor& w = *pair.second;
    ASSERT_EQ(g.shape(), w.shape()) << name;
    ASSERT_EQ(g.dtype(), DType::f32) << name;
    ASSERT_EQ(w.dtype(), DType::f32) << name;
    const Comparison c = compare(g, w);
    std::cout << " " << name << " rel " << c.relative << " cos " << c.cosine << ";";
    EXPECT_LT(c.relative, kGradRelative) << name << ": " << diagnose(g, w, c);
    EXPECT_GT(c.cosine, kMinCosine) << name << ": " << diagnose(g, w, c);
  }
  std::cout << "\n";
}

bool grads_bitwise_equal(const AttentionGrads& a, const AttentionGrads& b) {
  return bitwise_equal(a.dq, b.dq) && bitwise_equal(a.dk, b.dk) && bitwise_equal(a.dv, b.dv);
}

// One backward problem: inputs, selection rows (sparse) or none (dense), the forward's O
// (rounded to bf16, as training keeps it) and LSE, a random dO.
struct BackwardCase {
  VarlenCase c;
  Tensor topk;  // undefined: dense
  Tensor o, lse, grad_o;

  AttentionGrads run(Impl impl, bool deterministic = true, int64_t max_chunk_queries = 0,
                     cuda::Engine engine = cuda::Engine::automatic) const {
    MsaParams p = c.params();
    p.deterministic = deterministic;
    p.cuda.max_chunk_queries = max_chunk_queries;
    p.cuda.backward = engine;
    if (topk.defined())
      return sparse_attention_backward(c.q, c.k, c.v, topk, o, lse, grad_o, c.cu_seqlens_q, c.cu_seqlens_k, p,
                                       impl);
    return dense_attention_backward(c.q, c.k, c.v, o, lse, grad_o, c.cu_seqlens_q, c.cu_seqlens_k, p, impl);
  }
};

BackwardCase make_backward_case(const VarlenCase& c, const Tensor* topk) {
  BackwardCase b{c, topk ? *topk : Tensor(), Tensor(), Tensor(), Tensor()};
  const AttentionOutput forward =
      topk ? sparse_attention(c.q, c.k, c.v, *topk, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), Impl::cpu)
           : dense_attention(c.q, c.k, c.v, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), Impl::cpu);
  b.o = bf16_rounded(forward.o);
  b.lse = forward.lse;
  b.grad_o = bf16_rounded(random_normal(c.q.shape()));
  return b;
}

// The dK / dV tile engines a shape runs on: both where the wgmma kernel applies (D = B = 128).
std::vector<cuda::Engine> backward_engines(const CaseShape& shape) {
  if (shape.head_dim == 128 && shape.params.block_size == 128) return {cuda::Engine::wgmma, cuda::Engine::mma_sync};
  return {cuda::Engine::automatic};
}

std::string engine_label(cuda::Engine engine) {
  return engine == cuda::Engine::automatic ? "" : std::string(" (") + cuda::engine_name(engine) + ")";
}

Tensor cpu_selection(const VarlenCase& c) {
  return indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), Impl::cpu).topk;
}

// Sparse and dense, both modes, against the CPU.
void check_both_ops(const VarlenCase& c, const std::string& what) {
  const Tensor topk = cpu_selection(c);
  const BackwardCase sparse = make_backward_case(c, &topk);
  const AttentionGrads sparse_cpu = sparse.run(Impl::cpu);
  const BackwardCase dense = make_backward_case(c, nullptr);
  const AttentionGrads dense_cpu = dense.run(Impl::cpu);
  for (const cuda::Engine engine : backward_engines(c.shape)) {
    const std::string label = what + engine_label(engine);
    expect_grads_close(sparse.run(Impl::cuda, true, 0, engine), sparse_cpu, label + " sparse deterministic");
    expect_grads_close(sparse.run(Impl::cuda, false, 0, engine), sparse_cpu, label + " sparse fast");
    expect_grads_close(dense.run(Impl::cuda, true, 0, engine), dense_cpu, label + " dense deterministic");
    expect_grads_close(dense.run(Impl::cuda, false, 0, engine), dense_cpu, label + " dense fast");
  }
}

std::vector<CaseShape> backward_shapes() {
  // make_shape(Hkv, G, D, Di, B, topk, local, init); Hq = Hkv * G kept moderate so that the
  // CPU op stays quick on the edge lengths.
  return {
      make_shape(1, 16, 128, 64, 128, 16, 1, 0),  // M3's group, D, B and k
      make_shape(2, 8, 128, 64, 128, 4, 1, 1),
      make_shape(4, 4, 64, 64, 128, 2, 1, 0),
      make_shape(3, 2, 64, 64, 64, 8, 2, 1),
      make_shape(2, 1, 128, 64, 64, 4, 1, 0),
      make_shape(1, 3, 64, 64, 128, 3, 1, 0),  // G = 3: m-tiles hold partial queries
      make_shape(4, 16, 64, 64, 64, 16, 1, 1),
      make_shape(1, 3, 128, 64, 128, 3, 1, 0),   // the wgmma kernel with partial queries per tile
      make_shape(2, 1, 128, 64, 128, 4, 1, 1),   // ... and one head per group
  };
}

class GpuBackward : public ::testing::TestWithParam<CaseShape> {};

TEST_P(GpuBackward, MatchesCpu) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  const MsaParams& p = GetParam().params;
  check_both_ops(gpu_case(GetParam(), mixed_sequences(edge_lengths(p.block_size, p.topk))), "edge lengths");
}

INSTANTIATE_TEST_SUITE_P(Shapes, GpuBackward, ::testing::ValuesIn(backward_shapes()), shape_name);

// Deterministic mode: 10 runs bitwise identical, sparse and dense. Fast mode: dK and dV are
// single-writer there too, so they repeat bitwise; dQ only within tolerance.
TEST(GpuBackwardDeterminism, TenRunsAreBitwiseIdentical) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  // Small enough for 48 round trips through the glue, large enough for several row tiles
  // per block, blocks with many readers and partial blocks.
  for (const CaseShape& shape : {make_shape(2, 16, 128, 64, 128, 4, 1, 0), make_shape(2, 4, 64, 64, 64, 4, 1, 1)}) {
    SCOPED_TRACE(shape.describe());
    const int64_t B = shape.params.block_size;
    const VarlenCase c = gpu_case(shape, {{.q_len = 300, .k_len = 6 * B + 17},
                                          {.q_len = 2 * B + 1, .k_len = 2 * B + 1},
                                          {.q_len = 1, .k_len = 1},
                                          {.q_len = B - 1, .k_len = 4 * B}});
    const Tensor topk = cpu_selection(c);
    for (const Tensor* rows : {&topk, static_cast<const Tensor*>(nullptr)})
      for (const cuda::Engine engine : backward_engines(shape)) {
        SCOPED_TRACE(std::string(rows ? "sparse" : "dense") + engine_label(engine));
        const BackwardCase b = make_backward_case(c, rows);
        const AttentionGrads first = b.run(Impl::cuda, true, 0, engine);
        for (int run = 1; run < 10; ++run)
          EXPECT_TRUE(grads_bitwise_equal(first, b.run(Impl::cuda, true, 0, engine))) << "run " << run;
        const AttentionGrads fast = b.run(Impl::cuda, false, 0, engine), fast_again = b.run(Impl::cuda, false, 0, engine);
        EXPECT_TRUE(bitwise_equal(fast.dk, fast_again.dk));
        EXPECT_TRUE(bitwise_equal(fast.dv, fast_again.dv));
        EXPECT_TRUE(bitwise_equal(fast.dk, first.dk));  // the same kernel computes dK / dV
        EXPECT_TRUE(bitwise_equal(fast.dv, first.dv));
      }
  }
}

// Rows of all -1 read nothing: zero dQ rows (partials merge over no slot; atomics add
// nothing to the zeroed dq), and keys nobody reads get zero dK / dV.
TEST(GpuBackwardEmptyRows, EmptyRowsGiveZero) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  const VarlenCase c = gpu_case(make_shape(2, 4, 64, 64, 64, 4, 1, 1), mixed_sequences(edge_lengths(64, 4)));
  Tensor topk = cpu_selection(c);
  empty_every_nth_row(topk, 5);
  const BackwardCase b = make_backward_case(c, &topk);
  const AttentionGrads want = b.run(Impl::cpu);
  expect_grads_close(b.run(Impl::cuda, true), want, "empty rows deterministic");
  expect_grads_close(b.run(Impl::cuda, false), want, "empty rows fast");
}

// The sparse path in several query chunks (forced small through
// MsaParams::cuda.max_chunk_queries): dK / dV accumulate over the chunks, dQ partials merge per
// chunk; the result equals the CPU's and, in deterministic mode, repeats bitwise.
TEST(GpuBackwardChunks, QueryChunksMatchCpu) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  const CaseShape shape = make_shape(2, 8, 128, 64, 128, 4, 1, 0);
  const VarlenCase c = gpu_case(shape, mixed_sequences(edge_lengths(128, 4)));
  const Tensor topk = cpu_selection(c);
  const BackwardCase b = make_backward_case(c, &topk);
  const AttentionGrads want = b.run(Impl::cpu);
  for (const cuda::Engine engine : backward_engines(shape))
    for (const int64_t chunk : {1, 97, 1000}) {
      const std::string label = "chunks of " + std::to_string(chunk) + engine_label(engine);
      SCOPED_TRACE(label);
      const AttentionGrads det = b.run(Impl::cuda, true, chunk, engine);
      expect_grads_close(det, want, label + " deterministic");
      EXPECT_TRUE(grads_bitwise_equal(det, b.run(Impl::cuda, true, chunk, engine)));
      expect_grads_close(b.run(Impl::cuda, false, chunk, engine), want, label + " fast");
    }
}

// Blocks read by many more rows than the others: the sparse backward cuts a block's entries
// into pieces of at most max(ceil(1024 / G), ceil(entries / 1024)) entries and sums the
// pieces' dK / dV in a fixed order (attention_backward.cu, item_entries). G = 16 and 700
// queries over 6 blocks with k = 4: every block is read by hundreds of queries, so most
// segments run as several pieces (64 entries each), in one chunk and in chunks of 97 queries.
TEST(GpuBackwardSplitItems, ManyReadersPerBlockMatchCpu) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  const CaseShape shape = make_shape(2, 16, 128, 64, 128, 4, 1, 0);
  const VarlenCase c = gpu_case(shape, {{.q_len = 700, .k_len = 700}, {.q_len = 129, .k_len = 129}});
  const Tensor topk = cpu_selection(c);
  const BackwardCase b = make_backward_case(c, &topk);
  const AttentionGrads want = b.run(Impl::cpu);
  for (const cuda::Engine engine : backward_engines(shape))
    for (const int64_t chunk : {0, 97}) {
      const std::string label = "chunks of " + std::to_string(chunk) + engine_label(engine);
      SCOPED_TRACE(label);
      const AttentionGrads det = b.run(Impl::cuda, true, chunk, engine);
      expect_grads_close(det, want, label + " deterministic");
      EXPECT_TRUE(grads_bitwise_equal(det, b.run(Impl::cuda, true, chunk, engine)));
      const AttentionGrads fast = b.run(Impl::cuda, false, chunk, engine);
      expect_grads_close(fast, want, label + " fast");
      EXPECT_TRUE(bitwise_equal(fast.dk, det.dk));  // the same pieces in the same order
      EXPECT_TRUE(bitwise_equal(fast.dv, det.dv));
    }
}

// Long context in M3's shape (Hq 64, Hkv 4, D 128, B 128, k 16): blocks with hundreds of
// readers, 32K keys; chunked prefill of the last 2048 queries of a 32K
// sequence next to a whole 1000-token sequence. Sparse only (the CPU's dense backward at 32K
// takes minutes); the dense path runs at 32K against the CPU with one KV head and few queries.
TEST(GpuBackwardLong, LongContextMatchesCpu) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  {
    const VarlenCase c = gpu_case(make_shape(4, 16, 128, 128, 128, 16, 1, 0),
                                  {{.q_len = 2048, .k_len = 32768}, {.q_len = 1000, .k_len = 1000}});
    const Tensor topk = cpu_selection(c);
    const BackwardCase b = make_backward_case(c, &topk);
    const AttentionGrads want = b.run(Impl::cpu);
    for (const cuda::Engine engine : backward_engines(c.shape)) {
      expect_grads_close(b.run(Impl::cuda, true, 0, engine), want, "long sparse deterministic" + engine_label(engine));
      expect_grads_close(b.run(Impl::cuda, false, 0, engine), want, "long sparse fast" + engine_label(engine));
    }
  }
  {
    const VarlenCase c = gpu_case(make_shape(1, 16, 128, 64, 128, 16, 1, 0), {{.q_len = 64, .k_len = 32768},
                                                                             {.q_len = 300, .k_len = 700}});
    const BackwardCase b = make_backward_case(c, nullptr);
    const AttentionGrads want = b.run(Impl::cpu);
    for (const cuda::Engine engine : backward_engines(c.shape)) {
      expect_grads_close(b.run(Impl::cuda, true, 0, engine), want, "long dense deterministic" + engine_label(engine));
      expect_grads_close(b.run(Impl::cuda, false, 0, engine), want, "long dense fast" + engine_label(engine));
    }
  }
}

// Pinning the wgmma engine on a shape it does not run is an error that names the engine and
// what it needs; the outputs are not produced.
TEST(GpuBackwardEngine, WgmmaElsewhereIsAnError) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  const VarlenCase c = gpu_case(make_shape(1, 4, 64, 64, 64, 2, 1, 0), {{.q_len = 70, .k_len = 70}});
  const Tensor topk = cpu_selection(c);
  const BackwardCase b = make_backward_case(c, &topk);
  expect_error([&] { b.run(Impl::cuda, true, 0, cuda::Engine::wgmma); }, "head_dim = block_size = 128");
}

}  // namespace
}  // namespace msa::testing
