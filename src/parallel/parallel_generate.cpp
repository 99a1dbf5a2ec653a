// Generating one request with the tensor- / expert-parallel model (msa/parallel_model.h).
#include <algorithm>
#include <chrono>

#include "msa/parallel_model.h"

namespace msa {

std::vector<int32_t> generate_on_rank(const ParallelModel& model, const GenerationRequest& request,
                                      const ParallelGenerateOptions& options,
                                      const std::function<void(int32_t)>& on_token,
                                      EngineStats* stats) {
  const int64_t prompt = static_cast<int64_t>(request.prompt.size());
  MSA_CHECK_ARG(prompt >= 1, "request.prompt", "at least one token", prompt);
  MSA_CHECK_ARG(request.max_tokens >= 1, "request.max_tokens", "at least 1", request.max_tokens);
  MSA_CHECK_ARG(request.visual.empty(), "request.visual",
                "no images or videos (the parallel model runs text only)", request.visual.size());
  MSA_CHECK_ARG(options.prefill_chunk >= 1, "prefill_chunk", "at least 1", options.prefill_chunk);
  const int64_t needed = prompt + request.max_tokens;
  const int64_t capacity = options.cache_tokens > 0 ? options.cache_tokens : needed;
  if (needed > capacity)
    throw Error("request of " + std::to_string(prompt) + " prompt + " +
                std::to_string(request.max_tokens) + " new tokens does not fit in a cache of " +
                std::to_string(capacity) + " tokens");
  const int64_t block = model.config().block_size;
  // The CUDA model's cache holds bf16 or e4m3 pages (what its kernels read): f32 means bf16 there.
  const bool cuda = model.device() == Device::cuda;
  const DType dtype = cuda && options.cache_dtype == DType::f32 ? DType::bf16 : options.cache_dtype;
  KvCache cache(model.rank_config(), (capacity + block - 1) / block, dtype, model.device());
  SequenceCache sequence;
  Sampler sampler(request.sampling);
  EngineStats local;
  using Clock = std::chrono::steady_clock;
  const auto seconds_since = [](Clock::time_point start) {
    return std::chrono::duration<double>(Clock::now() - start).count();
  };
  std::vector<int32_t> generated;
  Tensor logits;
  const auto prefill_start = Clock::now();
  for (int64_t begin = 0; begin < prompt; begin += options.prefill_chunk) {
    const int64_t end = std::min(prompt, begin + options.prefill_chunk);
    const ForwardRequest step{.sequence = &sequence,
                              .tokens = std::span(request.prompt).subspan(begin, end - begin)};
    logits = model.forward({&step, 1}, cache);
  }
  local.prefill_tokens = prompt;
  local.prefill_seconds = seconds_since(prefill_start);
  const auto decode_start = Clock::now();
  while (true) {
    const int32_t token = sampler.sample(logits.span<float>());
    generated.push_back(token);
    if (on_token) on_token(token);
    const bool stop = std::find(request.stop_tokens.begin(), request.stop_tokens.end(), token) !=
                      request.stop_tokens.end();
    if (stop || static_cast<int64_t>(generated.size()) >= request.max_tokens) break;
    const ForwardRequest step{.sequence = &sequence, .tokens = std::span(&generated.back(), 1)};
    logits = model.forward({&step, 1}, cache);
    ++local.decode_tokens;
    ++local.decode_steps;
  }
  local.decode_seconds = seconds_since(decode_start);
  if (stats) *stats = local;
  return generated;
}

}  // namespace msa
