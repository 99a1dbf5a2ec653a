// Text generation over msa::Model: requests with their own prompts, lengths and sampling,
// run together (chunked prefill and decode in the same steps) over one paged KV cache.
//
//   msa::Engine engine(model, {.cache_tokens = 8192});
//   engine.submit({.prompt = {1, 2, 3}, .max_tokens = 32});
//   while (!engine.idle())
//     for (const msa::TokenEvent& event : engine.step()) print(event.token);
#pragma once
#include <cstdint>
#include <deque>
#include <memory>
#include <random>
#include <span>
#include <vector>

#include "msa/model.h"

namespace msa {

struct SamplingParams {
  double temperature = 0;  // 0: greedy (argmax, ties to the lower id)
  int top_k = 0;           // 0: no top-k filter
  double top_p = 1;        // 1: no nucleus filter
  uint64_t seed = 0;
};

// Picks tokens from logits: temperature, then top-k, then top-p (transformers' order).
class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);
  int32_t sample(std::span<const float> logits);

 private:
  SamplingParams params_;
  std::mt19937_64 rng_;
};

struct GenerationRequest {
  std::vector<int32_t> prompt;
  int64_t max_tokens = 16;            // tokens to generate at most (>= 1)
  SamplingParams sampling;
  std::vector<int32_t> stop_tokens;   // generation ends after emitting one of these
};

enum class FinishReason { none, stop_token, max_tokens };

struct TokenEvent {
  int64_t request = 0;  // the id submit() returned
  int32_t token = 0;
  FinishReason finish = FinishReason::none;  // set on the request's last token
};

struct EngineOptions {
  int64_t cache_tokens = 0;       // KV cache capacity in tokens (0: 4096)
  int64_t prefill_chunk = 256;    // prompt tokens per request per step
  int64_t max_step_tokens = 2048; // new tokens of all requests in one step
  DType cache_dtype = DType::f32; // KV/index-key cache elements: f32 or bf16 (half the memory);
                                  // bf16 for a CUDA model (the cache lives on its device)
};

struct EngineStats {
  int64_t prefill_tokens = 0;
  double prefill_seconds = 0;  // steps that carried prompt tokens
  int64_t decode_tokens = 0;
  double decode_seconds = 0;   // steps that carried only decode tokens
};

class Engine {
 public:
  Engine(const Model& model, const EngineOptions& options);
  ~Engine();

  // Queues a request; returns its id. Throws msa::Error when the request can never fit in
  // the cache (prompt + max_tokens larger than its capacity) or is malformed.
  int64_t submit(GenerationRequest request);
  bool idle() const;
  // Runs one forward step over the running requests; returns the tokens it produced.
  std::vector<TokenEvent> step();

  const EngineStats& stats() const { return stats_; }
  const KvCache& cache() const { return cache_; }

 private:
  struct Running;
  void admit();

  const Model& model_;
  EngineOptions options_;
  KvCache cache_;
  std::deque<std::pair<int64_t, GenerationRequest>> waiting_;
  std::vector<std::unique_ptr<Running>> running_;
  int64_t next_id_ = 0;
  EngineStats stats_;
};

}  // namespace msa
