// The warpgroup-MMA dense prefill (the head_dim 128 and 80 default; pinned here with
// MsaParams::cuda.dense = wgmma: src/cuda/attention/attention_dense_wgmma.cuh) against the CPU
// on random bf16-exact inputs: varlen and paged (shuffled pages, unused cache slots NaN), O and
// LSE (outputs poisoned by the CUDA glue before the kernel runs), run-to-run bitwise identity,
// and against the mma.sync kernel (dense = mma_sync). Every batch has a request of more than
// 16 queries, so attention() takes the prefill path (the decode path has one engine).
// Skipped (not failed) where no CUDA device is present; ctest label "gpu".
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "gpu_checks.h"

namespace msa::testing {
namespace {

// Lengths around the 64-row warpgroup tile, the 128-key tile and the blocks (64, 128).
const std::vector<int64_t> kEdgeLengths = {1, 63, 64, 65, 127, 128, 129, 2047, 2048, 2049};

// The wgmma kernel on `c`, varlen and paged, against the CPU and the mma.sync kernel, and a
// second run bitwise identical to the first.
void expect_dense_wgmma_matches(const VarlenCase& c, const std::string& what) {
  PagedRequests paged = page_varlen_case(c);
  poison_unused_cache_slots(paged.cache);
  const auto with_engine = [&](Impl impl, cuda::Engine engine) {
    MsaParams p = c.params();
    p.cuda.dense = engine;
    return std::make_pair(impl, p);
  };
  const auto varlen = [&](Impl impl, cuda::Engine engine = cuda::Engine::automatic) {
    const auto [i, p] = with_engine(impl, engine);
    return dense_attention(c.q, c.k, c.v, c.cu_seqlens_q, c.cu_seqlens_k, p, i);
  };
  const auto run_paged = [&](Impl impl, cuda::Engine engine = cuda::Engine::automatic) {
    const auto [i, p] = with_engine(impl, engine);
    return paged_dense_attention(c.q, paged.cache, paged.cu_seqlens_q, p, i);
  };
  struct Layout {
    std::string name;
    std::function<AttentionOutput(Impl, cuda::Engine)> run;
  };
  for (const Layout& layout : {Layout{"varlen", varlen}, Layout{"paged", run_paged}}) {
    const std::string label = what + " " + layout.name;
    SCOPED_TRACE(label);
    const AttentionOutput cpu = layout.run(Impl::cpu, cuda::Engine::automatic);
    const AttentionOutput mma_sync = layout.run(Impl::cuda, cuda::Engine::mma_sync);
    const AttentionOutput first = layout.run(Impl::cuda, cuda::Engine::wgmma),
                          second = layout.run(Impl::cuda, cuda::Engine::wgmma);
    expect_dense_close(first, cpu, c, label + " (wgmma vs cpu)");
    expect_dense_close(first, mma_sync, c, label + " (wgmma vs mma.sync)");
    EXPECT_TRUE(bitwise_equal(first.o, second.o)) << label << ": o differs between runs";
    EXPECT_TRUE(bitwise_equal(first.lse, second.lse)) << label << ": lse differs between runs";
  }
}

// make_shape(Hkv, G, D, Di, B, topk, local, init): D = 128 and 80; groups 1, 3, 4, 16; B 64 and 128
// (the index fields are unused by dense attention).
std::vector<CaseShape> dense_wgmma_shapes() {
  return {
      make_shape(4, 16, 128, 128, 128, 16, 1, 0),  // MiniMax-M3
      make_shape(2, 4, 128, 64, 64, 4, 1, 0),
      make_shape(2, 1, 128, 64, 128, 4, 1, 0),
      make_shape(1, 1, 128, 64, 64, 4, 1, 0),
      make_shape(1, 3, 128, 64, 128, 4, 1, 0),
      make_shape(1, 16, 128, 64, 64, 4, 1, 0),
      make_shape(2, 1, 80, 64, 128, 4, 1, 0),  // head dim 80 (the vision tower's), causal here
      make_shape(1, 4, 80, 64, 64, 4, 1, 0),
  };
}

class GpuDenseWgmma : public ::testing::TestWithParam<CaseShape> {};

// Full prefills (q_len = k_len) of every edge length in one shuffled batch.
TEST_P(GpuDenseWgmma, EdgeLengthsMatchCpu) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  std::vector<Seq> seqs = whole_prefills(kEdgeLengths);
  std::shuffle(seqs.begin(), seqs.end(), rng());
  expect_dense_wgmma_matches(gpu_case(GetParam(), std::move(seqs)), "prefill");
}

// Chunked prefill: new queries after a cached prefix (bottom-right causal), chunks that start
// and end inside key tiles and on their edges, next to a full prefill and a single query.
TEST_P(GpuDenseWgmma, CachedPrefixMatchesCpu) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  std::vector<Seq> seqs = {{.q_len = 100, .k_len = 1000}, {.q_len = 17, .k_len = 129},
                           {.q_len = 64, .k_len = 2048},  {.q_len = 129, .k_len = 2049},
                           {.q_len = 1, .k_len = 777},    {.q_len = 65, .k_len = 65},
                           {.q_len = 300, .k_len = 1283}, {.q_len = 127, .k_len = 255}};
  std::shuffle(seqs.begin(), seqs.end(), rng());
  expect_dense_wgmma_matches(gpu_case(GetParam(), std::move(seqs)), "cached prefix");
}

INSTANTIATE_TEST_SUITE_P(Shapes, GpuDenseWgmma, ::testing::ValuesIn(dense_wgmma_shapes()), shape_name);

// Long key loops (up to 157 key tiles per CTA, each stage refilled many times) in small
// shapes, so that the CPU reference stays cheap: a 16K prefill and a 4K chunk after a 16K
// prefix.
TEST(GpuDenseWgmmaLong, LongContextsMatchCpu) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  for (const CaseShape& shape : {make_shape(1, 1, 128, 64, 128, 4, 1, 0), make_shape(1, 2, 128, 64, 64, 4, 1, 0)}) {
    SCOPED_TRACE(shape.describe());
    expect_dense_wgmma_matches(
        gpu_case(shape, {{.q_len = 16384 + 5, .k_len = 16384 + 5}, {.q_len = 4099, .k_len = 20000}}), "long");
  }
}

// Pinning the wgmma engine where it cannot run (head_dim 64) is an error naming the field.
TEST(GpuDenseWgmmaSetting, PinnedEngineThatCannotRunIsAClearError) {
  MSA_REQUIRE_CUDA();
  const VarlenCase c = gpu_case(make_shape(1, 4, 64, 64, 128, 4, 1, 0), {{.q_len = 300, .k_len = 300}});
  MsaParams p = c.params();
  p.cuda.dense = cuda::Engine::wgmma;
  const std::string error = error_of([&] {
    dense_attention(c.q, c.k, c.v, c.cu_seqlens_q, c.cu_seqlens_k, p, Impl::cuda);
  });
  EXPECT_NE(error.find("dense_engine"), std::string::npos) << error;
}

}  // namespace
}  // namespace msa::testing
