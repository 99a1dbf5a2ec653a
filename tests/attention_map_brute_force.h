// The attention-map statistics by brute force (plain loops over heads, queries and keys, no
// shared code with src/model/attention_map.cpp), from the taps of one CPU prefill; shared by
// test_attention_map.cpp and test_cli_attn_map.cpp.
#pragma once
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "msa/attention_map.h"
#include "msa/model.h"

namespace msa::testing {

// Every tap of one prefill of `tokens` from position 0 (copies), by name.
inline std::map<std::string, Tensor> tap_one_prefill(const Model& model, const std::vector<int32_t>& tokens) {
  const int64_t T = static_cast<int64_t>(tokens.size());
  KvCache cache(model.config(), (T + model.config().block_size - 1) / model.config().block_size);
  SequenceCache sequence;
  std::map<std::string, Tensor> taps;
  const ForwardRequest request{.sequence = &sequence, .tokens = tokens, .all_logits = false};
  model.forward({&request, 1}, cache,
                [&](const std::string& name, const Tensor& value) { taps[name] = value.clone(); });
  return taps;
}

struct BruteForceLayer {
  double mass = 0;         // visual_mass_share
  double block_share = 0;  // selected_visual_block_share (MSA layers)
  std::vector<double> heat;
};

// One layer's (a), (b), (c) over `spec` (resolved) from its taps, the definitions written out:
// for each chosen head r (group g = r / (Hq / Hkv)) and text query i, the keys are t <= i
// (dense) or t <= i in a block listed in topk[g, i, :] (MSA); P = softmax(scale * q.k) over
// them; mass = sum of P over span tokens; a block is "visual" when a span token t <= i lies
// in it.
inline BruteForceLayer brute_force_layer(const std::map<std::string, Tensor>& taps, const ModelConfig& config,
                                         int64_t layer, const AttentionMapSpec& spec) {
  const std::string name = "layers." + std::to_string(layer);
  const Tensor& q = taps.at(name + ".q");
  const Tensor& k = taps.at(name + ".k");
  const bool sparse = config.sparse_layers[layer];
  const Tensor topk = sparse ? taps.at(name + ".topk") : Tensor();
  const int64_t Hq = q.size(1), D = q.size(2), Hkv = k.size(1), B = config.block_size;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const int64_t span = spec.span_end - spec.span_begin;
  BruteForceLayer out;
  out.heat.assign(span, 0.0);
  int64_t pairs = 0;
  for (int64_t r : spec.heads) {
    const int64_t g = r / (Hq / Hkv);
    for (int64_t i = spec.query_begin; i < spec.query_end; ++i) {
      std::vector<int64_t> blocks;  // the row's valid entries
      if (sparse)
        for (int64_t s = 0; s < topk.size(2); ++s) {
          const int64_t id = static_cast<int64_t>(topk.get((g * topk.size(1) + i) * topk.size(2) + s));
          if (id >= 0) blocks.push_back(id);
        }
      std::vector<bool> allowed(i + 1, !sparse);
      for (int64_t id : blocks)
        for (int64_t t = 0; t <= i; ++t)
          if (t / B == id) allowed[t] = true;
      std::vector<double> logit(i + 1, 0.0);
      double max_logit = -INFINITY;
      for (int64_t t = 0; t <= i; ++t) {
        if (!allowed[t]) continue;
        double dot = 0;
        for (int64_t d = 0; d < D; ++d) dot += q.get((i * Hq + r) * D + d) * k.get((t * Hkv + g) * D + d);
        logit[t] = scale * dot;
        max_logit = std::max(max_logit, logit[t]);
      }
      double z = 0;
      for (int64_t t = 0; t <= i; ++t)
        if (allowed[t]) z += std::exp(logit[t] - max_logit);
      for (int64_t t = spec.span_begin; t < spec.span_end && t <= i; ++t) {
        const double p = allowed[t] ? std::exp(logit[t] - max_logit) / z : 0.0;
        out.mass += p;
        out.heat[t - spec.span_begin] += p;
      }
      if (sparse) {
        int64_t visual = 0;
        for (int64_t id : blocks) {
          bool holds = false;
          for (int64_t t = spec.span_begin; t < spec.span_end; ++t) holds = holds || (t <= i && t / B == id);
          visual += holds;
        }
        out.block_share += static_cast<double>(visual) / static_cast<double>(blocks.size());
      }
      ++pairs;
    }
  }
  out.mass /= pairs;
  out.block_share /= pairs;
  for (double& h : out.heat) h /= pairs;
  return out;
}

}  // namespace msa::testing
