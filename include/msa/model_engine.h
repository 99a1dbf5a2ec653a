// Text generation over msa::Model: requests with their own prompts, lengths and sampling,
// run together (chunked prefill and decode in the same steps) over one paged KV cache.
//
//   msa::Engine engine(model, {.cache_tokens = 8192});
//   engine.submit({.prompt = {1, 2, 3}, .max_tokens = 32});
//   while (!engine.idle())
//     for (const msa::TokenEvent& event : engine.step()) print(event.token);
//
// The same engine over N tensor-parallel ranks (in-process threads, msa/parallel_group.h):
//
//   msa::LocalParallelGroup group(dir, 4);
//   msa::Engine engine(group, {.cache_tokens = 8192});
#pragma once
#include <cstdint>
#include <deque>
#include <memory>
#include <random>
#include <span>
#include <vector>

#include "msa/model.h"

namespace msa {

class PrefixCache;  // src/model/prefix_cache.h

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
  // Images and videos: rows (Model::encode_vision) for prompt positions [first_token,
  // first_token + n), each an image or video placeholder (place_visual_rows builds them from
  // the prompt). Prefill chunks slice them (a chunk may end inside an image). Blocks from the
  // first visual position on are never shared through the prefix cache (the same
  // placeholder tokens stand for different images).
  std::vector<VisualRows> visual;
};

enum class FinishReason { none, stop_token, max_tokens };

struct TokenEvent {
  int64_t request = 0;  // the id submit() returned
  int32_t token = 0;
  FinishReason finish = FinishReason::none;  // set on the request's last token
  int64_t cached_tokens = 0;  // prompt tokens the request took from the prefix cache
};

// What an Engine runs its steps on: one msa::Model (SingleEngineModel; Engine(const Model&)
// wraps it), or a group of tensor-parallel ranks (LocalParallelGroup, msa/parallel_group.h).
// The engine owns the cache make_cache() returns, allocates and frees its pages (admission,
// the prefix cache, retirement) and passes it to every forward(); `ids` name the step's
// requests (the engine's ids, the same over a request's steps) so that a group can keep its
// other ranks' copies of each request's page table, and release(id) tells it a request left.
// Called from one thread (the engine's).
class EngineModel {
 public:
  virtual ~EngineModel() = default;
  virtual const ModelConfig& config() const = 0;  // the whole model's
  // The cache of `num_pages` pages of `dtype` the engine allocates from (for a group: rank
  // 0's, of its KV heads; the other ranks make theirs of the same pages).
  virtual KvCache make_cache(int64_t num_pages, DType dtype) = 0;
  // Whether requests may carry visual rows (GenerationRequest::visual).
  virtual bool accepts_visual() const = 0;
  // One step, as Model::forward: the requests' new K/V into `cache` (and every rank's), their
  // lengths advanced, f32 logits returned. ids.size() == requests.size().
  virtual Tensor forward(std::span<const ForwardRequest> requests, std::span<const int64_t> ids,
                         KvCache& cache) = 0;
  // Request `id` gave its pages back (to the free list or the prefix cache) and takes no more
  // steps. Never throws.
  virtual void release(int64_t id) noexcept = 0;
};

// One msa::Model (not owned: it must outlive this).
class SingleEngineModel final : public EngineModel {
 public:
  explicit SingleEngineModel(const Model& model) : model_(model) {}
  const ModelConfig& config() const override { return model_.config(); }
  KvCache make_cache(int64_t num_pages, DType dtype) override;
  bool accepts_visual() const override { return true; }
  Tensor forward(std::span<const ForwardRequest> requests, std::span<const int64_t> ids,
                 KvCache& cache) override;
  void release(int64_t) noexcept override {}

 private:
  const Model& model_;
};

struct EngineOptions {
  int64_t cache_tokens = 0;       // KV cache capacity in tokens (0: 4096)
  int64_t prefill_chunk = 256;    // prompt tokens per request per step
  int64_t max_step_tokens = 2048; // new tokens of all requests in one step
  DType cache_dtype = DType::f32; // KV/index-key cache elements: f32, bf16 (half the memory) or
                                  // e4m3 (fp8 K/V, bf16 index keys; msa/model_kv_cache.h); bf16
                                  // for a CUDA model (the cache lives on its device)
  int64_t max_running = 0;        // requests running at once (0: as many as the cache holds)
  // Keep whole pages of finished prompts (and generated text) and give them to later requests
  // whose prompts start with the same blocks (src/model/prefix_cache.h). Exact: a page holds
  // the same values whoever computes it.
  bool prefix_caching = false;
};

struct EngineStats {
  int64_t prefill_tokens = 0;
  double prefill_seconds = 0;  // steps that carried prompt tokens
  int64_t decode_tokens = 0;
  double decode_seconds = 0;   // steps that carried only decode tokens
  int64_t decode_steps = 0;    // steps that carried only decode tokens
  int64_t cached_prompt_tokens = 0;  // prompt tokens taken from the prefix cache
  double last_step_seconds = 0;      // the latest step's forward and sampling
  bool last_step_decode_only = false;
};

// Where the KV cache's pages are: held by requests, kept by the prefix cache for later
// requests (no request holds them; they are given back when the free list runs out), free.
struct CachePages {
  int64_t total = 0, used = 0, cached = 0, free = 0;
};

class Engine {
 public:
  Engine(const Model& model, const EngineOptions& options);
  // Steps `model` (not owned: it must outlive the engine).
  Engine(EngineModel& model, const EngineOptions& options);
  ~Engine();

  // Queues a request; returns its id. Throws msa::Error when the request can never fit in
  // the cache (prompt + max_tokens larger than its capacity) or is malformed.
  int64_t submit(GenerationRequest request);
  bool idle() const;
  // Runs one forward step over the running requests; returns the tokens it produced.
  std::vector<TokenEvent> step();
  // Ends a waiting or running request now (a client went away, a stop string matched): its
  // pages go back to the cache before the next step. Returns whether the id was known.
  bool cancel(int64_t id);

  const EngineStats& stats() const { return stats_; }
  const KvCache& cache() const { return cache_; }
  int64_t waiting() const { return static_cast<int64_t>(waiting_.size()); }
  int64_t running() const { return static_cast<int64_t>(running_.size()); }
  CachePages pages() const;
  // Tokens one request may hold at most (prompt + max_tokens): the cache's capacity.
  int64_t capacity_tokens() const { return cache_.num_pages() * cache_.page_size(); }

 private:
  struct Running;
  Engine(std::unique_ptr<EngineModel> owned, EngineModel* model, const EngineOptions& options);
  void admit();
  // Gives the request's pages back (keeping its whole blocks in the prefix cache, if on).
  void retire(Running& running);

  std::unique_ptr<EngineModel> owned_model_;  // Engine(const Model&)'s SingleEngineModel
  EngineModel& model_;
  EngineOptions options_;
  KvCache cache_;
  std::deque<std::pair<int64_t, GenerationRequest>> waiting_;
  std::vector<std::unique_ptr<Running>> running_;
  int64_t next_id_ = 0;
  EngineStats stats_;
  std::unique_ptr<PrefixCache> prefix_;  // when options_.prefix_caching
};

}  // namespace msa
