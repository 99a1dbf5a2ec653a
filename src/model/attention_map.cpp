// Attention maps (include/msa/attention_map.h): the probabilities of the text queries,
// recomputed from the q / k / topk taps of the CPU forward, and the per-layer statistics over
// a span of tokens. The rendering is attention_map_png.cpp.
#include "msa/attention_map.h"

#include <omp.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <string>

namespace msa {
namespace {

// Queries per unit of parallel work. Partial sums are kept per chunk and added in chunk
// order, so the f64 results do not depend on how many threads ran the chunks.
constexpr int64_t kQueryChunk = 16;
// The chunks of one wave keep a heatmap each; waves bound that memory (f64 values).
constexpr int64_t kWaveHeatmapValues = int64_t{1} << 22;

std::string range_text(int64_t begin, int64_t end) {
  return std::to_string(begin) + ":" + std::to_string(end);
}

// The inputs after their checks, as raw pointers.
struct CheckedInputs {
  const float* q = nullptr;     // [T, Hq, D]
  const float* k = nullptr;     // [T, Hkv, D]
  const int32_t* topk = nullptr;  // [Hkv, T, K] or null (dense)
  int64_t T = 0, Hq = 0, Hkv = 0, D = 0, group = 0, K = 0, B = 0;
  double scale = 0;
};

CheckedInputs check_inputs(const LayerAttentionInputs& in) {
  const auto check_float = [](const Tensor& t, const char* name, const char* layout) {
    MSA_CHECK_ARG(t.defined() && t.device() == Device::cpu && t.dim() == 3 &&
                      t.dtype() == DType::f32 && t.is_contiguous(),
                  name, std::string("a contiguous f32 CPU tensor ") + layout,
                  t.defined() ? std::string(dtype_name(t.dtype())) + " " + shape_string(t.shape())
                              : std::string("an undefined tensor"));
  };
  check_float(in.q, "q", "[T, Hq, D]");
  check_float(in.k, "k", "[T, Hkv, D]");
  CheckedInputs c;
  c.T = in.q.size(0);
  c.Hq = in.q.size(1);
  c.D = in.q.size(2);
  c.Hkv = in.k.size(1);
  MSA_CHECK_ARG(in.k.size(0) == c.T && in.k.size(2) == c.D && c.Hkv >= 1 && c.Hq % c.Hkv == 0, "k",
                "[T, Hkv, D] matching q " + shape_string(in.q.shape()) + " with Hq a multiple of Hkv",
                shape_string(in.k.shape()));
  MSA_CHECK_ARG(in.block_size >= 1, "block_size", "at least 1", in.block_size);
  MSA_CHECK_ARG(std::isfinite(in.scale), "scale", "a finite number (0: 1/sqrt(D))", in.scale);
  c.q = in.q.data<float>();
  c.k = in.k.data<float>();
  c.group = c.Hq / c.Hkv;
  c.B = in.block_size;
  c.scale = in.scale != 0 ? in.scale : 1.0 / std::sqrt(static_cast<double>(c.D));
  if (in.topk.defined()) {
    MSA_CHECK_ARG(in.topk.device() == Device::cpu && in.topk.dtype() == DType::i32 &&
                      in.topk.dim() == 3 && in.topk.is_contiguous() && in.topk.size(0) == c.Hkv &&
                      in.topk.size(1) == c.T && in.topk.size(2) >= 1,
                  "topk",
                  "a contiguous int32 CPU tensor [Hkv, T, k] = [" + std::to_string(c.Hkv) + ", " +
                      std::to_string(c.T) + ", k]",
                  std::string(dtype_name(in.topk.dtype())) + " " + shape_string(in.topk.shape()));
    c.topk = in.topk.data<int32_t>();
    c.K = in.topk.size(2);
  }
  return c;
}

const int32_t* selection_row(const CheckedInputs& c, int64_t head, int64_t query) {
  return c.topk + ((head / c.group) * c.T + query) * c.K;
}

// Throws unless the row of (head's group, query) is well formed (docs/msa.md §3.3): ids in
// [0, query / B], no repeats, -1 only as a suffix.
void check_row(const CheckedInputs& c, int64_t head, int64_t query) {
  const int32_t* row = selection_row(c, head, query);
  const int64_t own_block = query / c.B;
  bool ended = false;
  for (int64_t s = 0; s < c.K; ++s) {
    const std::string where = "topk[" + std::to_string(head / c.group) + ", " +
                              std::to_string(query) + ", " + std::to_string(s) + "]";
    if (row[s] == -1) {
      ended = true;
      continue;
    }
    MSA_CHECK_ARG(!ended, where, "-1 (the -1 padding is a suffix)", row[s]);
    MSA_CHECK_ARG(row[s] >= 0 && row[s] <= own_block, where,
                  "a block id in [0, " + std::to_string(own_block) + "] or -1", row[s]);
    for (int64_t before = 0; before < s; ++before)
      MSA_CHECK_ARG(row[before] != row[s], where, "a block not listed before in its row", row[s]);
  }
}

// Calls visit(t) for every key the (head, query) row attends to: every t <= query on dense
// layers, the keys t <= query of the selected blocks on MSA layers. The row was checked.
template <class Visit>
void for_each_key(const CheckedInputs& c, int64_t head, int64_t query, Visit visit) {
  if (!c.topk) {
    for (int64_t t = 0; t <= query; ++t) visit(t);
    return;
  }
  const int32_t* row = selection_row(c, head, query);
  for (int64_t s = 0; s < c.K && row[s] >= 0; ++s) {
    const int64_t end = std::min((row[s] + int64_t{1}) * c.B, query + 1);
    for (int64_t t = row[s] * c.B; t < end; ++t) visit(t);
  }
}

// P over [0, query] into p (query + 1 values; 0 on keys the row does not attend to).
void row_probabilities(const CheckedInputs& c, int64_t head, int64_t query, double* p) {
  std::fill(p, p + query + 1, 0.0);
  const float* q_row = c.q + (query * c.Hq + head) * c.D;
  const int64_t g = head / c.group;
  double max_logit = -INFINITY;
  for_each_key(c, head, query, [&](int64_t t) {
    const float* k_row = c.k + (t * c.Hkv + g) * c.D;
    double dot = 0;
    for (int64_t d = 0; d < c.D; ++d) dot += static_cast<double>(q_row[d]) * k_row[d];
    p[t] = c.scale * dot;
    max_logit = std::max(max_logit, p[t]);
  });
  if (max_logit == -INFINITY) return;  // no keys (a row of -1 only): no mass anywhere
  double sum = 0;
  for_each_key(c, head, query, [&](int64_t t) {
    p[t] = std::exp(p[t] - max_logit);
    sum += p[t];
  });
  for_each_key(c, head, query, [&](int64_t t) { p[t] /= sum; });
}

// One chunk's partial sums.
struct Partial {
  double mass = 0, block_share = 0;
  double* heat = nullptr;  // [span]
};

}  // namespace

AttentionMapSpec resolve_attention_map_spec(const AttentionMapSpec& spec, const ModelConfig& config,
                                            int64_t tokens) {
  MSA_CHECK_ARG(tokens >= 1, "tokens", "a prompt of at least 1 token", tokens);
  AttentionMapSpec out = spec;
  const std::string prompt = " (the prompt has " + std::to_string(tokens) + " tokens)";
  MSA_CHECK_ARG(spec.span_begin >= 0 && spec.span_begin < spec.span_end && spec.span_end <= tokens,
                "span", "a non-empty token range A:B with 0 <= A < B <= " + std::to_string(tokens) + prompt,
                range_text(spec.span_begin, spec.span_end));
  const int64_t span = spec.span_end - spec.span_begin;
  MSA_CHECK_ARG(spec.grid_rows >= 1 && spec.grid_cols >= 1 && spec.grid_rows <= span &&
                    spec.grid_cols <= span && spec.grid_rows * spec.grid_cols == span,
                "grid", "rows x cols = " + std::to_string(span) + ", the span's length",
                std::to_string(spec.grid_rows) + "x" + std::to_string(spec.grid_cols));
  if (spec.query_begin == -1 && spec.query_end == -1) {
    out.query_begin = spec.span_end;
    out.query_end = tokens;
    MSA_CHECK_ARG(out.query_begin < out.query_end, "queries",
                  "text queries after the span (it ends the prompt: give a query range)",
                  "none after the span " + range_text(spec.span_begin, spec.span_end) + prompt);
  } else {
    MSA_CHECK_ARG(spec.query_begin >= 0 && spec.query_begin < spec.query_end && spec.query_end <= tokens,
                  "queries", "a non-empty token range C:D with 0 <= C < D <= " + std::to_string(tokens) + prompt,
                  range_text(spec.query_begin, spec.query_end));
  }
  const auto check_list = [](const std::vector<int64_t>& list, const char* name, int64_t count,
                             const char* what) {
    for (size_t i = 0; i < list.size(); ++i) {
      MSA_CHECK_ARG(list[i] >= 0 && list[i] < count, name,
                    std::string(what) + " in [0, " + std::to_string(count) + ")", list[i]);
      if (i > 0)
        MSA_CHECK_ARG(list[i] > list[i - 1], name, "ascending values without repeats",
                      std::to_string(list[i - 1]) + " then " + std::to_string(list[i]));
    }
  };
  check_list(spec.layers, "layers", config.num_layers, "layer ids");
  check_list(spec.heads, "heads", config.num_heads, "query head ids");
  if (out.layers.empty())
    for (int64_t l = 0; l < config.num_layers; ++l) out.layers.push_back(l);
  if (out.heads.empty())
    for (int64_t h = 0; h < config.num_heads; ++h) out.heads.push_back(h);
  return out;
}

void attention_probabilities(const LayerAttentionInputs& inputs, int64_t head, int64_t query,
                             std::span<double> p) {
  const CheckedInputs c = check_inputs(inputs);
  MSA_CHECK_ARG(head >= 0 && head < c.Hq, "head", "a query head in [0, " + std::to_string(c.Hq) + ")", head);
  MSA_CHECK_ARG(query >= 0 && query < c.T, "query", "a position in [0, " + std::to_string(c.T) + ")", query);
  MSA_CHECK_ARG(static_cast<int64_t>(p.size()) == query + 1, "p",
                std::to_string(query + 1) + " values (query + 1)", p.size());
  if (c.topk) check_row(c, head, query);
  row_probabilities(c, head, query, p.data());
}

LayerAttentionMap measure_layer_attention(const LayerAttentionInputs& inputs,
                                          const AttentionMapSpec& spec, int64_t layer, bool sparse) {
  const CheckedInputs c = check_inputs(inputs);
  MSA_CHECK_ARG(sparse == (c.topk != nullptr), "topk",
                sparse ? "the selection rows of an MSA layer" : "none on a dense layer",
                c.topk ? "rows" : "none");
  const int64_t A = spec.span_begin, E = spec.span_end, span = E - A;
  const int64_t Q0 = spec.query_begin, Q1 = spec.query_end;
  MSA_CHECK_ARG(A >= 0 && A < E && E <= c.T, "span", "a range within the " + std::to_string(c.T) + " tapped tokens",
                range_text(A, E));
  MSA_CHECK_ARG(spec.grid_rows >= 1 && spec.grid_cols >= 1 && spec.grid_rows <= span && spec.grid_cols <= span &&
                    spec.grid_rows * spec.grid_cols == span,
                "grid", "rows x cols = the span's length",
                std::to_string(spec.grid_rows) + "x" + std::to_string(spec.grid_cols));
  MSA_CHECK_ARG(Q0 >= 0 && Q0 < Q1 && Q1 <= c.T, "queries",
                "a resolved range within the " + std::to_string(c.T) + " tapped tokens", range_text(Q0, Q1));
  MSA_CHECK_ARG(!spec.heads.empty(), "heads", "a resolved, non-empty list", "none");
  for (int64_t head : spec.heads)
    MSA_CHECK_ARG(head >= 0 && head < c.Hq, "heads", "query heads in [0, " + std::to_string(c.Hq) + ")", head);
  // Every row is checked before the parallel loop (nothing may throw inside it).
  if (c.topk)
    for (int64_t i = Q0; i < Q1; ++i)
      for (int64_t head : spec.heads) check_row(c, head, i);

  const int64_t queries = Q1 - Q0, chunks = (queries + kQueryChunk - 1) / kQueryChunk;
  const int64_t wave = std::clamp<int64_t>(kWaveHeatmapValues / span, 1, chunks);
  std::vector<double> heat_buffers(wave * span);
  std::vector<Partial> partials(wave);
  const int threads = omp_get_max_threads();
  std::vector<double> row_buffers(threads * c.T);  // one P row per thread
  LayerAttentionMap out{.layer = layer, .sparse = sparse};
  out.heatmap.assign(span, 0.0);
  double mass = 0, block_share = 0;
  for (int64_t first = 0; first < chunks; first += wave) {
    const int64_t count = std::min(wave, chunks - first);
#pragma omp parallel num_threads(threads)
    {
      double* p = row_buffers.data() + omp_get_thread_num() * c.T;
#pragma omp for schedule(dynamic)
      for (int64_t w = 0; w < count; ++w) {
        Partial& part = partials[w];
        part = Partial{.heat = heat_buffers.data() + w * span};
        std::fill(part.heat, part.heat + span, 0.0);
        const int64_t begin = Q0 + (first + w) * kQueryChunk, end = std::min(Q1, begin + kQueryChunk);
        for (int64_t i = begin; i < end; ++i) {
          const int64_t visible_end = std::min(E, i + 1);  // span keys t <= i
          for (int64_t head : spec.heads) {
            row_probabilities(c, head, i, p);
            for (int64_t t = A; t < visible_end; ++t) {
              part.mass += p[t];
              part.heat[t - A] += p[t];
            }
            if (!c.topk) continue;
            const int32_t* row = selection_row(c, head, i);
            int64_t selected = 0, visual = 0;
            for (int64_t s = 0; s < c.K && row[s] >= 0; ++s) {
              ++selected;
              const int64_t lo = std::max<int64_t>(row[s] * c.B, A);
              const int64_t hi = std::min((row[s] + int64_t{1}) * c.B, visible_end);
              visual += lo < hi;
            }
            if (selected > 0) part.block_share += static_cast<double>(visual) / selected;
          }
        }
      }
    }
    for (int64_t w = 0; w < count; ++w) {  // in chunk order: deterministic sums
      mass += partials[w].mass;
      block_share += partials[w].block_share;
      for (int64_t t = 0; t < span; ++t) out.heatmap[t] += partials[w].heat[t];
    }
  }
  const double pairs = static_cast<double>(queries) * static_cast<double>(spec.heads.size());
  out.visual_mass_share = mass / pairs;
  if (sparse) out.selected_visual_block_share = block_share / pairs;
  for (double& value : out.heatmap) value /= pairs;
  return out;
}

AttentionMapRecorder::AttentionMapRecorder(const ModelConfig& config, int64_t tokens,
                                           const AttentionMapSpec& spec)
    : config_(config), tokens_(tokens), spec_(resolve_attention_map_spec(spec, config, tokens)) {}

ForwardTap AttentionMapRecorder::tap() {
  return [this](const std::string& name, const Tensor& value) { observe(name, value); };
}

void AttentionMapRecorder::observe(const std::string& name, const Tensor& value) {
  // Names "layers.N.q", "layers.N.k", "layers.N.topk"; everything else passes by.
  constexpr std::string_view prefix = "layers.";
  if (!name.starts_with(prefix)) return;
  const size_t dot = name.find('.', prefix.size());
  if (dot == std::string::npos) return;
  const std::string part = name.substr(dot + 1);
  if (part != "q" && part != "k" && part != "topk") return;
  int64_t layer = -1;
  const char* digits = name.data() + prefix.size();
  if (std::from_chars(digits, name.data() + dot, layer).ptr != name.data() + dot) return;
  if (!std::binary_search(spec_.layers.begin(), spec_.layers.end(), layer)) return;
  if (layer != current_) {  // a new layer: what an earlier one left incomplete is dropped
    current_ = layer;
    q_ = k_ = topk_ = Tensor();
  }
  if (part != "topk")
    MSA_CHECK_ARG(value.dim() == 3 && value.size(0) == tokens_, name,
                  "the whole prompt of " + std::to_string(tokens_) +
                      " tokens in one step (rows [T, heads, D])",
                  shape_string(value.shape()));
  // The tapped tensors are views of the forward's scratch buffers: keep copies.
  (part == "q" ? q_ : part == "k" ? k_ : topk_) = value.clone();
  const bool sparse = config_.sparse_layers[layer];
  if (!q_.defined() || !k_.defined() || (sparse && !topk_.defined())) return;
  const LayerAttentionInputs inputs{.q = q_, .k = k_, .topk = sparse ? topk_ : Tensor(),
                                    .block_size = config_.block_size,
                                    .scale = config_.msa_params().scale};
  done_.push_back(measure_layer_attention(inputs, spec_, layer, sparse));
  q_ = k_ = topk_ = Tensor();
  current_ = -1;
}

std::vector<LayerAttentionMap> AttentionMapRecorder::finish() {
  std::vector<LayerAttentionMap> out;
  for (int64_t layer : spec_.layers) {
    const auto found = std::find_if(done_.begin(), done_.end(),
                                    [&](const LayerAttentionMap& m) { return m.layer == layer; });
    if (found == done_.end())
      throw Error("attention map of layer " + std::to_string(layer) +
                  ": the forward did not tap its q, k" +
                  (config_.sparse_layers[layer] ? " and topk" : "") +
                  " for the whole prompt (the CPU forward taps them; run one prefill step)");
    out.push_back(*found);
  }
  return out;
}

AttentionMap measure_attention_map(const Model& model, std::span<const int32_t> tokens,
                                   const AttentionMapSpec& spec, std::span<const VisualRows> visual) {
  MSA_CHECK_ARG(model.device() == Device::cpu, "model", "a model on the CPU (the CPU forward taps q and k)",
                device_name(model.device()));
  const ModelConfig& config = model.config();
  const int64_t T = static_cast<int64_t>(tokens.size());
  AttentionMapRecorder recorder(config, T, spec);
  AttentionMap map;
  map.spec = resolve_attention_map_spec(spec, config, T);
  map.tokens = T;
  KvCache cache(config, (T + config.block_size - 1) / config.block_size, DType::f32);
  SequenceCache sequence;
  const ForwardRequest request{
      .sequence = &sequence, .tokens = tokens, .all_logits = false, .visual = visual};
  model.forward({&request, 1}, cache, recorder.tap());
  map.layers = recorder.finish();
  const AttentionMapSpec& s = map.spec;
  for (int64_t i = s.query_begin; i < s.query_end; ++i) {
    const int64_t visible = std::max<int64_t>(0, std::min(s.span_end, i + 1) - s.span_begin);
    map.uniform_visual_share += static_cast<double>(visible) / static_cast<double>(i + 1);
  }
  map.uniform_visual_share /= static_cast<double>(s.query_end - s.query_begin);
  return map;
}

}  // namespace msa
