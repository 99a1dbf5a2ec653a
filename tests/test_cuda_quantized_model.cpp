// The CUDA model with routed experts kept quantized (MXFP8, NVFP4: the expert kernels read the
// checkpoint's codes and scales) against the CUDA model of the same checkpoint with
// bf16-dequantized experts and against the CPU model. Skipped (not failed) without a CUDA
// device; label "gpu".
//
// Tolerances. MXFP8: both CUDA models hold the same weight values exactly (e4m3 times a power
// of two is a bf16 value) and run the same kernel (small or grouped) per step; only the order
// of f32 accumulation may differ, which moves a GEMM output by ~1e-6 relative and at most flips
// the bf16 rounding of an activation (2^-9) now and then: the logits' relative L2 error stays
// far below 1e-3; the bar is 2e-3. NVFP4: the dequantized bf16 weight is e2m1 * e4m3 * global
// rounded to bf16 once (2^-9 relative per weight, random sign), the kernel applies the global
// scale to the f32 sum of exact e2m1 * e4m3 products instead: GEMM outputs differ by ~2^-9 /
// sqrt(3) relative, which the layers carry to the logits at about that size; the bar is 1e-2.
// Against the CPU f32 model: the parity bar of test_cuda_model.cpp (2e-2 relative L2).
#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <map>
#include <iostream>

#include "cli_runner.h"
#include "model/gpu/cuda_model.h"
#include "msa/model.h"
#include "msa/communicator.h"
#include "msa/model_random.h"
#include "msa/parallel_model.h"
#include "msa/safetensors.h"
#include "gpu_checks.h"
#include "test_util.h"
#include "three_layer_model.h"

namespace msa {
namespace {

namespace fs = std::filesystem;
using model::gpu::CudaModel;
using model::gpu::ExpertWeights;
using model::gpu::MoeKernel;
using testing::error_of;
using testing::fresh_dir;
using testing::relative_error;
using testing::some_tokens;

// 8 experts, top 2, hidden 256 and expert intermediate 128 (multiples of both formats' blocks).
ModelConfig quantized_test_config() {
  return testing::three_layer_model({.vocab_size = 512, .hidden_size = 256, .num_heads = 8, .num_kv_heads = 2,
                                     .head_dim = 64, .rotary_dim = 32, .dense_intermediate_size = 384,
                                     .moe_intermediate_size = 128, .shared_intermediate_size = 128,
                                     .num_experts = 8, .experts_per_token = 2, .index_heads = 2,
                                     .index_head_dim = 64, .block_size = 64, .topk_blocks = 4});
}

struct Loaded {
  fs::path dir;                       // the checkpoint
  Model plain;                        // CPU, dequantized experts (the reference)
  Model kept;                         // host weights with the experts as stored
  std::shared_ptr<CudaModel> bf16;    // CUDA, dequantized experts
  std::shared_ptr<CudaModel> quantized;  // CUDA, experts kept quantized
};

// Loaded once per process and never destroyed (device memory must not be freed from static
// destructors).
Loaded& loaded(CheckpointFormat format) {
  static auto& models = *new std::map<int, std::unique_ptr<Loaded>>();
  auto found = models.find(static_cast<int>(format));
  if (found != models.end()) return *found->second;
  const ModelConfig config = quantized_test_config();
  const fs::path dir = fresh_dir(format == CheckpointFormat::nvfp4 ? "cq_nvfp4" : "cq_mxfp8");
  write_random_checkpoint(config, dir.string(), {.seed = 5, .dtype = DType::bf16, .format = format});
  Model plain = Model::load(dir.string());
  Model kept(load_model_config(dir.string()), SafetensorsModel::open(dir.string()),
             {.routed_experts = RoutedExperts::quantized});
  auto bf16 = model::gpu::make_cuda_model(plain.config(), plain.weights());
  auto quantized = model::gpu::make_cuda_model(kept.config(), kept.weights());
  auto l = std::make_unique<Loaded>(Loaded{dir, std::move(plain), std::move(kept), bf16, quantized});
  return *models.emplace(static_cast<int>(format), std::move(l)).first->second;
}

KvCache device_cache(const ModelConfig& c) { return KvCache(c, 16, DType::bf16, Device::cuda); }

// A prefill of `prompt` tokens then `decodes` single-token steps through `model`, returning
// each step's logits (all rows of the prefill).
std::vector<Tensor> run_steps(const std::function<Tensor(std::span<const ForwardRequest>, KvCache&)>& forward,
                              KvCache cache, int64_t prompt, int64_t decodes) {
  SequenceCache sequence;
  std::vector<Tensor> steps;
  const std::vector<int32_t> tokens = some_tokens(prompt + decodes, 512, 4);
  const std::vector<int32_t> first(tokens.begin(), tokens.begin() + prompt);
  ForwardRequest request{.sequence = &sequence, .tokens = first, .all_logits = true};
  steps.push_back(forward({&request, 1}, cache).clone());
  for (int64_t i = 0; i < decodes; ++i) {
    const std::vector<int32_t> one{tokens[prompt + i]};
    ForwardRequest next{.sequence = &sequence, .tokens = one};
    steps.push_back(forward({&next, 1}, cache).clone());
  }
  return steps;
}

std::vector<Tensor> cuda_steps(CudaModel& model, int64_t prompt, int64_t decodes) {
  return run_steps([&](std::span<const ForwardRequest> r, KvCache& c) { return model.forward(r, c); },
                   device_cache(model.config()), prompt, decodes);
}

class CudaQuantizedModel : public ::testing::TestWithParam<CheckpointFormat> {};

TEST_P(CudaQuantizedModel, MatchesDequantizedExpertsAndTheCpuWithEachKernel) {
  MSA_REQUIRE_CUDA();
  const CheckpointFormat format = GetParam();
  Loaded& m = loaded(format);
  const bool nvfp4 = format == CheckpointFormat::nvfp4;
  ASSERT_EQ(m.quantized->expert_format(), nvfp4 ? ExpertWeights::nvfp4 : ExpertWeights::mxfp8);
  ASSERT_EQ(m.bf16->expert_format(), ExpertWeights::bf16);
  const double bar = nvfp4 ? 1e-2 : 2e-3;
  const ModelConfig& c = m.plain.config();
  // The CPU reference: a 40-token prefill (80 entries: above the small kernel's 64) and 3
  // decode steps (2 entries each).
  const std::vector<Tensor> cpu =
      run_steps([&](std::span<const ForwardRequest> r, KvCache& cache) { return m.plain.forward(r, cache); },
                KvCache(c, 16, DType::f32), 40, 3);
  struct Case {
    MoeKernel kernel;
    int64_t prompt;
  };
  // auto: grouped for the prefill, small for the decodes; forced grouped for both; forced
  // small with a 24-token prefill (48 entries) so that every step fits it.
  for (const Case& k : {Case{MoeKernel::automatic, 40}, Case{MoeKernel::grouped, 40}, Case{MoeKernel::small, 24}}) {
    m.quantized->set_moe_kernel(k.kernel);
    m.bf16->set_moe_kernel(k.kernel);
    const auto before = m.quantized->moe_kernel_calls();
    const std::vector<Tensor> got = cuda_steps(*m.quantized, k.prompt, 3);
    const std::vector<Tensor> want = cuda_steps(*m.bf16, k.prompt, 3);
    const auto after = m.quantized->moe_kernel_calls();
    if (k.kernel != MoeKernel::small) EXPECT_GT(after.grouped, before.grouped);
    if (k.kernel != MoeKernel::grouped) EXPECT_GT(after.small, before.small);
    EXPECT_EQ(after.per_expert, before.per_expert);
    const std::vector<Tensor> reference =
        k.prompt == 40 ? cpu
                       : run_steps([&](std::span<const ForwardRequest> r, KvCache& cache) { return m.plain.forward(r, cache); },
                                   KvCache(c, 16, DType::f32), k.prompt, 3);
    for (size_t step = 0; step < got.size(); ++step) {
      const std::string what = std::string(nvfp4 ? "nvfp4" : "mxfp8") + " kernel " +
                               model::gpu::moe_kernel_name(k.kernel) + " step " + std::to_string(step);
      const double dequantized = relative_error(got[step], want[step]);
      const double parity = relative_error(got[step], reference[step]);
      std::cout << "[ logits ] " << what << ": vs bf16-dequantized experts " << dequantized << ", vs cpu " << parity
                << "\n";
      EXPECT_LT(dequantized, bar) << what;
      EXPECT_LT(parity, 2e-2) << what;
    }
  }
  m.quantized->set_moe_kernel(MoeKernel::automatic);
  m.bf16->set_moe_kernel(MoeKernel::automatic);
}

TEST_P(CudaQuantizedModel, PerExpertIsRefusedAndTheDeviceHoldsTheQuantizedBytes) {
  MSA_REQUIRE_CUDA();
  Loaded& m = loaded(GetParam());
  const std::string e = error_of([&] { m.quantized->set_moe_kernel(MoeKernel::per_expert); });
  EXPECT_NE(e.find("per-expert"), std::string::npos) << e;
  EXPECT_EQ(m.quantized->moe_kernel(), MoeKernel::automatic);
  // A step far above the rule's grouped bound still runs grouped.
  EXPECT_EQ(m.quantized->moe_kernel_for(1 << 16), MoeKernel::grouped);
  const ModelConfig& c = m.plain.config();
  const ExpertWeights format = m.quantized->expert_format();
  const int64_t weights = c.num_experts * 3 * c.moe_intermediate_size * c.hidden_size, rows =
      c.num_experts * (2 * c.moe_intermediate_size + c.hidden_size);
  const int64_t expert_bytes = format == ExpertWeights::mxfp8 ? weights + weights / 32
                                                              : weights / 2 + weights / 16 + 4 * rows;
  int64_t moe_layers = 0;
  for (int64_t l = 0; l < c.num_layers; ++l) moe_layers += c.moe_layers[l] ? 1 : 0;
  EXPECT_EQ(model::gpu::device_weight_bytes(c, format) + moe_layers * 2 * weights,
            model::gpu::device_weight_bytes(c) + moe_layers * expert_bytes);
  for (const auto& layer : m.quantized->weights().layers) {
    if (layer.experts == 0) continue;
    EXPECT_EQ(static_cast<int64_t>(layer.experts_gate_up.bytes() + layer.experts_down.bytes() +
                                   layer.experts_gate_up_scales.bytes() + layer.experts_down_scales.bytes() +
                                   layer.experts_gate_up_global.bytes() + layer.experts_down_global.bytes()),
              expert_bytes);
  }
}

// Expert parallel ranks (ParallelModel on Device::cuda, here 1 and 2 ranks of this GPU) keep
// the experts as stored and run their received rows through the same small / grouped kernels,
// one launch per peer, against the single-GPU model (which repeats itself bitwise). One rank:
// the bars of the header (MXFP8 2e-3, NVFP4 1e-2); measured on the H200, MXFP8 0 to 1.3e-4
// and NVFP4 0.4e-3 to 2.3e-3, the latter not explained (the same weights and kernels on the
// same rows; a wrong expert or offset moves the logits by 1e-1). Two ranks also sum the
// attention and dense products in another order, which may flip a near-tie selection or
// expert choice of the made model: the CPU parity bar, 2e-2 (measured 1.7e-3 to 3.4e-3).
TEST_P(CudaQuantizedModel, ExpertParallelRanksKeepTheExpertsQuantized) {
  MSA_REQUIRE_CUDA();
  Loaded& m = loaded(GetParam());
  m.quantized->set_moe_kernel(MoeKernel::automatic);
  const int64_t prompt = 150, decodes = 3;
  const std::vector<Tensor> want = cuda_steps(*m.quantized, prompt, decodes);
  const std::vector<Tensor> again = cuda_steps(*m.quantized, prompt, decodes);
  for (size_t step = 0; step < want.size(); ++step)
    EXPECT_EQ(relative_error(again[step], want[step]), 0.0) << "the single-GPU model repeats step " << step;
  for (const int world : {1, 2}) {
    const auto comms = make_local_device_communicators(world);
    std::vector<std::vector<Tensor>> got(world);
    std::vector<int64_t> held(world, -1);
    run_on_ranks(comms, [&](Communicator& comm) {
      const ParallelModel model = ParallelModel::load(m.dir.string(), comm, Device::cuda);
      const LayerWeights& moe = model.weights().layers[1];
      held[comm.rank()] = moe.experts.size() == 0 || !moe.experts[0].is_quantized()
                              ? -1
                              : static_cast<int64_t>(moe.experts.size());
      got[comm.rank()] = run_steps(
          [&](std::span<const ForwardRequest> r, KvCache& c) { return model.forward(r, c); },
          KvCache(model.rank_config(), 16, DType::bf16, Device::cuda), prompt, decodes);
    });
    for (int r = 0; r < world; ++r) {
      EXPECT_EQ(held[r], m.plain.config().num_experts / world) << "world " << world << " rank " << r
                                                               << ": quantized routed experts held";
      ASSERT_EQ(got[r].size(), want.size());
    }
    const double bar = world == 2 ? 2e-2 : GetParam() == CheckpointFormat::nvfp4 ? 1e-2 : 2e-3;
    for (size_t step = 0; step < want.size(); ++step) {
      const double error = relative_error(got[0][step], want[step]);
      std::cout << "[ logits ] " << (GetParam() == CheckpointFormat::nvfp4 ? "nvfp4" : "mxfp8") << " world " << world
                << " step " << step << ": vs the single-GPU model " << error << "\n";
      EXPECT_LT(error, bar) << "world " << world << " step " << step;
      for (int r = 1; r < world; ++r)
        EXPECT_EQ(relative_error(got[r][step], got[0][step]), 0.0) << "every rank returns the same logits";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, CudaQuantizedModel,
                         ::testing::Values(CheckpointFormat::mxfp8, CheckpointFormat::nvfp4),
                         [](const auto& info) { return info.param == CheckpointFormat::mxfp8 ? "mxfp8" : "nvfp4"; });

TEST(CudaQuantizedModel, CliRunTakesTheQuantizedPath) {
  MSA_REQUIRE_CUDA();
  // Model::load(dir, Device::cuda) (what `msa run --device cuda` calls) keeps the experts.
  const ModelConfig config = quantized_test_config();
  const fs::path dir = fresh_dir("cq_cli_nvfp4");
  write_random_checkpoint(config, dir.string(), {.seed = 3, .dtype = DType::bf16, .format = CheckpointFormat::nvfp4});
  {
    const Model model = Model::load(dir.string(), Device::cuda);
    EXPECT_TRUE(model.weights().layers[1].experts[0].is_quantized());
  }
  const testing::CliResult run = testing::run_cli("run --device cuda --model " + dir.string() +
                                                  " --prompt-tokens 5,6,7,8 --max-tokens 4 --stop 9999");
  EXPECT_EQ(run.exit_code, 0) << run.out;
}

}  // namespace
}  // namespace msa
