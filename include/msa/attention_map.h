// Attention maps: how much of the text's attention lands on a span of (visual) tokens, layer
// by layer, recomputed from the q and k the CPU forward attends with (docs/attention-maps.md).
//
//   msa::Model model = msa::Model::load(dir);
//   msa::AttentionMapSpec spec{.span_begin = 5, .span_end = 581, .grid_rows = 24, .grid_cols = 24};
//   msa::AttentionMap map = msa::measure_attention_map(model, prompt_tokens, spec);
//   for (const msa::LayerAttentionMap& layer : map.layers)
//     msa::write_attention_map_png("layer.png", map, layer, {.image = &resized_rgb});
//
// The span stands for an image's visual tokens (grid_h/2 x grid_w/2 merged tokens, row-major)
// or, on a text-only model, any token range. The "text queries" are the prompt positions after
// the span unless a query range is given.
#pragma once
#include <array>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "msa/model.h"

namespace msa {

// What to measure. Positions are prompt positions (0-based), ranges half-open.
struct AttentionMapSpec {
  int64_t span_begin = 0, span_end = 0;  // the visual tokens [span_begin, span_end)
  int64_t grid_rows = 0, grid_cols = 0;  // their layout: rows * cols == span_end - span_begin
  // The text queries [query_begin, query_end); both -1: [span_end, prompt length).
  int64_t query_begin = -1, query_end = -1;
  std::vector<int64_t> layers;  // layers to measure, ascending; empty: every layer
  std::vector<int64_t> heads;   // query heads in [0, Hq), ascending; empty: every head
};

// `spec` checked against a prompt of `tokens` tokens and `config`, with the defaults filled in
// (query range, every layer, every head). Throws msa::Error naming the field ("span", "grid",
// "queries", "layers", "heads") with what was expected and what came.
AttentionMapSpec resolve_attention_map_spec(const AttentionMapSpec& spec, const ModelConfig& config,
                                            int64_t tokens);

// One layer's measurement. Averages run over every (chosen head, text query) pair.
struct LayerAttentionMap {
  int64_t layer = 0;
  bool sparse = false;  // an MSA layer (attends over its selected blocks only)
  // (a) The attention probability mass on the span: sum over span tokens of P, averaged.
  double visual_mass_share = 0;
  // (b) MSA layers: the share of a row's selected blocks holding at least one span token that
  // the query can see (t <= its position), averaged; NaN on dense layers.
  double selected_visual_block_share = std::numeric_limits<double>::quiet_NaN();
  // (c) Per span token the attention it receives, averaged: [grid_rows * grid_cols], row-major.
  // Sums to visual_mass_share.
  std::vector<double> heatmap = {};  // initialised: aggregate initialisers may omit it
};

struct AttentionMap {
  AttentionMapSpec spec;  // resolved (resolve_attention_map_spec)
  int64_t tokens = 0;     // prompt length
  // The share uniform attention over every visible key would put on the span, averaged over
  // the text queries: the level a layer's visual_mass_share means "no preference" against.
  double uniform_visual_share = 0;
  std::vector<LayerAttentionMap> layers;  // in spec.layers order
};

// ---- the probabilities, from one forward step's taps ----

// One layer's attention inputs as the CPU forward taps them (include/msa/model.h) for ONE
// request prefilled from position 0 in one step, so that query i sits at position i:
//   q [T, Hq, D] f32 ("layers.N.q"), k [T, Hkv, D] f32 ("layers.N.k"), both after norm + RoPE;
//   topk int32 [Hkv, T, k] ("layers.N.topk") on MSA layers, undefined on dense ones.
struct LayerAttentionInputs {
  Tensor q, k, topk;
  int64_t block_size = 128;  // MSA block (config.block_size)
  double scale = 0;          // softmax scale (config.msa_params().scale)
};

// P[t], t in [0, query], of query head `head` at position `query`, exactly as the layer
// attends: dense layers softmax(scale * q.k) over every key t <= query; MSA layers the same
// softmax over the keys of the selected blocks of the head's KV group g = head / (Hq / Hkv)
// (topk[g, query, :], ids before the -1 suffix) only, P = 0 on every other key.
// `p` has query + 1 entries. Throws msa::Error for mis-shaped inputs or a malformed row.
void attention_probabilities(const LayerAttentionInputs& inputs, int64_t head, int64_t query,
                             std::span<double> p);

// (a), (b) and (c) of one layer over `spec` (resolved; its layers field is not read).
// Sums in f64, over fixed chunks of queries: the result does not depend on the thread count.
LayerAttentionMap measure_layer_attention(const LayerAttentionInputs& inputs,
                                          const AttentionMapSpec& spec, int64_t layer, bool sparse);

// Collects the taps of the spec's layers during Model::forward and measures each layer as
// soon as its inputs are complete (q, k and, on MSA layers, topk), so one layer's q and k are
// held at a time.
//
//   AttentionMapRecorder recorder(model.config(), tokens.size(), spec);
//   model.forward({&request, 1}, cache, recorder.tap());   // one request, one step, from 0
//   std::vector<LayerAttentionMap> layers = recorder.finish();
class AttentionMapRecorder {
 public:
  AttentionMapRecorder(const ModelConfig& config, int64_t tokens, const AttentionMapSpec& spec);
  // A tap for Model::forward; it refers to this recorder, which must outlive the call.
  ForwardTap tap();
  // Every spec layer's measurement, in spec order. Throws msa::Error naming a layer whose
  // taps did not arrive (e.g. the CUDA forward, which does not tap q and k).
  std::vector<LayerAttentionMap> finish();

 private:
  void observe(const std::string& name, const Tensor& value);
  ModelConfig config_;
  int64_t tokens_;
  AttentionMapSpec spec_;
  int64_t current_ = -1;  // the layer whose q / k / topk are held
  Tensor q_, k_, topk_;
  std::vector<LayerAttentionMap> done_;
};

// Runs one CPU prefill of `tokens` (a fresh f32 KV cache, so the attention reads exactly the
// tapped f32 keys) and measures `spec`. The model must be on the CPU. `visual`: the rows of
// the prompt's images / videos at their placeholder tokens (ForwardRequest::visual, indices
// into `tokens`), so that the span's keys are the image's own.
AttentionMap measure_attention_map(const Model& model, std::span<const int32_t> tokens,
                                   const AttentionMapSpec& spec,
                                   std::span<const VisualRows> visual = {});

// ---- rendering (PNG through cairo, when this build has it) ----

// An RGB8 image, rows top to bottom: rgb holds height * width * 3 bytes.
struct RgbImageView {
  int64_t width = 0, height = 0;
  std::span<const uint8_t> rgb;
};
// An owned RGB8 image (what read_rgb_png returns).
struct RgbImage {
  int64_t width = 0, height = 0;
  std::vector<uint8_t> rgb = {};
  RgbImageView view() const { return {width, height, rgb}; }
};

enum class HeatmapUpsampling : uint8_t { nearest, bilinear };

struct HeatmapPngOptions {
  // The image under the heatmap (the resized input image); null: the heatmap alone, in square
  // cells of a whole number of pixels.
  const RgbImageView* image = nullptr;
  double alpha = 0.6;  // heatmap opacity over the image, in [0, 1]
  // How the grid is stretched to the image: nearest shows each token's cell exactly,
  // bilinear interpolates between token centres.
  HeatmapUpsampling upsampling = HeatmapUpsampling::nearest;
};

// Where the parts of one layer's PNG lie (pixels): the heatmap panel, the colour bar.
struct HeatmapLayout {
  int64_t width = 0, height = 0;                    // the whole PNG
  int64_t panel_x = 0, panel_y = 0, panel_width = 0, panel_height = 0;
  int64_t bar_x = 0, bar_y = 0, bar_width = 0, bar_height = 0;
};
// The layout for a rows x cols grid (with an image the panel is the image's size). Throws
// msa::Error for a grid or image beyond the renderable sizes (kMaxHeatmapSide).
HeatmapLayout heatmap_layout(int64_t rows, int64_t cols, const RgbImageView* image);
inline constexpr int64_t kMaxHeatmapSide = 4096;  // grid cells or image pixels per side

// The colour scale: t in [0, 1] (low to high attention) to RGB, dark purple through red and
// orange to pale yellow, brightness rising with t; t outside [0, 1] is clamped.
std::array<uint8_t, 3> heatmap_colour(double t);

// Whether this build writes PNGs (it was configured with cairo, libcairo2-dev).
bool attention_map_png_available();

// Writes `layer`'s PNG: the heatmap of layer.heatmap over map.spec's grid (alpha-blended over
// options.image when given), a colour bar labelled with the heatmap's min and max, a title
// (layer, dense / MSA, share of text-query attention on the span) and a caption. Throws
// msa::Error when the build has no cairo, for a bad image or options, or when the file cannot
// be written.
void write_attention_map_png(const std::string& path, const AttentionMap& map,
                             const LayerAttentionMap& layer, const HeatmapPngOptions& options = {});

// Reads a PNG (through cairo) as RGB8, alpha dropped; at most kMaxHeatmapSide pixels per
// side, checked from the header before the pixels are decoded. Throws msa::Error naming the
// file when it is missing, not a PNG, corrupt, too large, or the build has no cairo.
RgbImage read_rgb_png(const std::string& path);

}  // namespace msa
