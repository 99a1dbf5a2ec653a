// Token sampling: greedy, temperature, top-k, top-p.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "msa/model_engine.h"

namespace msa {

Sampler::Sampler(const SamplingParams& params) : params_(params), rng_(params.seed) {
  MSA_CHECK_ARG(params.temperature >= 0, "temperature", "a value >= 0", params.temperature);
  MSA_CHECK_ARG(params.top_k >= 0, "top_k", "a value >= 0", params.top_k);
  MSA_CHECK_ARG(params.top_p > 0 && params.top_p <= 1, "top_p", "a value in (0, 1]", params.top_p);
}

int32_t Sampler::sample(std::span<const float> logits) {
  const int64_t vocab = static_cast<int64_t>(logits.size());
  if (params_.temperature == 0)
    return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  // Candidates sorted by logit (descending, ties to the lower id), cut by top-k.
  std::vector<int32_t> ids(vocab);
  std::iota(ids.begin(), ids.end(), 0);
  const int64_t keep = params_.top_k > 0 ? std::min<int64_t>(params_.top_k, vocab) : vocab;
  // NaN ranks as -inf so that the order stays strict weak (the engine refuses non-finite
  // logits before sampling; this keeps a direct caller's sort defined).
  auto key = [&](int32_t id) {
    const float x = logits[id];
    return x != x ? -std::numeric_limits<float>::infinity() : x;
  };
  auto by_logit = [&](int32_t a, int32_t b) {
    const float x = key(a), y = key(b);
    return x > y || (x == y && a < b);
  };
  std::partial_sort(ids.begin(), ids.begin() + keep, ids.end(), by_logit);
  ids.resize(keep);
  std::vector<double> probs(keep);
  const double top = logits[ids[0]] / params_.temperature;
  double sum = 0;
  for (int64_t i = 0; i < keep; ++i) sum += probs[i] = std::exp(logits[ids[i]] / params_.temperature - top);
  // Nucleus: the smallest prefix whose probability reaches top_p (at least one token).
  int64_t count = keep;
  if (params_.top_p < 1) {
    double cumulative = 0;
    for (int64_t i = 0; i < keep; ++i) {
      cumulative += probs[i] / sum;
      if (cumulative >= params_.top_p) {
        count = i + 1;
        break;
      }
    }
  }
  double total = 0;
  for (int64_t i = 0; i < count; ++i) total += probs[i];
  double u = std::uniform_real_distribution<double>(0, total)(rng_);
  for (int64_t i = 0; i < count; ++i) {
    u -= probs[i];
    if (u < 0) return ids[i];
  }
  return ids[count - 1];
}

}  // namespace msa
