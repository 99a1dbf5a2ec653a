// msa::Engine over a group of in-process tensor-parallel ranks (msa/parallel_group.h,
// docs/parallel.md "Serving") against the engine over the single-rank msa::Model on the made
// tiny-tp model: the same greedy tokens for concurrent requests (chunked prefill mixed with
// decode, requests finishing at different times, pages released and reused, prefix-cache
// sharing), and errors: world sizes the model cannot take, a rank failing mid-step.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <stdexcept>

#include "cli_runner.h"
#include "msa/model.h"
#include "msa/model_engine.h"
#include "msa/model_random.h"
#include "msa/parallel_group.h"
#include "test_util.h"

namespace msa {
namespace {

namespace fs = std::filesystem;
using testing::error_of;

// tiny-tp: 8 query / 4 KV / 4 index heads, 1 dense + 1 MSA/MoE layer, 8 experts, pages of 16
// tokens, top-4 blocks (so prompts past 64 tokens select), f32.
std::string tiny_tp_dir() { return testing::made_model_dir("engine_tiny_tp", "tiny-tp", 5, DType::f32).string(); }

const Model& single_model() {
  static const Model model = Model::load(tiny_tp_dir());
  return model;
}

std::vector<int32_t> tokens(int64_t n, int32_t salt) {
  std::vector<int32_t> t;
  for (int64_t i = 0; i < n; ++i) t.push_back(static_cast<int32_t>((i * 37 + salt * 11 + 5) % 509 + 3));
  return t;
}

struct Outcome {
  std::map<int64_t, std::vector<int32_t>> tokens;
  std::map<int64_t, int64_t> cached;  // prompt tokens each request took from the prefix cache
  int64_t steps = 0;
};

// Submits `requests` (the first `at_once` at the start, the rest after `later_step` steps) and
// runs the engine until idle.
Outcome run_engine(Engine& engine, const std::vector<GenerationRequest>& requests, size_t at_once,
                   int64_t later_step) {
  Outcome out;
  for (size_t i = 0; i < at_once; ++i) engine.submit(requests[i]);
  while (!engine.idle() || out.steps <= later_step) {
    if (out.steps == later_step)
      for (size_t i = at_once; i < requests.size(); ++i) engine.submit(requests[i]);
    for (const TokenEvent& e : engine.step()) {
      out.tokens[e.request].push_back(e.token);
      out.cached[e.request] = e.cached_tokens;
    }
    ++out.steps;
  }
  return out;
}

// Prompts of 90 (past top-k's 64 tokens), 37, 5, 130 and 20 tokens, 3 to 14 new tokens each,
// so requests end at different steps; the cache (12 pages of 16) holds only some at once, so
// later ones wait for earlier ones' pages.
std::vector<GenerationRequest> mixed_requests() {
  const std::pair<int64_t, int64_t> shapes[] = {{90, 6}, {37, 14}, {5, 3}, {130, 9}, {20, 11}};
  std::vector<GenerationRequest> requests;
  int32_t salt = 1;
  for (const auto& [prompt, max_tokens] : shapes)
    requests.push_back({.prompt = tokens(prompt, salt++), .max_tokens = max_tokens});
  return requests;
}

constexpr EngineOptions kMixed{.cache_tokens = 192, .prefill_chunk = 24, .max_step_tokens = 64};

TEST(ParallelEngine, TwoAndFourRanksGiveTheSingleModelsGreedyTokens) {
  const std::vector<GenerationRequest> requests = mixed_requests();
  Engine single(single_model(), kMixed);
  const Outcome want = run_engine(single, requests, 3, 4);
  ASSERT_EQ(want.tokens.size(), requests.size());
  for (int world : {2, 4}) {
    LocalParallelGroup group(tiny_tp_dir(), world, {.threads_per_rank = 1});
    EXPECT_EQ(group.rank_config(0).num_kv_heads, 4 / world);
    Engine engine(group, kMixed);
    const Outcome got = run_engine(engine, requests, 3, 4);
    EXPECT_EQ(got.tokens, want.tokens) << world << " ranks";
    EXPECT_EQ(got.steps, want.steps) << world << " ranks";
    EXPECT_EQ(engine.pages().used, 0);
    // Requests that left are forgotten by every rank at the next step.
    engine.submit({.prompt = tokens(3, 9), .max_tokens = 1});
    engine.step();
    EXPECT_EQ(group.mirrored_requests(), std::vector<int64_t>(world - 1, 1)) << world << " ranks";
  }
}

TEST(ParallelEngine, PrefixCacheSharesTheSamePagesOnEveryRank) {
  // A 70-token system prompt (4 whole pages) shared by four requests, the first alone first.
  const std::vector<int32_t> system = tokens(70, 1);
  std::vector<GenerationRequest> requests;
  for (int i = 0; i < 4; ++i) {
    std::vector<int32_t> prompt = system;
    const std::vector<int32_t> own = tokens(10 + 7 * i, 10 + i);
    prompt.insert(prompt.end(), own.begin(), own.end());
    requests.push_back({.prompt = prompt, .max_tokens = 5 + i});
  }
  const EngineOptions options{.cache_tokens = 512, .prefill_chunk = 32, .prefix_caching = true};
  Engine single(single_model(), options);
  const Outcome want = run_engine(single, requests, 1, 8);
  for (size_t i = 1; i < requests.size(); ++i) EXPECT_EQ(want.cached.at(static_cast<int64_t>(i)), 64) << i;
  LocalParallelGroup group(tiny_tp_dir(), 2, {.threads_per_rank = 1});
  Engine engine(group, options);
  const Outcome got = run_engine(engine, requests, 1, 8);
  EXPECT_EQ(got.tokens, want.tokens);
  EXPECT_EQ(got.cached, want.cached);
  EXPECT_EQ(engine.pages().used, 0);
}

TEST(ParallelEngine, WorldSizesTheModelCannotTakeAreNamed) {
  EXPECT_NE(error_of([] { LocalParallelGroup group(tiny_tp_dir(), 3); }).find("config.num_key_value_heads"),
            std::string::npos);
  EXPECT_NE(error_of([] { LocalParallelGroup group(tiny_tp_dir(), 0); }).find("world_size"), std::string::npos);
  EXPECT_NE(error_of([] { LocalParallelGroup group("/nonexistent/model", 2); }).find("/nonexistent/model"),
            std::string::npos);
}

TEST(ParallelEngine, ARankFailingMidStepIsAnErrorNamingItNotAHang) {
  for (int failing : {0, 1, 3}) {
    LocalParallelGroup group(tiny_tp_dir(), 4,
                             {.threads_per_rank = 1, .before_rank_forward = [failing](int rank, int64_t step) {
                                if (rank == failing && step == 2) throw std::runtime_error("injected failure");
                              }});
    Engine engine(group, kMixed);
    const std::vector<GenerationRequest> requests = mixed_requests();
    for (size_t i = 0; i < 3; ++i) engine.submit(requests[i]);
    engine.step();
    engine.step();
    const std::string error = error_of([&] { engine.step(); });
    EXPECT_NE(error.find("rank " + std::to_string(failing) + ": injected failure"), std::string::npos) << error;
    // The group stays failed: later steps say so at once; the engine can still cancel.
    EXPECT_NE(error_of([&] { engine.step(); }).find("stopped after an error"), std::string::npos);
    for (int64_t id = 0; id < 3; ++id) engine.cancel(id);
    EXPECT_TRUE(engine.idle());
  }
}

TEST(ParallelEngine, VisualRowsAreRefused) {
  LocalParallelGroup group(tiny_tp_dir(), 2, {.threads_per_rank = 1});
  Engine engine(group, {.cache_tokens = 64});
  GenerationRequest request{.prompt = tokens(8, 1), .max_tokens = 1};
  request.visual.push_back({.first_token = 2, .rows = Tensor::zeros({1, single_model().config().hidden_size}, DType::f32)});
  EXPECT_NE(error_of([&] { engine.submit(request); }).find("visual"), std::string::npos);
}

}  // namespace
}  // namespace msa
