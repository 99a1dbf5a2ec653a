// The scheduler: admits requests while the cache has room for their whole generation,
// then each step packs one prefill chunk per prefilling request and one token per decoding
// request into a single forward, samples, and retires finished requests.
#include <algorithm>
#include <chrono>
#include <limits>
#include <set>

#include "msa/model_engine.h"
#include "prefix_cache.h"
#include "step_batch.h"

namespace msa {

struct Engine::Running {
  int64_t id;
  GenerationRequest request;
  Sampler sampler;
  SequenceCache sequence;
  int64_t prompt_done = 0;  // prompt tokens already in the cache
  int64_t generated = 0;
  int32_t last_token = -1;  // the token to feed next while decoding
  std::vector<int32_t> step_tokens;
  std::vector<VisualRows> step_visual;  // the prefill chunk's part of request.visual
  int64_t cached_tokens = 0;      // prompt tokens taken from the prefix cache
  std::vector<int32_t> generated_tokens;
  bool prompt_registered = false;  // its prompt's whole blocks are in the prefix cache
};

KvCache SingleEngineModel::make_cache(int64_t num_pages, DType dtype) {
  return KvCache(model_.config(), num_pages, dtype, model_.device());
}

Tensor SingleEngineModel::forward(std::span<const ForwardRequest> requests, std::span<const int64_t>,
                                  KvCache& cache) {
  return model_.forward(requests, cache);
}

Engine::Engine(const Model& model, const EngineOptions& options)
    : Engine(std::make_unique<SingleEngineModel>(model), nullptr, options) {}

Engine::Engine(EngineModel& model, const EngineOptions& options) : Engine(nullptr, &model, options) {}

Engine::Engine(std::unique_ptr<EngineModel> owned, EngineModel* model, const EngineOptions& options)
    : owned_model_(std::move(owned)),
      model_(model ? *model : *owned_model_),
      options_(options),
      cache_(model_.make_cache(
          (std::max<int64_t>(options.cache_tokens > 0 ? options.cache_tokens : 4096, 1) +
           model_.config().block_size - 1) /
              model_.config().block_size,
          options.cache_dtype)) {
  MSA_CHECK_ARG(options.prefill_chunk >= 1, "prefill_chunk", "at least 1", options.prefill_chunk);
  MSA_CHECK_ARG(options.max_step_tokens >= 1, "max_step_tokens", "at least 1",
                options.max_step_tokens);
  MSA_CHECK_ARG(options.max_running >= 0, "max_running", "at least 0", options.max_running);
  if (options.prefix_caching) prefix_ = std::make_unique<PrefixCache>(cache_.page_size());
}

Engine::~Engine() = default;

namespace {
// Tokens before the request's first visual row (all of them when it has none): the part
// whose K/V depend on the token ids alone, so whose whole blocks the prefix cache may share.
int64_t shareable_tokens(const GenerationRequest& request) {
  int64_t end = std::numeric_limits<int64_t>::max();
  for (const VisualRows& rows : request.visual) end = std::min(end, rows.first_token);
  return end;
}
}  // namespace

int64_t Engine::submit(GenerationRequest request) {
  MSA_CHECK_ARG(!request.prompt.empty(), "prompt", "at least one token", 0);
  MSA_CHECK_ARG(request.max_tokens >= 1, "max_tokens", "at least 1", request.max_tokens);
  const int64_t vocab = model_.config().vocab_size;
  for (size_t i = 0; i < request.prompt.size(); ++i)
    if (request.prompt[i] < 0 || request.prompt[i] >= vocab)
      throw_arg_error("prompt[" + std::to_string(i) + "]",
                      "a token id in [0, " + std::to_string(vocab) + ")", request.prompt[i]);
  const int64_t tokens = static_cast<int64_t>(request.prompt.size()) + request.max_tokens;
  if (cache_.pages_for(tokens) > cache_.num_pages())
    throw Error("request does not fit in the KV cache: prompt (" +
                std::to_string(request.prompt.size()) + ") + max_tokens (" +
                std::to_string(request.max_tokens) + ") = " + std::to_string(tokens) +
                " tokens, the cache holds " +
                std::to_string(cache_.num_pages() * cache_.page_size()) +
                " tokens; raise the cache size (--cache-tokens)");
  Sampler check(request.sampling);  // validates the sampling parameters now
  MSA_CHECK_ARG(request.visual.empty() || model_.accepts_visual(), "visual",
                "no images or videos (a tensor-parallel model runs text only)", request.visual.size());
  // The visual rows against the whole prompt, as a forward step would check them.
  model::check_visual_rows(request.visual, request.prompt, model_.config(), "visual", 0);
  std::sort(request.visual.begin(), request.visual.end(),
            [](const VisualRows& a, const VisualRows& b) { return a.first_token < b.first_token; });
  const int64_t id = next_id_++;
  waiting_.emplace_back(id, std::move(request));
  admit();
  return id;
}

bool Engine::idle() const { return waiting_.empty() && running_.empty(); }

void Engine::admit() {
  // First come, first served; a request waits until its whole generation fits.
  while (!waiting_.empty()) {
    if (options_.max_running > 0 && static_cast<int64_t>(running_.size()) >= options_.max_running)
      break;
    auto& [id, next] = waiting_.front();
    const int64_t prompt = static_cast<int64_t>(next.prompt.size());
    const int64_t tokens = prompt + next.max_tokens;
    // Cached whole blocks of the prompt, leaving at least its last token to compute: the
    // first sampled token needs that token's logits.
    std::vector<int32_t> shared;
    if (prefix_) shared = prefix_->acquire(next.prompt, std::min(prompt - 1, shareable_tokens(next)));
    const int64_t needed = cache_.pages_for(tokens) - static_cast<int64_t>(shared.size());
    const int64_t reclaimable = prefix_ ? prefix_->evictable_pages() : 0;
    if (needed > cache_.free_pages() + reclaimable) {
      if (prefix_) prefix_->release(shared);  // all cached: nothing goes to the free list
      break;
    }
    if (needed > cache_.free_pages()) cache_.release_pages(prefix_->evict(needed - cache_.free_pages()));
    const SamplingParams sampling = next.sampling;
    auto running = std::make_unique<Running>(
        Running{.id = id, .request = std::move(next), .sampler = Sampler(sampling), .sequence = {},
                .step_tokens = {}, .step_visual = {}, .generated_tokens = {}});
    running->sequence.pages = shared;
    running->sequence.length = static_cast<int64_t>(shared.size()) * cache_.page_size();
    running->prompt_done = running->cached_tokens = running->sequence.length;
    stats_.cached_prompt_tokens += running->cached_tokens;
    cache_.reserve(running->sequence, tokens);
    running_.push_back(std::move(running));
    waiting_.pop_front();
  }
}

void Engine::retire(Running& r) {
  model_.release(r.id);
  if (!prefix_) {
    cache_.release(r.sequence);
    return;
  }
  // The tokens whose K/V are in the cache: the prompt, then the generated tokens fed back.
  std::vector<int32_t> held = r.request.prompt;
  held.insert(held.end(), r.generated_tokens.begin(), r.generated_tokens.end());
  held.resize(static_cast<size_t>(std::min<int64_t>(
      {r.sequence.length, static_cast<int64_t>(held.size()), shareable_tokens(r.request)})));
  prefix_->insert(held, r.sequence.pages, r.sequence.length / cache_.page_size());
  cache_.release_pages(prefix_->release(r.sequence.pages));
  r.sequence.pages.clear();
  r.sequence.length = 0;
}

bool Engine::cancel(int64_t id) {
  for (auto it = waiting_.begin(); it != waiting_.end(); ++it)
    if (it->first == id) {
      waiting_.erase(it);
      return true;
    }
  for (auto it = running_.begin(); it != running_.end(); ++it)
    if ((*it)->id == id) {
      retire(**it);
      running_.erase(it);
      admit();
      return true;
    }
  return false;
}

CachePages Engine::pages() const {
  CachePages p;
  p.total = cache_.num_pages();
  p.free = cache_.free_pages();
  p.cached = prefix_ ? prefix_->evictable_pages() : 0;
  p.used = p.total - p.free - p.cached;
  return p;
}

std::vector<TokenEvent> Engine::step() {
  admit();
  std::vector<ForwardRequest> forward;
  std::vector<int64_t> ids;
  std::vector<Running*> in_step;
  int64_t budget = options_.max_step_tokens, prompt_tokens = 0, decode_tokens = 0;
  for (auto& r : running_) {
    if (budget <= 0) break;
    const int64_t prompt_left = static_cast<int64_t>(r->request.prompt.size()) - r->prompt_done;
    if (prompt_left > 0) {
      const int64_t n = std::min({prompt_left, options_.prefill_chunk, budget});
      r->step_tokens.assign(r->request.prompt.begin() + r->prompt_done,
                            r->request.prompt.begin() + r->prompt_done + n);
      r->step_visual = visual_rows_in_range(r->request.visual, r->prompt_done, r->prompt_done + n);
      prompt_tokens += n;
    } else {
      r->step_tokens = {r->last_token};
      r->step_visual.clear();
      ++decode_tokens;
    }
    budget -= static_cast<int64_t>(r->step_tokens.size());
    forward.push_back({.sequence = &r->sequence, .tokens = r->step_tokens, .all_logits = false,
                       .visual = r->step_visual});
    ids.push_back(r->id);
    in_step.push_back(r.get());
  }
  if (forward.empty()) return {};

  const auto start = std::chrono::steady_clock::now();
  const Tensor logits = model_.forward(forward, ids, cache_);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (prompt_tokens > 0) {
    stats_.prefill_tokens += prompt_tokens;
    stats_.prefill_seconds += seconds;
  } else {
    stats_.decode_tokens += decode_tokens;
    stats_.decode_seconds += seconds;
    ++stats_.decode_steps;
  }
  stats_.last_step_seconds = seconds;
  stats_.last_step_decode_only = prompt_tokens == 0;

  std::vector<TokenEvent> events;
  const int64_t vocab = model_.config().vocab_size;
  std::set<int64_t> finished;
  for (size_t i = 0; i < in_step.size(); ++i) {
    Running& r = *in_step[i];
    const bool was_prefill = r.prompt_done < static_cast<int64_t>(r.request.prompt.size());
    if (was_prefill) {
      r.prompt_done += static_cast<int64_t>(r.step_tokens.size());
      if (r.prompt_done < static_cast<int64_t>(r.request.prompt.size())) continue;  // more prompt
      // The whole prompt is in the cache: its whole blocks can serve requests that arrive
      // while this one still decodes (a shared system prompt).
      if (prefix_ && !r.prompt_registered) {
        prefix_->insert(r.request.prompt, r.sequence.pages,
                        shareable_tokens(r.request) / cache_.page_size());
        r.prompt_registered = true;
      }
    }
    const float* row = logits.data<float>() + static_cast<int64_t>(i) * vocab;
    // Sampling from NaN logits would emit arbitrary tokens with no word of why.
    if (const int64_t at = first_non_finite(logits, static_cast<int64_t>(i) * vocab, vocab); at >= 0)
      throw Error("request " + std::to_string(r.id) + ": the model's logits are not finite (" +
                  std::to_string(logits.get(at)) + " for token id " +
                  std::to_string(at - static_cast<int64_t>(i) * vocab) +
                  "); the checkpoint may hold non-finite weights (msa run --check-weights "
                  "scans them)");
    const int32_t token = r.sampler.sample({row, static_cast<size_t>(vocab)});
    r.last_token = token;
    ++r.generated;
    r.generated_tokens.push_back(token);
    TokenEvent event{.request = r.id, .token = token, .cached_tokens = r.cached_tokens};
    if (std::find(r.request.stop_tokens.begin(), r.request.stop_tokens.end(), token) !=
        r.request.stop_tokens.end())
      event.finish = FinishReason::stop_token;
    else if (r.generated >= r.request.max_tokens)
      event.finish = FinishReason::max_tokens;
    if (event.finish != FinishReason::none) finished.insert(r.id);
    events.push_back(event);
  }
  for (auto it = running_.begin(); it != running_.end();) {
    if (finished.count((*it)->id)) {
      retire(**it);
      it = running_.erase(it);
    } else {
      ++it;
    }
  }
  admit();
  return events;
}

}  // namespace msa
