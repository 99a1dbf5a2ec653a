// Dense attention (topk null) with at most 16 queries per request: the launcher
// (src/cuda/attention/attention.cu) runs the decode kernels in dense mode (split-K over the
// whole causal context, then the deterministic merge) instead of the flash kernel. Checked
// against the CPU reference on fresh random bf16-exact inputs, varlen and paged (shuffled
// pages, unused cache slots set to NaN so that a read past a request's keys shows), O and LSE,
// and run-to-run bitwise identity. Skipped (not failed) where no CUDA device is present; ctest
// label "gpu".
#include <gtest/gtest.h>

#include <cmath>
#include <iostream>
#include <sstream>

#include "gpu_checks.h"

namespace msa::testing {
namespace {

// The context lengths of the brief's matrix around the 64-key unit and the block sizes.
const std::vector<int64_t> kEdgeContexts = {1, 63, 64, 65, 127, 128, 129, 2047, 2048, 2049};

// One request per context, each with min(q, context) new queries (a 1-token context has
// one query, so a batch mixes query counts within the max_q_len capacity).
std::vector<Seq> requests_with_queries(int64_t q, const std::vector<int64_t>& contexts) {
  std::vector<Seq> seqs;
  for (int64_t k_len : contexts) seqs.push_back({.q_len = std::min(q, k_len), .k_len = k_len});
  return seqs;
}

// Varlen and paged dense attention of `c` on the GPU against the CPU, and a second GPU run
// of each bitwise identical to the first.
void expect_dense_decode_matches_cpu(const VarlenCase& c, const std::string& what) {
  const MsaParams& p = c.params();
  const auto varlen = [&](Impl impl) {
    return dense_attention(c.q, c.k, c.v, c.cu_seqlens_q, c.cu_seqlens_k, p, impl);
  };
  const AttentionOutput first = varlen(Impl::cuda);
  expect_dense_close(first, varlen(Impl::cpu), c, what + " varlen");
  const AttentionOutput second = varlen(Impl::cuda);
  EXPECT_TRUE(bitwise_equal(first.o, second.o)) << what << " varlen: o differs between runs";
  EXPECT_TRUE(bitwise_equal(first.lse, second.lse)) << what << " varlen: lse differs between runs";

  PagedRequests paged = page_varlen_case(c);
  poison_unused_cache_slots(paged.cache);
  const auto run_paged = [&](Impl impl) {
    return paged_dense_attention(c.q, paged.cache, paged.cu_seqlens_q, p, impl);
  };
  const AttentionOutput paged_first = run_paged(Impl::cuda);
  expect_dense_close(paged_first, run_paged(Impl::cpu), c, what + " paged");
  const AttentionOutput paged_second = run_paged(Impl::cuda);
  EXPECT_TRUE(bitwise_equal(paged_first.o, paged_second.o)) << what << " paged: o differs between runs";
  EXPECT_TRUE(bitwise_equal(paged_first.lse, paged_second.lse)) << what << " paged: lse differs between runs";
}

// make_shape(Hkv, G, D, Di, B, topk, local, init): groups 1, 3, 4, 16; D 64 and 128; B 64
// and 128 (the index fields are unused by dense attention).
std::vector<CaseShape> dense_decode_shapes() {
  return {
      make_shape(4, 16, 128, 128, 128, 16, 1, 0),  // MiniMax-M3
      make_shape(2, 1, 64, 64, 64, 4, 1, 0),
      make_shape(2, 3, 128, 64, 64, 4, 1, 0),
      make_shape(1, 4, 64, 64, 128, 4, 1, 0),
      make_shape(2, 16, 64, 64, 64, 4, 1, 0),
      make_shape(3, 3, 64, 64, 128, 4, 1, 0),
      make_shape(1, 1, 128, 64, 128, 4, 1, 0),
  };
}

class GpuDenseDecode : public ::testing::TestWithParam<CaseShape> {};

// Q = 1, 2, 5, 16 per request over the edge contexts (one batch per Q).
TEST_P(GpuDenseDecode, EdgeContextsMatchCpu) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  for (int64_t q : {1, 2, 5, 16}) {
    SCOPED_TRACE("Q = " + std::to_string(q));
    const VarlenCase c = gpu_case(GetParam(), requests_with_queries(q, kEdgeContexts));
    expect_dense_decode_matches_cpu(c, "dense decode Q " + std::to_string(q));
  }
}

// 64 requests of different lengths (one of a single token; mostly Q = 1, some up to 16).
TEST_P(GpuDenseDecode, Batch64MixedLengthsMatchCpu) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  std::vector<Seq> seqs = mixed_decode_batch64(GetParam());
  ASSERT_EQ(seqs[0].k_len, 1);  // the single-token request
  const VarlenCase c = gpu_case(GetParam(), std::move(seqs));
  expect_dense_decode_matches_cpu(c, "dense decode batch 64");
}

INSTANTIATE_TEST_SUITE_P(Shapes, GpuDenseDecode, ::testing::ValuesIn(dense_decode_shapes()), shape_name);

// A 128K - 77 context: batch 1 (Q = 1: the most splits, ~32 units per CTA for M3) and a
// mixed batch with a 1-token request and a 16-query one, M3's shape and G = 1.
TEST(GpuDenseDecodeLong, LongContextMatchesCpu) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  const int64_t n = 131072 - 77;
  for (const CaseShape& shape :
       {make_shape(4, 16, 128, 128, 128, 16, 1, 0), make_shape(1, 1, 64, 64, 64, 4, 1, 0)}) {
    SCOPED_TRACE(shape.describe());
    expect_dense_decode_matches_cpu(gpu_case(shape, {{.q_len = 1, .k_len = n}}), "dense decode 128K Q 1");
    expect_dense_decode_matches_cpu(
        gpu_case(shape, {{.q_len = 5, .k_len = n}, {.q_len = 1, .k_len = 1}, {.q_len = 16, .k_len = 4097},
                         {.q_len = 1, .k_len = 70001}}),
        "dense decode 128K mixed");
  }
}

// A 1M-token context (16384 units) in a small shape (one KV head, G = 16, D = B = 64), batch
// 1: Q = 1 gives one (request, group, chunk) and 264 splits of ~63 units on an H200; Q = 16
// gives 4 query chunks and 66 splits of ~249 units each through the cp.async ring.
TEST(GpuDenseDecodeLong, MillionTokenContextMatchesCpu) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  const int64_t n = int64_t{1} << 20;
  for (int64_t q : {1, 16}) {
    SCOPED_TRACE("Q = " + std::to_string(q));
    const CaseShape shape = make_shape(1, 16, 64, 64, 64, 4, 1, 0);
    expect_dense_decode_matches_cpu(gpu_case(shape, {{.q_len = q, .k_len = n}}), "dense decode 1M");
  }
}

}  // namespace
}  // namespace msa::testing
