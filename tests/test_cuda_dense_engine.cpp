// The CUDA text model's dense attention engines (DenseAttentionEngine, msa/model.h): the same
// small random model's logits with ours (msa) and with each cuDNN engine (cudnn: over the
// paged cache; cudnn_gathered: over K/V gathered out of it) over prefills, decode steps, mixed
// steps (a prefill chunk while others decode: cuDNN's ragged Q/O, and the gathered engine's
// ragged K/V) and batches whose sizes are not powers of two (the bucketed plans' padded
// requests), at the lengths around the KV page size B (1, B-1, B, B+1, ...). Each run also
// counts the calls each engine really ran, so a silent fallback to ours fails; automatic's
// per-step rule is checked the same way. Skipped (not failed) without a CUDA device; label
// "gpu". Without cuDNN in the build, only the refusal of the cuDNN engines is tested.
//
// Tolerances: both engines round P and the output to bf16 and accumulate in f32, in different
// orders: o differs by about one bf16 ulp (2^-9 relative) in some elements, which the three
// layers carry to a logit error of about 4e-3 per row (H200: medians 3.8e-3 - 5.3e-3 at
// D = 128; D = 64 matched bitwise). That ulp also flips near-tied MoE routing choices or
// selected blocks, which move a whole row (H200: up to 4 of 389 rows, by 0.56 - 0.72, taking
// the whole tensor to 0.06). The bars: the median row under 1e-2 (the CPU comparisons' bar),
// at most 5% of the rows (at least one) over 2e-2, the whole tensor under 0.1. A mask off by
// one key or a wrong request offset moves most rows by far more (a control test below shows
// that another prompt is far above the bars).
#include <gtest/gtest.h>

#include <algorithm>
#include <iostream>
#include <map>
#include <memory>

#include "cli_runner.h"
#include "model/gpu/cuda_model.h"
#include "model/layer_layout.h"
#include "msa/model.h"
#include "msa/model_random.h"
#include "gpu_checks.h"
#include "test_util.h"
#include "three_layer_model.h"

namespace msa {
namespace {

namespace fs = std::filesystem;
using model::gpu::CudaModel;
using testing::fresh_dir;
using testing::relative_error;
using testing::some_tokens;

#define MSA_REQUIRE_CUDNN()          \
  MSA_REQUIRE_CUDA();                \
  if (!dense_attention_cudnn_built()) GTEST_SKIP() << "this build has no cuDNN"

// One dense attention + dense MLP layer, two MSA + MoE layers (k * B = 256: longer contexts
// select blocks, shorter ones run the MSA layers dense too).
ModelConfig small_config(int64_t head_dim, int block) {
  ModelConfig shape{.vocab_size = 512, .hidden_size = 256, .num_heads = 8, .num_kv_heads = 2,
                    .head_dim = head_dim, .rotary_dim = 32, .dense_intermediate_size = 384,
                    .moe_intermediate_size = 128, .shared_intermediate_size = 128,
                    .num_experts = 8, .experts_per_token = 2, .index_heads = 2,
                    .index_head_dim = 64, .block_size = block, .topk_blocks = 256 / block};
  return testing::three_layer_model(shape);
}

// "d64b64" (D = 64, B = 64, group 4) and "d128b128" (M3's D and B).
struct Loaded {
  Model host;
  std::shared_ptr<CudaModel> cuda;
};
Loaded& loaded(const std::string& name) {
  // Never destroyed: device state must not be torn down from static destructors.
  static auto& models = *new std::map<std::string, std::unique_ptr<Loaded>>();
  auto found = models.find(name);
  if (found != models.end()) return *found->second;
  const ModelConfig config = name == "d64b64" ? small_config(64, 64) : small_config(128, 128);
  const fs::path dir = fresh_dir("dense_engine_" + name);
  write_random_checkpoint(config, dir.string(), {.seed = 21, .dtype = DType::bf16});
  Model host = Model::load(dir.string(), Device::cpu);
  auto cuda = model::gpu::make_cuda_model(host.config(), host.weights());
  // Every step eager: decode graphs run their attention through DecodePlan (ours) whatever
  // the engine.
  cuda->set_decode_graphs(false);
  return *models.emplace(name, std::make_unique<Loaded>(Loaded{std::move(host), std::move(cuda)}))
              .first->second;
}

// A scenario: steps of (request, tokens appended) pairs; request r's tokens come from its
// own stream, so both engines see identical inputs.
using Step = std::vector<std::pair<int, int64_t>>;
using Scenario = std::vector<Step>;

struct EngineRun {
  Tensor logits;  // every step's logits (all tokens), rows concatenated
  CudaModel::DenseAttentionCalls calls;
};

EngineRun run_scenario(CudaModel& model, DenseAttentionEngine engine, const Scenario& scenario, bool msa_dense,
                 int32_t salt = 0) {
  const ModelConfig& c = model.config();
  int requests = 0;
  int64_t total = 0;
  for (const Step& step : scenario)
    for (const auto& [r, n] : step) {
      requests = std::max(requests, r + 1);
      total += n;
    }
  KvCache cache(c, total / c.block_size + 4 * requests + 4, DType::bf16, Device::cuda);
  std::vector<SequenceCache> sequences(static_cast<size_t>(requests));
  std::vector<std::vector<int32_t>> streams;
  for (int r = 0; r < requests; ++r) streams.push_back(some_tokens(total, c.vocab_size, 100 * r + salt));
  model.set_dense_attention_engine(engine);
  model.set_dense_attention(msa_dense);
  const CudaModel::DenseAttentionCalls before = model.dense_attention_calls();
  std::vector<float> rows;
  for (const Step& step : scenario) {
    std::vector<ForwardRequest> batch;
    for (const auto& [r, n] : step) {
      const std::vector<int32_t>& stream = streams[static_cast<size_t>(r)];
      SequenceCache& sequence = sequences[static_cast<size_t>(r)];
      batch.push_back({.sequence = &sequence,
                       .tokens = std::span(stream).subspan(static_cast<size_t>(sequence.length), static_cast<size_t>(n)),
                       .all_logits = true});
    }
    const Tensor logits = model.forward(batch, cache);
    rows.insert(rows.end(), logits.data<float>(), logits.data<float>() + logits.numel());
  }
  model.set_dense_attention(false);
  model.set_dense_attention_engine(DenseAttentionEngine::automatic);
  const CudaModel::DenseAttentionCalls after = model.dense_attention_calls();
  const int64_t n_rows = static_cast<int64_t>(rows.size()) / c.vocab_size;
  return {Tensor::from_vector(rows, {n_rows, c.vocab_size}),
          {.msa = after.msa - before.msa,
           .cudnn = after.cudnn - before.cudnn,
           .cudnn_gathered = after.cudnn_gathered - before.cudnn_gathered}};
}

Tensor row_of(const Tensor& t, int64_t r) { return t.slice0(r, r + 1).clone(); }

// The bars of the header; every number printed.
void expect_engines_agree(const Tensor& cudnn, const Tensor& ours, const std::string& what) {
  ASSERT_EQ(cudnn.shape(), ours.shape()) << what;
  const int64_t rows = ours.size(0);
  std::vector<double> errors;
  int64_t bad = 0;
  for (int64_t r = 0; r < rows; ++r) {
    errors.push_back(relative_error(row_of(cudnn, r), row_of(ours, r)));
    bad += !(errors.back() < 2e-2);
  }
  std::vector<double> sorted = errors;
  std::sort(sorted.begin(), sorted.end());
  const double median = sorted[sorted.size() / 2], error = relative_error(cudnn, ours);
  std::cout << "[ engines ] " << what << ": relative L2 error " << error << ", median row " << median
            << ", worst row " << sorted.back() << ", " << bad << " of " << rows << " rows above 2e-2\n";
  EXPECT_LT(median, 1e-2) << what;
  EXPECT_LT(error, 0.1) << what;
  EXPECT_LE(bad, std::max<int64_t>(1, rows / 20)) << what;
}

// Runs `scenario` with ours and with each cuDNN engine (and with the MSA layers forced dense,
// when asked) and compares; each cuDNN engine must have run every dense call.
void compare_engines(const std::string& model_name, const Scenario& scenario, const std::string& what,
                     bool msa_dense = false) {
  CudaModel& model = *loaded(model_name).cuda;
  const EngineRun ours = run_scenario(model, DenseAttentionEngine::msa, scenario, msa_dense);
  EXPECT_EQ(ours.calls.cudnn + ours.calls.cudnn_gathered, 0) << what;
  EXPECT_GT(ours.calls.msa, 0) << what;
  const EngineRun paged = run_scenario(model, DenseAttentionEngine::cudnn, scenario, msa_dense);
  EXPECT_EQ(paged.calls.msa + paged.calls.cudnn_gathered, 0) << what << ": dense calls that did not run on cudnn";
  EXPECT_EQ(paged.calls.cudnn, ours.calls.msa) << what;
  expect_engines_agree(paged.logits, ours.logits, model_name + " cudnn " + what);
  const EngineRun gathered = run_scenario(model, DenseAttentionEngine::cudnn_gathered, scenario, msa_dense);
  EXPECT_EQ(gathered.calls.msa + gathered.calls.cudnn, 0) << what << ": dense calls that did not run gathered";
  EXPECT_EQ(gathered.calls.cudnn_gathered, ours.calls.msa) << what;
  expect_engines_agree(gathered.logits, ours.logits, model_name + " cudnn-gathered " + what);
}

class DenseEngine : public ::testing::TestWithParam<std::string> {
 protected:
  int64_t B() { return loaded(GetParam()).host.config().block_size; }
};

TEST_P(DenseEngine, SinglePrefillAtLengthsAroundThePageSize) {
  MSA_REQUIRE_CUDNN();
  const int64_t b = B();
  for (int64_t n : {int64_t{1}, b - 1, b, b + 1, 3 * b + 5})
    compare_engines(GetParam(), {{{0, n}}}, "prefill of " + std::to_string(n));
}

TEST_P(DenseEngine, PrefillThenDecode) {
  MSA_REQUIRE_CUDNN();
  const int64_t b = B();
  Scenario s{{{0, b - 2}}};
  for (int i = 0; i < 4; ++i) s.push_back({{0, 1}});  // crosses the page boundary at B
  compare_engines(GetParam(), s, "prefill of B-2, then 4 decode steps");
}

TEST_P(DenseEngine, MixedStepsOfPrefillChunksAndDecodeRows) {
  MSA_REQUIRE_CUDNN();
  const int64_t b = B();
  const Scenario s{{{0, b - 1}, {1, 2 * b + 3}},        // two prefills of different lengths
                   {{2, b + 1}, {0, 1}, {1, 1}},        // a chunk while two decode
                   {{0, 1}, {2, 37}, {1, 1}},           // the next chunk, between them
                   {{0, 1}, {1, 1}, {2, 1}}};           // all decode
  compare_engines(GetParam(), s, "mixed steps");
  // The MSA layers forced dense (CudaModel::set_dense_attention): the same steps through
  // every layer's dense path.
  compare_engines(GetParam(), s, "mixed steps, MSA layers dense", /*msa_dense=*/true);
}

TEST_P(DenseEngine, SeveralRequestsInOneStep) {
  MSA_REQUIRE_CUDNN();
  const int64_t b = B();
  // 5 requests: a bucket of 8 with three padded requests; then 5 decode rows.
  const Scenario s{{{0, 1}, {1, b - 1}, {2, b}, {3, b + 1}, {4, 2 * b}},
                   {{0, 1}, {1, 1}, {2, 1}, {3, 1}, {4, 1}}};
  compare_engines(GetParam(), s, "5 requests of 1, B-1, B, B+1, 2B, then a decode step");
}

// The metric sees another prompt (the bars are far below what a change of context does).
TEST_P(DenseEngine, TheComparisonSeesAnotherPrompt) {
  MSA_REQUIRE_CUDNN();
  CudaModel& model = *loaded(GetParam()).cuda;
  const Scenario s{{{0, B() + 1}}};
  for (DenseAttentionEngine engine : {DenseAttentionEngine::cudnn, DenseAttentionEngine::cudnn_gathered}) {
    const EngineRun a = run_scenario(model, engine, s, false, /*salt=*/0);
    const EngineRun b = run_scenario(model, engine, s, false, /*salt=*/1);
    EXPECT_GT(relative_error(a.logits, b.logits), 5e-2) << dense_attention_engine_name(engine);
  }
}

// automatic, step by step (automatic_dense_engine): the prefill of 2B - 12 >= 64 tokens on
// gathered cuDNN, the decode steps after it on ours; a prefill of 63 tokens on ours. Its logits
// agree with ours throughout.
TEST_P(DenseEngine, AutomaticRunsGatheredCudnnForPrefillAndOursForDecode) {
  MSA_REQUIRE_CUDNN();
  CudaModel& model = *loaded(GetParam()).cuda;
  const Scenario prefill{{{0, 2 * B() - 12}}};
  Scenario s = prefill;
  for (int i = 0; i < 24; ++i) s.push_back({{0, 1}});
  const EngineRun ours = run_scenario(model, DenseAttentionEngine::msa, s, false);
  const EngineRun prefill_ours = run_scenario(model, DenseAttentionEngine::msa, prefill, false);
  const EngineRun automatic = run_scenario(model, DenseAttentionEngine::automatic, s, false);
  EXPECT_EQ(automatic.calls.cudnn, 0);
  EXPECT_EQ(automatic.calls.cudnn_gathered, prefill_ours.calls.msa) << "every dense call of the prefill";
  EXPECT_EQ(automatic.calls.msa, ours.calls.msa - prefill_ours.calls.msa) << "every dense call of the decode steps";
  expect_engines_agree(automatic.logits, ours.logits, GetParam() + " automatic, prefill then 24 decode steps");
  const EngineRun short_prefill = run_scenario(model, DenseAttentionEngine::automatic,
                                               {{{0, model::gpu::kGatheredCudnnMinQueries - 1}}}, false);
  EXPECT_EQ(short_prefill.calls.cudnn_gathered, 0);
  EXPECT_GT(short_prefill.calls.msa, 0);
}

// cuDNN's bucketed plans stay few, for either engine: 24 decode steps of growing length after
// a prefill add at most 3 plans (the paged engine: one prefill, decode at page-table strides
// 2, 4; the gathered engine: one prefill, decode at key-count buckets of the two powers of two
// the lengths cross).
TEST_P(DenseEngine, CudnnPlansStayFew) {
  MSA_REQUIRE_CUDNN();
  CudaModel& model = *loaded(GetParam()).cuda;
  Scenario s{{{0, 2 * B() - 12}}};
  for (int i = 0; i < 24; ++i) s.push_back({{0, 1}});
  for (DenseAttentionEngine engine : {DenseAttentionEngine::cudnn, DenseAttentionEngine::cudnn_gathered}) {
    const int64_t plans_before = model.cudnn_dense_plans();
    const EngineRun run = run_scenario(model, engine, s, false);
    EXPECT_EQ(run.calls.msa, 0) << dense_attention_engine_name(engine);
    EXPECT_GT(run.calls.cudnn + run.calls.cudnn_gathered, 0) << dense_attention_engine_name(engine);
    EXPECT_LE(model.cudnn_dense_plans() - plans_before, 3)
        << dense_attention_engine_name(engine) << ": one prefill plan and at most two decode plans";
  }
}

// The rule itself (no device needed): gathered cuDNN from kGatheredCudnnMinQueries queries,
// only with cuDNN in the build and offsets that fit; ours otherwise.
TEST(DenseEngineRule, AutomaticByTheStepsLongestQueryRun) {
  using model::gpu::automatic_dense_engine;
  using model::gpu::kGatheredCudnnMinQueries;
  const int64_t at = kGatheredCudnnMinQueries;
  EXPECT_EQ(automatic_dense_engine(1, true, true), DenseAttentionEngine::msa);
  EXPECT_EQ(automatic_dense_engine(at - 1, true, true), DenseAttentionEngine::msa);
  EXPECT_EQ(automatic_dense_engine(at, true, true), DenseAttentionEngine::cudnn_gathered);
  EXPECT_EQ(automatic_dense_engine(int64_t{1} << 20, true, true), DenseAttentionEngine::cudnn_gathered);
  EXPECT_EQ(automatic_dense_engine(int64_t{1} << 20, false, true), DenseAttentionEngine::msa);
  EXPECT_EQ(automatic_dense_engine(int64_t{1} << 20, true, false), DenseAttentionEngine::msa);
}

INSTANTIATE_TEST_SUITE_P(Models, DenseEngine, ::testing::Values("d64b64", "d128b128"));

// Without cuDNN in the build, cudnn and cudnn_gathered are refused (never a silent fallback
// to ours).
TEST(DenseEngineRefusal, CudnnWithoutCudnnThrows) {
  MSA_REQUIRE_CUDA();
  if (dense_attention_cudnn_built()) GTEST_SKIP() << "this build has cuDNN";
  CudaModel& model = *loaded("d64b64").cuda;
  EXPECT_THROW(model.set_dense_attention_engine(DenseAttentionEngine::cudnn), Error);
  EXPECT_THROW(model.set_dense_attention_engine(DenseAttentionEngine::cudnn_gathered), Error);
  EXPECT_EQ(model.dense_attention_engine(), DenseAttentionEngine::automatic);
}

}  // namespace
}  // namespace msa
