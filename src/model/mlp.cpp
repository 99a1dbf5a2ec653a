// The FFN half of a decoder layer: the clamped SwiGLU-OAI MLP and the sigmoid-routed MoE
// (correction bias for selection only, top-k weights renormalised and scaled, plus the
// unweighted shared expert).
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "layers.h"
#include "tensor_math.h"

namespace msa::model {

void mlp_forward(const float* x, int64_t rows, const ExpertWeights& w, const ModelConfig& c,
                 float* out) {
  // Experts kept quantized are the CUDA model's (WeightLoadOptions); the CPU reads bf16.
  if (w.is_quantized())
    throw Error(std::string("the CPU model cannot run routed experts kept ") +
                quantized_format_name(w.quantized.format()) +
                " (load the weights with RoutedExperts::dequantized for the CPU)");
  const int64_t inter = w.gate.size(0);
  std::vector<float> gate(rows * inter), up(rows * inter);
  linear(x, rows, w.gate, gate.data());
  linear(x, rows, w.up, up.data());
  swiglu_oai(gate.data(), up.data(), rows * inter, static_cast<float>(c.swiglu_alpha),
             static_cast<float>(c.swiglu_limit));
  linear(gate.data(), rows, w.down, out);
}

std::vector<ExpertChoice> route_tokens(const float* xn, int64_t T, const LayerWeights& w,
                                       const ModelConfig& c) {
  const int64_t E = c.num_experts, K = c.experts_per_token;
  std::vector<float> logits(T * E);
  linear(xn, T, w.router, logits.data());
  const float* bias = w.router_bias.data<float>();

  // Per token the top-K experts by sigmoid + bias (ties to the lower id), weighted by the
  // sigmoid alone, renormalised to 1 and times routed_scaling_factor.
  std::vector<ExpertChoice> choices(T * K);
  std::vector<float> scores(E), choice(E);
  std::vector<int64_t> order(E);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      scores[e] = 1.0f / (1.0f + std::exp(-logits[t * E + e]));
      choice[e] = scores[e] + bias[e];
    }
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + K, order.end(), [&](int64_t a, int64_t b) {
      return choice[a] > choice[b] || (choice[a] == choice[b] && a < b);
    });
    float sum = 0;
    for (int64_t j = 0; j < K; ++j) sum += scores[order[j]];
    for (int64_t j = 0; j < K; ++j)
      choices[t * K + j] = {.expert = static_cast<int32_t>(order[j]),
                            .weight = scores[order[j]] / sum * static_cast<float>(c.routed_scaling_factor)};
  }
  return choices;
}

void moe_forward(const float* xn, int64_t T, const LayerWeights& w, const ModelConfig& c,
                 float* out, int32_t* chosen) {
  const int64_t H = c.hidden_size, E = c.num_experts, K = c.experts_per_token;
  const std::vector<ExpertChoice> choices = route_tokens(xn, T, w, c);
  std::vector<std::vector<std::pair<int64_t, float>>> routed(E);  // expert -> (token, weight)
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < K; ++j) {
      const ExpertChoice& pick = choices[t * K + j];
      if (chosen) chosen[t * K + j] = pick.expert;
      routed[pick.expert].emplace_back(t, pick.weight);
    }

  if (w.shared_expert.down.defined()) mlp_forward(xn, T, w.shared_expert, c, out);
  else std::fill_n(out, T * H, 0.0f);

  std::vector<float> gathered, result;
  for (int64_t e = 0; e < E; ++e) {
    const auto& tokens = routed[e];
    if (tokens.empty()) continue;
    const int64_t n = static_cast<int64_t>(tokens.size());
    gathered.resize(n * H);
    result.resize(n * H);
    for (int64_t i = 0; i < n; ++i)
      std::copy_n(xn + tokens[i].first * H, H, gathered.data() + i * H);
    mlp_forward(gathered.data(), n, w.experts[e], c, result.data());
    for (int64_t i = 0; i < n; ++i) {
      float* row = out + tokens[i].first * H;
      const float weight = tokens[i].second;
      for (int64_t h = 0; h < H; ++h) row[h] += weight * result[i * H + h];
    }
  }
}

}  // namespace msa::model
