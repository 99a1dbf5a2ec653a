// The routed-expert GEMMs of the CUDA MoE against f64 dot products of the same bf16 values:
// the decode-sized kernel (moe_experts_small.cu) and the grouped tensor-core kernel
// (moe_experts_grouped.cu), over row distributions with the edges: one row, one row per
// expert, every row in one expert, rows per expert around the grouped kernel's 32-row tile and
// its 16-row MMA, empty experts between used ones, dims that end inside a tile; outputs
// poisoned, the grouped kernel bitwise repeatable. Then the model: a made three-layer model's
// logits with the grouped kernel against the per-expert cuBLASLt GEMMs at a step of more than
// 64 entries, and a decode graph captured at such a batch.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "cli_runner.h"
#include "cuda/common/device_buffer.h"
#include "model/gpu/cuda_model.h"
#include "model/gpu/kernels.h"
#include "msa/dtype.h"
#include "msa/model.h"
#include "msa/model_random.h"
#include "gpu_checks.h"
#include "op_cases.h"
#include "test_util.h"
#include "three_layer_model.h"

namespace msa {
namespace {

using cuda::DeviceBuffer;
using model::gpu::CudaModel;
using model::gpu::MoeKernel;
using testing::rng;

std::vector<uint16_t> random_bf16(int64_t count) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<uint16_t> out(static_cast<size_t>(count));
  for (uint16_t& v : out) v = float_to_bf16(dist(rng()));
  return out;
}

enum class Kernel { small, grouped };

// rows_per_expert[e] rows for expert e; checks y against the f64 product of every row. The
// grouped kernel also runs a second time into a freshly poisoned buffer: bitwise equal.
void check_case(Kernel kernel, const std::vector<int32_t>& rows_per_expert, int64_t in, int64_t out,
                const std::string& what) {
  SCOPED_TRACE(what);
  const int64_t experts = static_cast<int64_t>(rows_per_expert.size());
  std::vector<int32_t> offsets(rows_per_expert.size() + 1, 0);
  std::partial_sum(rows_per_expert.begin(), rows_per_expert.end(), offsets.begin() + 1);
  const int64_t entries = offsets.back();
  if (kernel == Kernel::small) ASSERT_TRUE(model::gpu::moe_experts_small_fits(entries, in, out));
  else ASSERT_TRUE(model::gpu::moe_experts_grouped_fits(in, out));
  const std::vector<uint16_t> x = random_bf16(entries * in), w = random_bf16(experts * out * in);
  DeviceBuffer dx = DeviceBuffer::from(x), dw = DeviceBuffer::from(w), doff = DeviceBuffer::from(offsets);
  DeviceBuffer dy(static_cast<size_t>(entries * out) * sizeof(float));
  auto run = [&] {
    dy.fill_bytes(0xff);  // poison: NaN everywhere a row is not written
    if (kernel == Kernel::small)
      model::gpu::moe_experts_small({.x = dx.as<uint16_t>(), .w = dw.as<uint16_t>(), .offsets = doff.as<int32_t>(),
                                     .entries = entries, .experts = experts, .in = in, .out = out,
                                     .y = dy.as<float>()},
                                    nullptr);
    else
      model::gpu::moe_experts_grouped({.x = dx.as<uint16_t>(), .w = dw.as<uint16_t>(), .offsets = doff.as<int32_t>(),
                                       .entries = entries, .experts = experts, .in = in, .out = out,
                                       .y = dy.as<float>()},
                                      nullptr);
    std::vector<float> y(static_cast<size_t>(entries * out));
    dy.download(y.data(), dy.bytes());
    return y;
  };
  const std::vector<float> y = run();
  if (kernel == Kernel::grouped) {
    const std::vector<float> again = run();
    EXPECT_EQ(std::memcmp(y.data(), again.data(), y.size() * sizeof(float)), 0) << "two runs differ";
  }
  // f32 sums of `in` products in another order than the f64 sum: the small kernel's fmaf
  // chains stay well inside in * 2^-24 of the absolute sum (in <= 512: 2e-5); the tensor
  // cores' f32 accumulation may truncate rather than round, so the grouped kernel gets 1e-4
  // (in <= 520). A wrong weight row, input row or expert is off by O(1) of the absolute sum.
  const double bar = kernel == Kernel::small ? 2e-5 : 1e-4;
  int64_t bad = 0;
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t n = offsets[e]; n < offsets[e + 1]; ++n)
      for (int64_t j = 0; j < out; ++j) {
        double want = 0, magnitude = 0;
        for (int64_t i = 0; i < in; ++i) {
          const double term = double{bf16_to_float(w[(e * out + j) * in + i])} * bf16_to_float(x[n * in + i]);
          want += term;
          magnitude += std::fabs(term);
        }
        const double got = y[n * out + j];
        if (!(std::fabs(got - want) <= bar * magnitude + 1e-6)) {
          if (++bad <= 5)
            ADD_FAILURE() << "row " << n << " (expert " << e << "), output " << j << ": got " << got << ", want "
                          << want;
        }
      }
  EXPECT_EQ(bad, 0);
}

TEST(CudaMoeExpertsSmall, MatchesF64DotProducts) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  check_case(Kernel::small, {0, 0, 1, 0}, 64, 32, "one row");
  check_case(Kernel::small, {1, 1, 1, 1}, 256, 96, "one row per expert, out ends a tile");
  check_case(Kernel::small, {0, 20, 0}, 128, 40, "every row in one expert: 3 passes of <= 8 rows");
  check_case(Kernel::small, {3, 0, 0, 5, 8, 9, 0, 1}, 72, 33, "mixed, empty experts between");
  std::vector<int32_t> wide(32, 0);
  for (int64_t n = 0; n < model::gpu::kMaxSmallMoeEntries; ++n) ++wide[std::uniform_int_distribution<int>(0, 31)(rng())];
  check_case(Kernel::small, wide, 512, 200, "the largest step it takes, random experts");
}

TEST(CudaMoeExpertsSmall, RefusesShapesItDoesNotTake) {
  EXPECT_FALSE(model::gpu::moe_experts_small_fits(0, 64, 64));
  EXPECT_FALSE(model::gpu::moe_experts_small_fits(model::gpu::kMaxSmallMoeEntries + 1, 64, 64));
  EXPECT_FALSE(model::gpu::moe_experts_small_fits(4, 60, 64));  // in not a multiple of 8
  EXPECT_TRUE(model::gpu::moe_experts_small_fits(4, 6144, 6144));
  try {
    model::gpu::moe_experts_small({.entries = 4, .in = 60, .out = 8}, nullptr);
    ADD_FAILURE() << "expected msa::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("multiple of 8"), std::string::npos) << e.what();
  }
}

// Tiles of 32 rows x 128 outputs x 64 k, MMAs of 16 rows: rows per expert on both sides of
// 16, 32 and 64, dims on both sides of 64 and 128 (in a multiple of 8: its 16-byte chunks).
TEST(CudaMoeExpertsGrouped, MatchesF64DotProducts) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  check_case(Kernel::grouped, {0, 0, 1, 0}, 64, 32, "one row");
  check_case(Kernel::grouped, {1, 1, 1, 1}, 8, 1, "one row per expert, in 8 (one chunk), one output");
  check_case(Kernel::grouped, {0, 300, 0}, 136, 200, "every row in one expert; in, out end inside a tile");
  check_case(Kernel::grouped, {1, 0, 15, 16, 0, 0, 17, 31, 32, 33, 0, 63, 64, 65, 300, 0}, 520, 130,
             "1..300 rows per expert around the tile edges, empty experts between");
  check_case(Kernel::grouped, {64, 64}, 128, 256, "dims multiples of the tiles");
  std::vector<int32_t> routed(128, 0);
  for (int64_t n = 0; n < 1024; ++n) ++routed[std::uniform_int_distribution<int>(0, 127)(rng())];
  check_case(Kernel::grouped, routed, 256, 384, "1024 rows over 128 experts, random routing");
}

TEST(CudaMoeExpertsGrouped, RefusesShapesItDoesNotTake) {
  EXPECT_TRUE(model::gpu::moe_experts_grouped_fits(6144, 6144));
  EXPECT_FALSE(model::gpu::moe_experts_grouped_fits(60, 64));  // in not a multiple of 8
  EXPECT_FALSE(model::gpu::moe_experts_grouped_fits(0, 64));
  EXPECT_FALSE(model::gpu::moe_experts_grouped_fits(64, 0));
  // The capacity: ceil(N / 32) + min(E, N) bounds the (expert, row tile) items of any routing.
  EXPECT_EQ(model::gpu::moe_grouped_work_items(1, 128), 2);
  EXPECT_EQ(model::gpu::moe_grouped_work_items(4096, 128), 128 + 128);
  EXPECT_EQ(model::gpu::moe_grouped_work_items(33, 2), 2 + 2);
  auto refusal = [](const model::gpu::MoeGroupedGemm& job) {
    try {
      model::gpu::moe_experts_grouped(job, nullptr);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(refusal({.entries = 4, .experts = 2, .in = 60, .out = 8}).find("'in'"), std::string::npos);
  EXPECT_NE(refusal({.entries = 4, .experts = 2, .in = 64, .out = 0}).find("'out'"), std::string::npos);
  EXPECT_NE(refusal({.entries = 4, .experts = 0, .in = 64, .out = 8}).find("'experts'"), std::string::npos);
  EXPECT_NE(refusal({.entries = -1, .experts = 2, .in = 64, .out = 8}).find("'entries'"), std::string::npos);
}

// ---- the model ----

// 8 experts, top 2 (as test_cuda_model's small64): 40 tokens or requests make 80 entries,
// beyond the small kernel's 64.
ModelConfig moe_model_config() {
  return testing::three_layer_model({.vocab_size = 512, .hidden_size = 256, .num_heads = 8, .num_kv_heads = 2,
                                     .head_dim = 64, .rotary_dim = 32, .dense_intermediate_size = 384,
                                     .moe_intermediate_size = 128, .shared_intermediate_size = 128,
                                     .num_experts = 8, .experts_per_token = 2, .index_heads = 2,
                                     .index_head_dim = 64, .block_size = 64, .topk_blocks = 4});
}

// Never destroyed (device memory and cuBLASLt must not be torn down from static destructors).
const Model& moe_host_model() {
  static const Model& model = *[] {
    const std::string dir = testing::fresh_dir("moe_kernels").string();
    write_random_checkpoint(moe_model_config(), dir, {.seed = 23, .dtype = DType::bf16});
    write_random_tokenizer(moe_model_config(), dir);
    return new Model(Model::load(dir, Device::cpu));
  }();
  return model;
}

// A fresh CUDA model of the made checkpoint, kept for the process (as moe_host_model).
CudaModel& cuda_model_with(MoeKernel kernel) {
  auto* owner = new std::shared_ptr<CudaModel>(
      model::gpu::make_cuda_model(moe_host_model().config(), moe_host_model().weights()));
  (*owner)->set_moe_kernel(kernel);
  return **owner;
}

bool all_finite(const Tensor& t) {
  for (float v : t.span<float>())
    if (!std::isfinite(v)) return false;
  return true;
}

// Per row within the CPU-vs-CUDA bar of test_cuda_model (2e-2, relative L2): the two kernels
// differ only in f32 summation order, so a row misses only where a near-tied expert choice
// of a later layer flips; at most one such row.
void expect_rows_close(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  EXPECT_TRUE(all_finite(got)) << what;
  int64_t misses = 0;
  for (int64_t r = 0; r < got.size(0); ++r) {
    const double error = testing::relative_error(got.slice0(r, r + 1).clone(), want.slice0(r, r + 1).clone());
    if (!(error < 2e-2)) {
      ++misses;
      std::printf("%s, row %lld: relative error %.3g\n", what.c_str(), static_cast<long long>(r), error);
    }
  }
  EXPECT_LE(misses, 1) << what;
}

TEST(CudaMoeKernels, AutomaticRuleAndForcedKernels) {
  MSA_REQUIRE_CUDA();
  CudaModel& model = cuda_model_with(MoeKernel::automatic);
  const model::gpu::MoeKernelRule rule;
  EXPECT_EQ(model.moe_kernel_for(4), MoeKernel::small);
  EXPECT_EQ(model.moe_kernel_for(rule.max_small_entries), MoeKernel::small);
  EXPECT_EQ(model.moe_kernel_for(rule.max_small_entries + 1), MoeKernel::grouped);
  EXPECT_EQ(model.moe_kernel_for(rule.max_grouped_entries), MoeKernel::grouped);
  EXPECT_EQ(model.moe_kernel_for(rule.max_grouped_entries + 1), MoeKernel::per_expert);
  model.set_moe_kernel(MoeKernel::automatic, {.max_small_entries = 0, .max_grouped_entries = 0});
  EXPECT_EQ(model.moe_kernel_for(4), MoeKernel::per_expert);
  model.set_moe_kernel(MoeKernel::grouped);
  EXPECT_EQ(model.moe_kernel_for(1), MoeKernel::grouped);
  EXPECT_EQ(model.moe_kernel_for(100000), MoeKernel::grouped);
  model.set_moe_kernel(MoeKernel::small);
  EXPECT_EQ(model.moe_kernel_for(64), MoeKernel::small);
  const std::string error = testing::error_of([&] { model.moe_kernel_for(65); });
  EXPECT_NE(error.find("MoE kernel small"), std::string::npos) << error;
  EXPECT_NE(testing::error_of([&] { model.set_moe_kernel(MoeKernel::automatic, {.max_small_entries = 65}); })
                .find("max_small_entries"),
            std::string::npos);
  EXPECT_EQ(model::gpu::parse_moe_kernel("per-expert", "--moe-kernel"), MoeKernel::per_expert);
  EXPECT_NE(testing::error_of([] { model::gpu::parse_moe_kernel("fast", "--moe-kernel"); }).find("--moe-kernel"),
            std::string::npos);
}

// A 48-token prefill (96 entries) and decode steps of 40 requests (80 entries; the graph's
// bucket of 64 slots runs 128) with the grouped kernel against the per-expert GEMMs; the
// grouped model's decode steps run as a captured graph, the per-expert model's eagerly.
TEST(CudaMoeKernels, GroupedMatchesPerExpertAndIsCapturedInDecodeGraphs) {
  MSA_REQUIRE_CUDA();
  const ModelConfig& c = moe_host_model().config();
  CudaModel& grouped = cuda_model_with(MoeKernel::grouped);
  CudaModel& per_expert = cuda_model_with(MoeKernel::per_expert);
  ASSERT_TRUE(grouped.decode_graphs());
  const int64_t prompt = 48, requests = 40, steps = 3;
  const int64_t pages = requests * ((prompt + steps + c.block_size - 1) / c.block_size) + 8;
  KvCache grouped_cache(c, pages, DType::bf16, Device::cuda), per_expert_cache(c, pages, DType::bf16, Device::cuda);
  std::vector<SequenceCache> grouped_seq(requests), per_expert_seq(requests);
  std::vector<std::vector<int32_t>> streams;
  for (int64_t r = 0; r < requests; ++r)
    streams.push_back(testing::some_tokens(prompt + steps, c.vocab_size, static_cast<int32_t>(r + 3)));

  for (int64_t r = 0; r < requests; ++r) {
    const std::span<const int32_t> tokens(streams[r].data(), static_cast<size_t>(prompt));
    const ForwardRequest a{.sequence = &grouped_seq[r], .tokens = tokens, .all_logits = true};
    const ForwardRequest b{.sequence = &per_expert_seq[r], .tokens = tokens, .all_logits = true};
    const Tensor got = grouped.forward({&a, 1}, grouped_cache);
    const Tensor want = per_expert.forward({&b, 1}, per_expert_cache);
    if (r == 0) expect_rows_close(got, want, "prefill of 48 tokens (96 entries)");
  }
  EXPECT_EQ(grouped.captured_decode_graphs(), 0) << "prefill steps run eagerly";
  for (int64_t step = 0; step < steps; ++step) {
    std::vector<ForwardRequest> a, b;
    for (int64_t r = 0; r < requests; ++r) {
      const std::span<const int32_t> token(streams[r].data() + prompt + step, 1);
      a.push_back({.sequence = &grouped_seq[r], .tokens = token});
      b.push_back({.sequence = &per_expert_seq[r], .tokens = token});
    }
    const Tensor got = grouped.forward(a, grouped_cache);
    const Tensor want = per_expert.forward(b, per_expert_cache);
    expect_rows_close(got, want, "decode step " + std::to_string(step) + " of 40 requests");
  }
  EXPECT_EQ(grouped.captured_decode_graphs(), 1) << "the 40-request bucket (80 entries) runs as a graph";
  EXPECT_EQ(per_expert.captured_decode_graphs(), 0) << "per-expert GEMMs need the host's offsets";
  EXPECT_GT(grouped.moe_kernel_calls().grouped, 0);
  EXPECT_EQ(grouped.moe_kernel_calls().per_expert + grouped.moe_kernel_calls().small, 0);
  EXPECT_EQ(per_expert.moe_kernel_calls().grouped + per_expert.moe_kernel_calls().small, 0);
}

}  // namespace
}  // namespace msa
