// Bidirectional dense attention on the GPU (MsaParams::causal = false, the vision tower's
// attention within a segment): the CUDA dense kernels against the CPU on random bf16-exact
// inputs over a shape matrix (head dims 64, the ViT's 80 and 128, group sizes 1..16, both
// dense engines at 80 and 128), whole sequences (the ViT's segments) of edge lengths around the
// 64-row tiles and the key tiles, query suffixes of longer key sequences including
// decode-sized ones (q_len <= 16, which must not take the causal-only decode path), varlen
// and paged with the unused cache slots NaN (a read past a sequence's keys shows), outputs
// poisoned by the CUDA glue. Also: a second run is bitwise identical, the result differs from
// the causal one where keys follow the query (the test can fail), and the calls that stay
// refused (backward, a selection) name the field. Skipped (not failed) where no CUDA device
// is present; ctest label "gpu".
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "gpu_checks.h"

namespace msa::testing {
namespace {

MsaParams bidirectional(MsaParams params, cuda::Engine engine = cuda::Engine::automatic) {
  params.causal = false;
  params.cuda.dense = engine;
  return params;
}

struct BidirectionalShape {
  CaseShape shape;
  cuda::Engine engine = cuda::Engine::automatic;
  int64_t max_length = 4096;  // whole sequences up to this (the CPU side's time: M3's 64 heads)
};

void PrintTo(const BidirectionalShape& s, std::ostream* out) { *out << s.shape.describe(); }

// make_shape(Hkv, G, D, Di, B, topk, local, init); the index fields are unused by dense ops.
std::vector<BidirectionalShape> shapes() {
  return {
      // The ViT: 16 heads of 80, MHA. Both engines pinned (automatic picks by the call's size).
      {make_shape(16, 1, 80, 64, 128, 4, 1, 0), cuda::Engine::wgmma},
      {make_shape(16, 1, 80, 64, 128, 4, 1, 0), cuda::Engine::mma_sync},
      {make_shape(2, 4, 80, 64, 64, 4, 1, 0), cuda::Engine::wgmma},
      {make_shape(2, 4, 80, 64, 64, 4, 1, 0), cuda::Engine::mma_sync},
      {make_shape(1, 16, 80, 64, 128, 4, 1, 0)},
      {make_shape(3, 3, 80, 64, 64, 4, 1, 0), cuda::Engine::wgmma},
      {make_shape(2, 4, 64, 64, 64, 4, 1, 0)},
      {make_shape(4, 16, 128, 128, 128, 16, 1, 0), cuda::Engine::automatic, 1024},  // M3's text shape: wgmma
      {make_shape(4, 16, 128, 128, 128, 16, 1, 0), cuda::Engine::mma_sync, 1024},
      {make_shape(1, 1, 128, 64, 64, 4, 1, 0)},
      {make_shape(1, 1, 128, 64, 64, 4, 1, 0), cuda::Engine::mma_sync},
  };
}

std::string bidirectional_shape_name(const ::testing::TestParamInfo<BidirectionalShape>& info) {
  const cuda::Engine e = info.param.engine;
  return info.param.shape.describe() + (e == cuda::Engine::mma_sync ? "_mma_sync" : e == cuda::Engine::wgmma ? "_wgmma" : "");
}

// Whole sequences around the 64-row (mma.sync) and 128-row (wgmma) tiles and the 64 / 128-key
// tiles, a ViT segment of a 448 x 448 frame (1024 patches) and of 4 frames (4096).
const std::vector<int64_t> kWholeLengths = {1, 2, 4, 15, 16, 17, 63, 64, 65, 127, 128, 129, 1024, 2047, 2049, 4096};

// Query suffixes of longer key sequences: every query sees all keys, the earlier ones too;
// q_len 1..16 would be decode-sized for causal attention.
const std::vector<Seq> kSuffixes = {{.q_len = 1, .k_len = 777},   {.q_len = 16, .k_len = 129},
                                    {.q_len = 5, .k_len = 5},     {.q_len = 100, .k_len = 1000},
                                    {.q_len = 65, .k_len = 2049}, {.q_len = 127, .k_len = 128},
                                    {.q_len = 3, .k_len = 64}};

class GpuBidirectional : public ::testing::TestWithParam<BidirectionalShape> {};

// `c` on the GPU, varlen and paged, against the CPU; a second run bitwise equal.
void expect_bidirectional_matches(const VarlenCase& c, cuda::Engine engine, const std::string& what) {
  const MsaParams p = bidirectional(c.params(), engine);
  PagedRequests paged = page_varlen_case(c);
  poison_unused_cache_slots(paged.cache);
  const auto varlen = [&](Impl impl) {
    return dense_attention(c.q, c.k, c.v, c.cu_seqlens_q, c.cu_seqlens_k, p, impl);
  };
  const auto run_paged = [&](Impl impl) {
    return paged_dense_attention(c.q, paged.cache, paged.cu_seqlens_q, p, impl);
  };
  const AttentionOutput cpu = varlen(Impl::cpu);
  const AttentionOutput first = varlen(Impl::cuda), second = varlen(Impl::cuda);
  expect_dense_close(first, cpu, c, what + " varlen");
  EXPECT_TRUE(bitwise_equal(first.o, second.o)) << what << ": o differs between runs";
  EXPECT_TRUE(bitwise_equal(first.lse, second.lse)) << what << ": lse differs between runs";
  expect_dense_close(run_paged(Impl::cuda), cpu, c, what + " paged");
}

TEST_P(GpuBidirectional, WholeSequencesMatchCpu) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  std::vector<int64_t> lengths = kWholeLengths;
  const int64_t max_length = GetParam().max_length;
  std::erase_if(lengths, [max_length](int64_t n) { return n > max_length; });
  std::vector<Seq> seqs = whole_prefills(lengths);
  std::shuffle(seqs.begin(), seqs.end(), rng());
  expect_bidirectional_matches(gpu_case(GetParam().shape, std::move(seqs)), GetParam().engine, "whole");
}

TEST_P(GpuBidirectional, QuerySuffixesMatchCpu) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  std::vector<Seq> seqs = kSuffixes;
  std::shuffle(seqs.begin(), seqs.end(), rng());
  expect_bidirectional_matches(gpu_case(GetParam().shape, std::move(seqs)), GetParam().engine, "suffixes");
}

// Decode-sized batches alone (every q_len <= 16): the causal path would be the decode
// kernels; the bidirectional one must still see every key.
TEST_P(GpuBidirectional, DecodeSizedQueriesMatchCpu) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  expect_bidirectional_matches(
      gpu_case(GetParam().shape, {{.q_len = 1, .k_len = 300}, {.q_len = 16, .k_len = 16}, {.q_len = 4, .k_len = 4}}),
      GetParam().engine, "decode-sized");
}

// The mode does something: rows with keys after them differ from the causal result by far
// more than the bf16 bar, the last row of each sequence agrees.
TEST_P(GpuBidirectional, DiffersFromCausalWhereKeysFollowTheQuery) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  const VarlenCase c = gpu_case(GetParam().shape, whole_prefills({200, 65}));
  MsaParams causal = c.params();
  causal.cuda.dense = GetParam().engine;
  const AttentionOutput a = dense_attention(c.q, c.k, c.v, c.cu_seqlens_q, c.cu_seqlens_k, causal, Impl::cuda);
  const AttentionOutput b = dense_attention(c.q, c.k, c.v, c.cu_seqlens_q, c.cu_seqlens_k,
                                            bidirectional(c.params(), GetParam().engine), Impl::cuda);
  const int64_t per_row = c.q.numel() / c.total_q();
  for (const int64_t row : {int64_t{0}, int64_t{199}, int64_t{200}, int64_t{264}}) {
    double diff = 0;
    for (int64_t e = 0; e < per_row; ++e)
      diff = std::max(diff, std::fabs(a.o.get(row * per_row + e) - b.o.get(row * per_row + e)));
    const bool last = row == 199 || row == 264;
    if (last)
      EXPECT_LT(diff, 1e-6) << "row " << row << " (last of its sequence)";
    else
      EXPECT_GT(diff, 0.1) << "row " << row;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, GpuBidirectional, ::testing::ValuesIn(shapes()), bidirectional_shape_name);

// The backward stays causal-only on the GPU (the mode is forward-only), naming the field
// (the device API's refusals: test_cuda_device_api.cpp, DeviceApiChecks).
TEST(GpuBidirectionalErrors, RefusedCallsNameTheField) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  const VarlenCase c = gpu_case(make_shape(2, 1, 80, 64, 64, 4, 1, 0), whole_prefills({5, 70}));
  const MsaParams p = bidirectional(c.params());
  const AttentionOutput fwd = dense_attention(c.q, c.k, c.v, c.cu_seqlens_q, c.cu_seqlens_k, p, Impl::cpu);
  expect_error([&] {
    dense_attention_backward(c.q, c.k, c.v, fwd.o, fwd.lse, fwd.o, c.cu_seqlens_q, c.cu_seqlens_k, p, Impl::cuda);
  }, "argument 'causal': expected true for dense_attention_backward on impl 'cuda'");
}

}  // namespace
}  // namespace msa::testing
