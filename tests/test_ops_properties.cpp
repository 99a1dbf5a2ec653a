// Properties the spec promises, checked on every implementation (reference and cpu):
// MSA = dense attention below k*B keys, the selection rule (§3) recomputed in the test,
// empty rows, the selected index LSE, and decode = prefill.
#include <gtest/gtest.h>

#include "op_cases.h"

namespace msa::testing {
namespace {

class OpProperties : public ::testing::TestWithParam<Impl> {
 protected:
  Impl impl() const { return GetParam(); }
  bool is_reference() const { return impl() == Impl::reference; }
  // Outputs are f32 for f32 inputs: the reference (f64 inside) is only rounded once, ~1e-7;
  // the cpu accumulates in f32 over a few hundred keys, ~1e-6.
  double tolerance() const { return is_reference() ? 1e-6 : 1e-5; }
  // Elementwise bound on O (|O| < ~5) and LSE (|LSE| < ~50): f32 rounding of the
  // reference's f64 result is ~1e-6 there, f32 accumulation ~1e-5 at worst.
  double abs_tolerance() const { return is_reference() ? 1e-5 : 1e-4; }
  void expect_close_enough(const Tensor& got, const Tensor& want, const std::string& what) const {
    expect_close(got, want, tolerance(), abs_tolerance(), what);
  }
  // The reference ranks f64 maxima: ties must break exactly as the spec says. f32 block
  // maxima may reorder blocks whose maxima agree to ~1e-7 relative.
  double tie_tolerance() const { return is_reference() ? 0.0 : 1e-4; }

  IndexerOutput run_indexer(const VarlenCase& c, const MsaParams& params) const {
    return indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, params, impl());
  }
  AttentionOutput run_sparse(const VarlenCase& c, const Tensor& topk) const {
    return sparse_attention(c.q, c.k, c.v, topk, c.cu_seqlens_q, c.cu_seqlens_k, c.params(),
                            impl());
  }
  AttentionOutput run_dense(const VarlenCase& c) const {
    return dense_attention(c.q, c.k, c.v, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), impl());
  }
};

// Shapes for the property tests: make_shape(Hkv, G, D, Di, B, topk, local, init).
std::vector<CaseShape> property_shapes() {
  return {make_shape(2, 2, 16, 16, 4, 4, 1, 0), make_shape(1, 4, 64, 64, 8, 8, 2, 1),
          make_shape(4, 1, 32, 128, 4, 2, 1, 1), make_shape(2, 8, 16, 32, 64, 4, 1, 1)};
}

TEST_P(OpProperties, MsaEqualsDenseWhenEveryContextFitsInKBlocks) {
  MSA_RESEED_AND_TRACE();
  for (const CaseShape& shape : property_shapes()) {
    SCOPED_TRACE(shape.describe());
    const int64_t B = shape.params.block_size, kb = B * shape.params.topk;
    const VarlenCase c = make_varlen_case(shape, mixed_sequences({1, B - 1, B, B + 1, kb - 1, kb}));
    const Tensor topk = run_indexer(c, c.params()).topk;
    const AttentionOutput sparse = run_sparse(c, topk), dense = run_dense(c);
    expect_close_enough(sparse.o, dense.o, "o");
    expect_close_enough(sparse.lse, dense.lse, "lse");
  }
}

// Every row of every head obeys §3, with block maxima recomputed here in double.
void expect_rows_follow_the_rule(const VarlenCase& c, const Tensor& topk, double tie_tolerance) {
  const DoubleInputs in(c);
  int64_t failures = 0;
  for (int64_t h = 0; h < c.shape.kv_heads; ++h)
    for (int64_t row = 0; row < c.total_q() && failures < 5; ++row) {
      const std::vector<int32_t> entries = selection_row(topk, h, row);
      const int64_t own = c.own_block(row);
      const ::testing::AssertionResult structure = row_structure_ok(entries, own, c.params());
      const ::testing::AssertionResult best =
          structure ? ranked_entries_are_best(entries, own, c.params(),
                                              block_maxima(c, in, row, h), tie_tolerance)
                    : structure;
      if (!best) {
        ADD_FAILURE() << "head " << h << " row " << row << " pos " << c.row_pos[row] << ": "
                      << best.message();
        ++failures;
      }
    }
}

TEST_P(OpProperties, SelectionRowsFollowTheRule) {
  MSA_RESEED_AND_TRACE();
  for (const CaseShape& shape : property_shapes()) {
    SCOPED_TRACE(shape.describe());
    const int64_t B = shape.params.block_size, k = shape.params.topk;
    std::vector<int64_t> lengths = edge_lengths(B, k);
    lengths.push_back((k + 12) * B + 3);  // long: many candidates per row
    const VarlenCase c = make_varlen_case(shape, mixed_sequences(lengths));
    expect_rows_follow_the_rule(c, run_indexer(c, c.params()).topk, tie_tolerance());
  }
}

// Small integer scores are exact in f32 and f64 and tie often: both implementations must
// break ties to the lower block id, exactly.
TEST_P(OpProperties, EqualBlockMaximaGoToTheLowerBlockId) {
  MSA_RESEED_AND_TRACE();
  const CaseShape shape = make_shape(2, 1, 16, 16, 4, 4, 1, 1);
  VarlenCase c = make_varlen_case(shape, mixed_sequences({9, 30, 61, 77}));
  for (Tensor* t : {&c.qi, &c.ki})
    for (int64_t i = 0; i < t->numel(); ++i) t->set(i, static_cast<double>(uniform_int(-1, 1)));
  expect_rows_follow_the_rule(c, run_indexer(c, c.params()).topk, 0.0);
}

TEST_P(OpProperties, EmptyRowGivesZeroOutputAndNegativeInfiniteLse) {
  MSA_RESEED_AND_TRACE();
  const VarlenCase c =
      make_varlen_case(make_shape(2, 4, 16, 16, 4, 4, 1, 0), mixed_sequences(edge_lengths(4, 4)));
  Tensor topk = indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, c.params(),
                        Impl::reference).topk;
  const int64_t groups = topk.size(0), rows = topk.size(1), slots = topk.size(2);
  const auto emptied = [](int64_t g, int64_t row) { return (row + g) % 3 == 0; };
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t row = 0; row < rows; ++row)
      if (emptied(g, row))
        for (int64_t s = 0; s < slots; ++s) topk.set((g * rows + row) * slots + s, -1);

  const auto expect_empty_rows = [&](const AttentionOutput& out) {
    const int64_t heads = c.shape.q_heads(), D = c.shape.head_dim;
    for (int64_t row = 0; row < rows; ++row)
      for (int64_t head = 0; head < heads; ++head) {
        const double lse = out.lse.get(row * heads + head);
        if (!emptied(head / c.shape.group, row)) {
          EXPECT_TRUE(std::isfinite(lse)) << "row " << row << " head " << head;
          continue;
        }
        EXPECT_EQ(lse, kNegInf) << "row " << row << " head " << head;
        for (int64_t d = 0; d < D; ++d)
          ASSERT_EQ(out.o.get((row * heads + head) * D + d), 0.0)
              << "row " << row << " head " << head << " d " << d;
      }
  };
  expect_empty_rows(run_sparse(c, topk));
  const PagedRequests paged = page_varlen_case(c);
  expect_empty_rows(
      paged_sparse_attention(c.q, paged.cache, topk, paged.cu_seqlens_q, c.params(), impl()));
}

TEST_P(OpProperties, IndexerLseIsTheLogSumExpOfTheSelectedScores) {
  MSA_RESEED_AND_TRACE();
  CaseShape shape = make_shape(2, 1, 16, 32, 4, 4, 1, 1);
  const VarlenCase c = make_varlen_case(shape, mixed_sequences(edge_lengths(4, 4)));
  const DoubleInputs in(c);
  for (double temperature : {1.0, 0.5})
    for (double index_scale : {0.0, 0.37}) {
      SCOPED_TRACE("temperature " + std::to_string(temperature) + ", index_scale " +
                   std::to_string(index_scale));
      MsaParams params = c.params();
      params.temperature = temperature;
      params.index_scale = index_scale;
      const IndexerOutput out = run_indexer(c, params);
      shape.params = params;
      const Tensor expected =
          expected_index_lse(c, in, out.topk, default_index_scale(shape), temperature);
      expect_close_enough(out.lse, expected, "indexer lse");
    }
}

// A request processed as one prefill and as a cached prefix followed by decode steps of Q new
// tokens gives the same selection rows and outputs at every query position.
TEST_P(OpProperties, DecodeStepsAgreeWithPrefill) {
  MSA_RESEED_AND_TRACE();
  const CaseShape shape = make_shape(2, 4, 32, 32, 8, 4, 1, 1);
  for (int64_t Q : {1, 3, 16}) {
    SCOPED_TRACE("Q = " + std::to_string(Q));
    const int64_t steps = Q == 16 ? 2 : 4;
    const std::vector<int64_t> prefixes{1, 7, 40, 61};
    std::vector<Seq> whole;  // q_len == k_len: every position is a query
    for (int64_t prefix : prefixes) whole.push_back({prefix + steps * Q, prefix + steps * Q});
    const VarlenCase c = make_varlen_case(shape, whole);
    const DoubleInputs in(c);
    const IndexerOutput prefill = run_indexer(c, c.params());
    const AttentionOutput prefill_sparse = run_sparse(c, prefill.topk);
    const AttentionOutput prefill_dense = run_dense(c);

    PagedRequests paged = page_varlen_case(c);  // holds every token; seq_lens hide the future
    for (int64_t step = 0; step < steps; ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      std::vector<int32_t> seq_lens;
      std::vector<int64_t> rows;  // the step's queries as rows of the prefill
      for (size_t b = 0; b < prefixes.size(); ++b) {
        const int64_t first = prefixes[b] + step * Q;
        for (int64_t i = 0; i < Q; ++i) rows.push_back(c.k_start[b] + first + i);
        seq_lens.push_back(static_cast<int32_t>(first + Q));
      }
      paged.cache.seq_lens = Tensor::from_vector(seq_lens, {static_cast<int64_t>(seq_lens.size())});
      const Tensor cu_q = cu_seqlens(std::vector<int64_t>(prefixes.size(), Q));
      const Tensor q = gather_rows(c.q, rows), qi = gather_rows(c.qi, rows);

      const IndexerOutput decode = paged_indexer(qi, paged.cache, cu_q, c.params(), impl(), true);
      const Tensor prefill_rows = gather_selection_rows(prefill.topk, rows);
      expect_same_selection(decode.topk, prefill_rows, c, in, tie_tolerance(), rows);
      const Tensor expected_lse = expected_lse_for_rows(
          c, in, decode.topk, prefill_rows, gather_head_major(prefill.lse, rows), rows);
      expect_close_enough(decode.lse, expected_lse, "indexer lse");

      const AttentionOutput sparse =
          paged_sparse_attention(q, paged.cache, prefill_rows, cu_q, c.params(), impl());
      expect_close_enough(sparse.o, gather_rows(prefill_sparse.o, rows), "sparse o");
      expect_close_enough(sparse.lse, gather_rows(prefill_sparse.lse, rows), "sparse lse");
      const AttentionOutput dense = paged_dense_attention(q, paged.cache, cu_q, c.params(), impl());
      expect_close_enough(dense.o, gather_rows(prefill_dense.o, rows), "dense o");
      expect_close_enough(dense.lse, gather_rows(prefill_dense.lse, rows), "dense lse");
    }
  }
}

// paged_msa_attention: dense exactly where every context is <= k*B (the boundary included),
// indexer + sparse attention as soon as one context is longer.
TEST_P(OpProperties, MsaAttentionRunsDenseUpToKBAndSparseBeyond) {
  MSA_RESEED_AND_TRACE();
  const CaseShape shape = make_shape(2, 4, 16, 16, 4, 3, 1, 0);
  const int64_t kb = shape.params.block_size * shape.params.topk;
  for (const int64_t longest : {kb - 1, kb, kb + 1, 4 * kb}) {
    SCOPED_TRACE("longest context " + std::to_string(longest));
    const VarlenCase c = make_varlen_case(shape, {{.q_len = 3, .k_len = 5},
                                                  {.q_len = 4, .k_len = longest},
                                                  {.q_len = 1, .k_len = kb / 2}});
    const PagedRequests paged = page_varlen_case(c);
    const MsaParams& p = c.params();
    const MsaOutput msa = paged_msa_attention(c.q, c.qi, paged.cache, paged.cu_seqlens_q, p, impl());
    EXPECT_EQ(msa_equals_dense(paged.cache, p), longest <= kb);
    if (longest <= kb) {
      EXPECT_FALSE(msa.topk.defined());
      const AttentionOutput dense = paged_dense_attention(c.q, paged.cache, paged.cu_seqlens_q, p, impl());
      EXPECT_TRUE(bitwise_equal(msa.attention.o, dense.o));
      EXPECT_TRUE(bitwise_equal(msa.attention.lse, dense.lse));
      // ... and that is what the indexer + sparse path computes there.
      const Tensor topk = paged_indexer(c.qi, paged.cache, paged.cu_seqlens_q, p, impl()).topk;
      const AttentionOutput sparse =
          paged_sparse_attention(c.q, paged.cache, topk, paged.cu_seqlens_q, p, impl());
      expect_close_enough(msa.attention.o, sparse.o, "dense path vs sparse o");
      expect_close_enough(msa.attention.lse, sparse.lse, "dense path vs sparse lse");
    } else {
      const Tensor topk = paged_indexer(c.qi, paged.cache, paged.cu_seqlens_q, p, impl()).topk;
      ASSERT_TRUE(msa.topk.defined());
      EXPECT_TRUE(bitwise_equal(msa.topk, topk));
      const AttentionOutput sparse =
          paged_sparse_attention(c.q, paged.cache, topk, paged.cu_seqlens_q, p, impl());
      EXPECT_TRUE(bitwise_equal(msa.attention.o, sparse.o));
      EXPECT_TRUE(bitwise_equal(msa.attention.lse, sparse.lse));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Impls, OpProperties, ::testing::Values(Impl::reference, Impl::cpu),
                         impl_test_name);

}  // namespace
}  // namespace msa::testing
