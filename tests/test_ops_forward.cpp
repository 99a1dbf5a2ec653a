// The optimised CPU forward ops (Impl::cpu) against the f64 reference on fresh random inputs:
// a matrix of shapes, packed batches around block and selection boundaries, paged caches with
// shuffled page tables, decode, and bf16/f16 inputs.
#include <gtest/gtest.h>

#include <iostream>

#include "op_cases.h"

namespace msa::testing {
namespace {

// The implementation under test (flip to Impl::reference to check the test logic itself).
constexpr Impl kOptimised = Impl::cpu;

// f32 storage and accumulation over at most ~1000 keys of D <= 128 stays near 1e-6 relative
// to the f64 reference (norm-wise); 1e-5 leaves a 10x margin without hiding real bugs,
// which show up as O(1e-2) or larger.
constexpr double kF32Tolerance = 1e-5;
// f32 and f64 block maxima differ by ~1e-7 relative, so only blocks whose maxima are that
// close to the k-th best may legitimately swap; 1e-4 is a generous bound for that.
constexpr double kTieTolerance = 1e-4;
// Elementwise bound for O (convex combinations of normal values, |O| < ~5) and LSE (a log:
// an absolute error is a relative error of the softmax normaliser); f32 gives ~1e-6.
constexpr double kF32AbsTolerance = 1e-4;
// Random normal data makes near-ties rare: at most 1% of rows may differ (expect 0).
constexpr double kMaxDifferingRowFraction = 0.01;

struct ForwardCase {
  CaseShape shape;
  std::vector<int64_t> key_lengths;  // empty: edge_lengths(B, k)
  bool with_query_free_sequence = false;  // one sequence with keys but no queries
};

void PrintTo(const ForwardCase& fc, std::ostream* out) { *out << fc.shape.describe(); }

// Sequences of lengths edge_lengths(B, k), optionally plus one with keys but no queries.
ForwardCase around_edges(const CaseShape& shape, bool with_query_free_sequence = false) {
  return {.shape = shape, .key_lengths = {}, .with_query_free_sequence = with_query_free_sequence};
}
ForwardCase with_lengths(const CaseShape& shape, std::vector<int64_t> key_lengths) {
  return {.shape = shape, .key_lengths = std::move(key_lengths), .with_query_free_sequence = false};
}

std::vector<ForwardCase> shape_matrix() {
  // make_shape(Hkv, G, D, Di, B, topk, local, init)
  return {
      around_edges(make_shape(1, 1, 16, 16, 4, 2, 1, 0)),
      around_edges(make_shape(2, 2, 64, 16, 4, 4, 1, 1), true),
      around_edges(make_shape(4, 4, 16, 64, 8, 4, 2, 0)),
      around_edges(make_shape(1, 8, 128, 128, 8, 8, 2, 1)),
      around_edges(make_shape(2, 16, 16, 16, 4, 8, 1, 0)),
      around_edges(make_shape(4, 16, 64, 64, 4, 4, 2, 1)),
      around_edges(make_shape(4, 8, 128, 16, 8, 4, 1, 1)),
      around_edges(make_shape(1, 16, 64, 128, 4, 2, 2, 0)),  // local = topk: nothing ranked
      around_edges(make_shape(2, 1, 128, 64, 8, 8, 1, 1)),
      around_edges(make_shape(4, 2, 16, 128, 4, 2, 1, 0), true),
      with_lengths(make_shape(1, 2, 16, 128, 64, 4, 1, 1), {1, 63, 64, 65, 255, 256, 257, 420}),
      with_lengths(make_shape(2, 4, 64, 64, 128, 2, 1, 0), {1, 127, 128, 129, 255, 256, 257, 300}),
  };
}

VarlenCase make_matrix_case(const ForwardCase& fc) {
  const MsaParams& p = fc.shape.params;
  std::vector<Seq> seqs =
      mixed_sequences(fc.key_lengths.empty() ? edge_lengths(p.block_size, p.topk) : fc.key_lengths);
  if (fc.with_query_free_sequence)
    seqs.insert(seqs.begin() + static_cast<int64_t>(seqs.size() / 2),
                Seq{.q_len = 0, .k_len = p.block_size + 1});
  return make_varlen_case(fc.shape, std::move(seqs));
}

void expect_indexer_matches(const IndexerOutput& got, const IndexerOutput& reference,
                            const VarlenCase& c, const DoubleInputs& in) {
  const double differing = expect_same_selection(got.topk, reference.topk, c, in, kTieTolerance);
  std::cout << "[ selection ] " << c.shape.describe() << ": " << differing * 100
            << "% of rows differ from the reference\n";
  EXPECT_LE(differing, kMaxDifferingRowFraction);
  if (!got.lse.defined()) return;
  const Tensor expected = expected_lse_for_rows(c, in, got.topk, reference.topk, reference.lse);
  expect_close(got.lse, expected, kF32Tolerance, kF32AbsTolerance, "indexer lse");
}

void expect_attention_matches(const AttentionOutput& got, const AttentionOutput& want,
                              const std::string& what) {
  expect_close(got.o, want.o, kF32Tolerance, kF32AbsTolerance, what + ": o");
  expect_close(got.lse, want.lse, kF32Tolerance, kF32AbsTolerance, what + ": lse");
}

class ForwardMatrix : public ::testing::TestWithParam<ForwardCase> {};

TEST_P(ForwardMatrix, IndexerMatchesReference) {
  MSA_RESEED_AND_TRACE();
  const VarlenCase c = make_matrix_case(GetParam());
  const DoubleInputs in(c);
  const IndexerOutput got =
      indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), kOptimised);
  const IndexerOutput reference =
      indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), Impl::reference);
  expect_indexer_matches(got, reference, c, in);
}

TEST_P(ForwardMatrix, SparseAttentionMatchesReference) {
  MSA_RESEED_AND_TRACE();
  const VarlenCase c = make_matrix_case(GetParam());
  const Tensor topk =
      indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), Impl::reference).topk;
  const auto run = [&](Impl impl) {
    return sparse_attention(c.q, c.k, c.v, topk, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), impl);
  };
  expect_attention_matches(run(kOptimised), run(Impl::reference), "sparse");
}

TEST_P(ForwardMatrix, DenseAttentionMatchesReference) {
  MSA_RESEED_AND_TRACE();
  const VarlenCase c = make_matrix_case(GetParam());
  const auto run = [&](Impl impl) {
    return dense_attention(c.q, c.k, c.v, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), impl);
  };
  expect_attention_matches(run(kOptimised), run(Impl::reference), "dense");
}

// The paged ops on a cache built from the case's keys match (a) the paged reference and
// (b) the varlen ops of the same implementation on the un-paged keys.
void expect_paged_matches(const VarlenCase& c) {
  const DoubleInputs in(c);
  const PagedRequests paged = page_varlen_case(c);
  const MsaParams& p = c.params();
  {
    SCOPED_TRACE("paged_indexer");
    const IndexerOutput got = paged_indexer(c.qi, paged.cache, paged.cu_seqlens_q, p, kOptimised,
                                            /*want_lse=*/true);
    expect_indexer_matches(
        got, paged_indexer(c.qi, paged.cache, paged.cu_seqlens_q, p, Impl::reference, true), c, in);
    expect_indexer_matches(got, indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, p, kOptimised),
                           c, in);
  }
  const Tensor topk =
      paged_indexer(c.qi, paged.cache, paged.cu_seqlens_q, p, Impl::reference).topk;
  const AttentionOutput sparse =
      paged_sparse_attention(c.q, paged.cache, topk, paged.cu_seqlens_q, p, kOptimised);
  expect_attention_matches(
      sparse, paged_sparse_attention(c.q, paged.cache, topk, paged.cu_seqlens_q, p, Impl::reference),
      "paged sparse vs reference");
  expect_attention_matches(
      sparse, sparse_attention(c.q, c.k, c.v, topk, c.cu_seqlens_q, c.cu_seqlens_k, p, kOptimised),
      "paged sparse vs varlen");
  const AttentionOutput dense =
      paged_dense_attention(c.q, paged.cache, paged.cu_seqlens_q, p, kOptimised);
  expect_attention_matches(
      dense, paged_dense_attention(c.q, paged.cache, paged.cu_seqlens_q, p, Impl::reference),
      "paged dense vs reference");
  expect_attention_matches(
      dense, dense_attention(c.q, c.k, c.v, c.cu_seqlens_q, c.cu_seqlens_k, p, kOptimised),
      "paged dense vs varlen");
}

// Matrix sequences as requests: a cached prefix (k_len - q_len tokens) plus a prefill chunk.
TEST_P(ForwardMatrix, PagedPrefillMatchesReferenceAndVarlen) {
  MSA_RESEED_AND_TRACE();
  expect_paged_matches(make_matrix_case(GetParam()));
}

std::string case_name(const ::testing::TestParamInfo<ForwardCase>& info) {
  return info.param.shape.describe();
}

INSTANTIATE_TEST_SUITE_P(Shapes, ForwardMatrix, ::testing::ValuesIn(shape_matrix()), case_name);

// Decode / multi-token prediction: Q = 1..16 new tokens per request over long contexts.
TEST(ForwardDecode, PagedDecodeMatchesReferenceAndVarlen) {
  MSA_RESEED_AND_TRACE();
  // Di = 12: the decode index scan's scalar tail (Di past a multiple of 8).
  for (const CaseShape& shape : {make_shape(4, 4, 64, 64, 8, 4, 1, 0),
                                 make_shape(2, 16, 128, 128, 64, 4, 1, 1),
                                 make_shape(1, 2, 16, 16, 4, 8, 2, 1),
                                 make_shape(2, 2, 16, 12, 4, 8, 2, 1)}) {
    SCOPED_TRACE(shape.describe());
    const int64_t B = shape.params.block_size, kb = B * shape.params.topk;
    const std::vector<Seq> requests{{.q_len = 1, .k_len = kb + 3 * B + 1},
                                    {.q_len = 16, .k_len = kb + 2 * B - 1},
                                    {.q_len = 2, .k_len = 2},
                                    {.q_len = 5, .k_len = B + 2},
                                    {.q_len = 16, .k_len = 16},
                                    {.q_len = 3, .k_len = kb + B / 2 + 7}};
    expect_paged_matches(make_varlen_case(shape, requests));
  }
}

// Decode-only batches: every tile holds at most 4 rows (one query of up to 4 index heads, or
// two of up to 2), so every row comes from the decode index scan (keys in the lanes,
// indexer_cpu.cpp); index dims 64, 12 (a scalar tail), 128 and 20. Random normal data makes
// near-ties rare, and here no row may differ beyond the near-tie rule: in mixed batches
// these rows are too few for the 1% bar to notice one.
TEST(ForwardDecode, DecodeOnlyBatchesSelectAsTheReference) {
  MSA_RESEED_AND_TRACE();
  for (const CaseShape& shape : {make_shape(4, 4, 64, 64, 8, 4, 1, 0), make_shape(2, 2, 16, 12, 4, 8, 2, 1),
                                 make_shape(1, 2, 16, 128, 16, 8, 1, 1), make_shape(4, 1, 16, 20, 8, 8, 1, 0)}) {
    SCOPED_TRACE(shape.describe());
    const int64_t B = shape.params.block_size, kb = B * shape.params.topk;
    const int64_t q_len = shape.kv_heads <= 2 ? 2 : 1;  // tiles of <= 4 rows
    std::vector<Seq> requests;
    for (int64_t i = 0; i < 12; ++i) requests.push_back({.q_len = q_len, .k_len = kb + i * B + i % 3});
    const VarlenCase c = make_varlen_case(shape, requests);
    const DoubleInputs in(c);
    const IndexerOutput got = indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), kOptimised);
    const IndexerOutput want = indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), Impl::reference);
    EXPECT_EQ(expect_same_selection(got.topk, want.topk, c, in, kTieTolerance), 0.0);
  }
}

// Split-K of the CPU attention (src/ops/cpu/attention_cpu.cpp; dense calls of < 256 items):
// an item whose blocks span several 32-block segments runs one unit per segment and merges
// them. B = 4 makes a segment 128 tokens, so contexts of 1-9 segments stay cheap for the f64
// reference: decode requests (Q = 1, 2, 16) and prefills whose 16-query tiles straddle segment
// edges, G 16 (two lane vectors), 4 and 1, varlen and paged; sparse (with emptied rows, never
// split) on the same long contexts; and the results are bitwise the same for any thread count.
TEST(ForwardSplitK, LongContextsMatchReferenceForAnyThreadCount) {
  MSA_RESEED_AND_TRACE();
  for (const CaseShape& shape : {make_shape(2, 16, 32, 16, 4, 8, 1, 0), make_shape(2, 4, 64, 16, 4, 16, 1, 1),
                                 make_shape(3, 1, 16, 16, 4, 4, 2, 0)}) {
    SCOPED_TRACE(shape.describe());
    const std::vector<Seq> requests{{.q_len = 1, .k_len = 1100},  {.q_len = 16, .k_len = 700},
                                    {.q_len = 2, .k_len = 129},   {.q_len = 1, .k_len = 128},
                                    {.q_len = 300, .k_len = 300}, {.q_len = 40, .k_len = 385},
                                    {.q_len = 1, .k_len = 3}};
    const VarlenCase c = make_varlen_case(shape, requests);
    Tensor topk = indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), Impl::reference).topk;
    empty_every_nth_row(topk, 7);
    const auto sparse = [&](Impl impl) {
      return sparse_attention(c.q, c.k, c.v, topk, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), impl);
    };
    const auto dense = [&](Impl impl) {
      return dense_attention(c.q, c.k, c.v, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), impl);
    };
    const AttentionOutput sparse_cpu = sparse(kOptimised), dense_cpu = dense(kOptimised);
    expect_attention_matches(sparse_cpu, sparse(Impl::reference), "sparse, split-K");
    expect_attention_matches(dense_cpu, dense(Impl::reference), "dense, split-K");
    expect_paged_matches(c);
    const int threads = num_threads();
    for (int run_threads : {1, 3}) {
      set_num_threads(run_threads);
      const AttentionOutput sparse_again = sparse(kOptimised), dense_again = dense(kOptimised);
      EXPECT_TRUE(bitwise_equal(sparse_again.o, sparse_cpu.o)) << run_threads << " threads";
      EXPECT_TRUE(bitwise_equal(sparse_again.lse, sparse_cpu.lse)) << run_threads << " threads";
      EXPECT_TRUE(bitwise_equal(dense_again.o, dense_cpu.o)) << run_threads << " threads";
      EXPECT_TRUE(bitwise_equal(dense_again.lse, dense_cpu.lse)) << run_threads << " threads";
    }
    set_num_threads(threads);
  }
}

TEST(ForwardEmptyRows, SparseAttentionWithEmptyRowsMatchesReference) {
  MSA_RESEED_AND_TRACE();
  const VarlenCase c = make_varlen_case(make_shape(2, 4, 64, 32, 4, 4, 1, 1),
                                        mixed_sequences(edge_lengths(4, 4)));
  Tensor topk =
      indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), Impl::reference).topk;
  empty_every_nth_row(topk, 5);
  const auto run = [&](Impl impl) {
    return sparse_attention(c.q, c.k, c.v, topk, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), impl);
  };
  expect_attention_matches(run(kOptimised), run(Impl::reference), "sparse with empty rows");
}

// The spec allows any softmax scale: negative ones (keys that score low win) must match the
// reference too, in the main softmax (sparse, dense) and the index LSE (the ranking itself
// never uses the scale).
TEST(ForwardNegativeScale, AllForwardOpsMatchReference) {
  MSA_RESEED_AND_TRACE();
  CaseShape shape = make_shape(2, 4, 64, 32, 8, 4, 1, 1);
  shape.params.scale = -0.3f;
  shape.params.index_scale = -0.2f;
  const VarlenCase c = make_varlen_case(shape, mixed_sequences(edge_lengths(8, 4)));
  const DoubleInputs in(c);
  const IndexerOutput reference =
      indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), Impl::reference);
  expect_indexer_matches(indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), kOptimised),
                         reference, c, in);
  const auto sparse = [&](Impl impl) {
    return sparse_attention(c.q, c.k, c.v, reference.topk, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), impl);
  };
  const auto dense = [&](Impl impl) {
    return dense_attention(c.q, c.k, c.v, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), impl);
  };
  expect_attention_matches(sparse(kOptimised), sparse(Impl::reference), "sparse, scale -0.3");
  expect_attention_matches(dense(kOptimised), dense(Impl::reference), "dense, scale -0.3");
}

// bf16 / f16 inputs are converted exactly to f32: the results equal those on the converted
// values bit for bit.
TEST(ForwardLowPrecision, InputsConvertExactly) {
  MSA_RESEED_AND_TRACE();
  const VarlenCase c = make_varlen_case(make_shape(2, 2, 64, 64, 8, 4, 1, 1),
                                        mixed_sequences(edge_lengths(8, 4)));
  const PagedRequests paged = page_varlen_case(c);
  const MsaParams& p = c.params();
  for (DType low : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(std::string(dtype_name(low)));
    const auto narrow = [low](const Tensor& t) { return t.to(low); };
    const auto widened = [low](const Tensor& t) { return t.to(low).to(DType::f32); };

    const IndexerOutput index_low =
        indexer(narrow(c.qi), narrow(c.ki), c.cu_seqlens_q, c.cu_seqlens_k, p, kOptimised);
    const IndexerOutput index_f32 =
        indexer(widened(c.qi), widened(c.ki), c.cu_seqlens_q, c.cu_seqlens_k, p, kOptimised);
    EXPECT_TRUE(bitwise_equal(index_low.topk, index_f32.topk));
    EXPECT_TRUE(bitwise_equal(index_low.lse, index_f32.lse));

    const Tensor& topk = index_f32.topk;
    const AttentionOutput sparse_low = sparse_attention(
        narrow(c.q), narrow(c.k), narrow(c.v), topk, c.cu_seqlens_q, c.cu_seqlens_k, p, kOptimised);
    const AttentionOutput sparse_f32 =
        sparse_attention(widened(c.q), widened(c.k), widened(c.v), topk, c.cu_seqlens_q,
                         c.cu_seqlens_k, p, kOptimised);
    EXPECT_TRUE(bitwise_equal(sparse_low.o, sparse_f32.o));
    EXPECT_TRUE(bitwise_equal(sparse_low.lse, sparse_f32.lse));

    const AttentionOutput dense_low = dense_attention(narrow(c.q), narrow(c.k), narrow(c.v),
                                                      c.cu_seqlens_q, c.cu_seqlens_k, p, kOptimised);
    const AttentionOutput dense_f32 = dense_attention(
        widened(c.q), widened(c.k), widened(c.v), c.cu_seqlens_q, c.cu_seqlens_k, p, kOptimised);
    EXPECT_TRUE(bitwise_equal(dense_low.o, dense_f32.o));
    EXPECT_TRUE(bitwise_equal(dense_low.lse, dense_f32.lse));

    PagedKvCache cache_low = paged.cache, cache_f32 = paged.cache;
    cache_low.k_cache = narrow(paged.cache.k_cache);
    cache_low.v_cache = narrow(paged.cache.v_cache);
    cache_low.index_key_cache = narrow(paged.cache.index_key_cache);
    cache_f32.k_cache = widened(paged.cache.k_cache);
    cache_f32.v_cache = widened(paged.cache.v_cache);
    cache_f32.index_key_cache = widened(paged.cache.index_key_cache);
    const IndexerOutput paged_index_low =
        paged_indexer(narrow(c.qi), cache_low, paged.cu_seqlens_q, p, kOptimised, true);
    const IndexerOutput paged_index_f32 =
        paged_indexer(widened(c.qi), cache_f32, paged.cu_seqlens_q, p, kOptimised, true);
    EXPECT_TRUE(bitwise_equal(paged_index_low.topk, paged_index_f32.topk));
    EXPECT_TRUE(bitwise_equal(paged_index_low.lse, paged_index_f32.lse));
    const AttentionOutput paged_low =
        paged_sparse_attention(narrow(c.q), cache_low, topk, paged.cu_seqlens_q, p, kOptimised);
    const AttentionOutput paged_f32 =
        paged_sparse_attention(widened(c.q), cache_f32, topk, paged.cu_seqlens_q, p, kOptimised);
    EXPECT_TRUE(bitwise_equal(paged_low.o, paged_f32.o));
    EXPECT_TRUE(bitwise_equal(paged_low.lse, paged_f32.lse));
  }
}

}  // namespace
}  // namespace msa::testing

#include <cmath>
#include <functional>

namespace msa::testing {
namespace {

// ---- bf16 / f16 keys and values read in place ----
// Impl::cpu reads bf16/f16 K, V and index keys block by block (widened exactly into a
// per-thread f32 buffer) instead of converting the whole tensor. With f32 queries, as in the
// runtime, every forward op must give the same bits as on those keys stored as f32.

using Convert = std::function<Tensor(const Tensor&)>;

struct NamedOutput {
  std::string name;
  Tensor value;
};

// Every forward op, varlen and paged, with the key side (k/ki and their caches) converted
// by `keys` and v by `values`; queries stay f32. `topk` selects for the sparse ops.
std::vector<NamedOutput> forward_outputs(const VarlenCase& c, const PagedRequests& paged,
                                         const Tensor& topk, const Convert& keys,
                                         const Convert& values) {
  const MsaParams& p = c.params();
  PagedKvCache cache = paged.cache;
  cache.k_cache = keys(cache.k_cache);
  cache.v_cache = values(cache.v_cache);
  cache.index_key_cache = keys(cache.index_key_cache);
  const Tensor k = keys(c.k), v = values(c.v), ki = keys(c.ki);
  const IndexerOutput index = indexer(c.qi, ki, c.cu_seqlens_q, c.cu_seqlens_k, p, kOptimised);
  const IndexerOutput paged_index =
      paged_indexer(c.qi, cache, paged.cu_seqlens_q, p, kOptimised, /*want_lse=*/true);
  const AttentionOutput sparse =
      sparse_attention(c.q, k, v, topk, c.cu_seqlens_q, c.cu_seqlens_k, p, kOptimised);
  const AttentionOutput dense =
      dense_attention(c.q, k, v, c.cu_seqlens_q, c.cu_seqlens_k, p, kOptimised);
  const AttentionOutput paged_sparse =
      paged_sparse_attention(c.q, cache, topk, paged.cu_seqlens_q, p, kOptimised);
  const AttentionOutput paged_dense =
      paged_dense_attention(c.q, cache, paged.cu_seqlens_q, p, kOptimised);
  return {{"indexer topk", index.topk},           {"indexer lse", index.lse},
          {"paged indexer topk", paged_index.topk}, {"paged indexer lse", paged_index.lse},
          {"sparse o", sparse.o},                 {"sparse lse", sparse.lse},
          {"dense o", dense.o},                   {"dense lse", dense.lse},
          {"paged sparse o", paged_sparse.o},     {"paged sparse lse", paged_sparse.lse},
          {"paged dense o", paged_dense.o},       {"paged dense lse", paged_dense.lse}};
}

void expect_bitwise_equal(const std::vector<NamedOutput>& got,
                          const std::vector<NamedOutput>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(got[i].value, want[i].value)) << got[i].name;
    // NaN garbage in unused cache slots must never reach an output.
    for (int64_t e = 0; e < got[i].value.numel(); ++e)
      if (std::isnan(got[i].value.get(e))) {
        ADD_FAILURE() << got[i].name << ": NaN at flat index " << e;
        break;
      }
  }
}

// bf16 and f16 K/V/index keys, varlen and paged (shuffled pages, NaN in unused slots), and
// a bf16 K with an f32 V (different row strides for keys and values).
void expect_low_precision_keys_exact(const VarlenCase& c) {
  PagedRequests paged = page_varlen_case(c);
  poison_unused_cache_slots(paged.cache);
  const Tensor topk =
      indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), Impl::reference).topk;
  const Convert same = [](const Tensor& t) { return t; };
  for (DType low : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(std::string(dtype_name(low)));
    const Convert narrow = [low](const Tensor& t) { return t.to(low); };
    const Convert widened = [low](const Tensor& t) { return t.to(low).to(DType::f32); };
    expect_bitwise_equal(forward_outputs(c, paged, topk, narrow, narrow),
                         forward_outputs(c, paged, topk, widened, widened));
    SCOPED_TRACE("low-precision keys, f32 values");
    expect_bitwise_equal(forward_outputs(c, paged, topk, narrow, same),
                         forward_outputs(c, paged, topk, widened, same));
  }
}

class LowPrecisionKeys : public ::testing::TestWithParam<CaseShape> {};

TEST_P(LowPrecisionKeys, PrefillEqualsWidenedKeysBitwise) {
  MSA_RESEED_AND_TRACE();
  const MsaParams& p = GetParam().params;
  expect_low_precision_keys_exact(
      make_varlen_case(GetParam(), mixed_sequences(edge_lengths(p.block_size, p.topk))));
}

TEST_P(LowPrecisionKeys, DecodeEqualsWidenedKeysBitwise) {
  MSA_RESEED_AND_TRACE();
  const int64_t B = GetParam().params.block_size, kb = B * GetParam().params.topk;
  expect_low_precision_keys_exact(make_varlen_case(
      GetParam(), {{.q_len = 1, .k_len = kb + 3 * B + 1},
                   {.q_len = 16, .k_len = kb + 2 * B - 1},
                   {.q_len = 1, .k_len = 1},
                   {.q_len = 3, .k_len = kb + B / 2 + 7}}));
}

// make_shape(Hkv, G, D, Di, B, topk, local, init): one 8-lane and two 16-lane attention
// shapes, B below the indexer's 16-key step, D not a multiple of 8.
INSTANTIATE_TEST_SUITE_P(Shapes, LowPrecisionKeys,
                         ::testing::Values(make_shape(2, 2, 64, 64, 8, 4, 1, 1),
                                           make_shape(1, 16, 128, 128, 16, 4, 1, 1),
                                           make_shape(4, 12, 20, 24, 4, 4, 2, 0),
                                           make_shape(2, 4, 16, 16, 32, 2, 1, 0)),
                         shape_name);

}  // namespace
}  // namespace msa::testing
