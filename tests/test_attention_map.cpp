// Attention maps (msa/attention_map.h): the measured statistics against a brute force over
// the forward's taps, the probabilities against the layer's own attention output, the spec's
// and inputs' errors, and the PNG (layout, colours, overlay) decoded by libpng.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "attention_map_brute_force.h"
#include "cli_runner.h"
#include "msa/attention_map.h"
#include "msa/model_random.h"
#include "png_files.h"
#include "test_util.h"

namespace msa {
namespace {

namespace fs = std::filesystem;
using testing::expect_error;

// The tiny preset: 3 layers (0 dense, 1-2 MSA), Hq 4, Hkv 2 (2 heads per group), D 16,
// blocks of 16, top-4 (64 keys): a 100-token prompt makes the selection matter from
// position 64 on.
const fs::path& tiny_dir() { return testing::made_model_dir("attn_map_tiny", "tiny", 11, DType::f32); }
const Model& tiny() {
  static const Model model = Model::load(tiny_dir().string());
  return model;
}
std::vector<int32_t> prompt(int64_t n) {
  std::vector<int32_t> tokens;
  for (int64_t i = 0; i < n; ++i) tokens.push_back(static_cast<int32_t>((i * 53 + 7) % 500 + 5));
  return tokens;
}
const std::vector<int32_t>& prompt100() {
  static const std::vector<int32_t> tokens = prompt(100);
  return tokens;
}
const std::map<std::string, Tensor>& taps100() {
  static const std::map<std::string, Tensor> taps = testing::tap_one_prefill(tiny(), prompt100());
  return taps;
}

LayerAttentionInputs inputs_of(const std::map<std::string, Tensor>& taps, int64_t layer) {
  const std::string name = "layers." + std::to_string(layer);
  const ModelConfig& c = tiny().config();
  return {.q = taps.at(name + ".q"),
          .k = taps.at(name + ".k"),
          .topk = c.sparse_layers[layer] ? taps.at(name + ".topk") : Tensor(),
          .block_size = c.block_size,
          .scale = c.msa_params().scale};
}

// Specs over the edges: the span in the middle with the queries after it; queries inside
// and before the span (span tokens the query cannot see yet); a span of one token at the
// prompt's start; a span reaching the last token with queries over the whole prompt.
std::vector<AttentionMapSpec> specs() {
  return {
      {.span_begin = 16, .span_end = 80, .grid_rows = 8, .grid_cols = 8},
      {.span_begin = 16, .span_end = 80, .grid_rows = 4, .grid_cols = 16, .query_begin = 40, .query_end = 70,
       .layers = {0, 2}, .heads = {1, 2}},
      {.span_begin = 0, .span_end = 1, .grid_rows = 1, .grid_cols = 1, .heads = {3}},
      {.span_begin = 70, .span_end = 100, .grid_rows = 5, .grid_cols = 6, .query_begin = 0, .query_end = 100},
  };
}

TEST(AttentionMap, MeasureMatchesTheBruteForceOnEveryLayer) {
  const ModelConfig& c = tiny().config();
  for (const AttentionMapSpec& raw : specs()) {
    const AttentionMap map = measure_attention_map(tiny(), prompt100(), raw);
    const AttentionMapSpec& spec = map.spec;
    ASSERT_EQ(map.layers.size(), spec.layers.size());
    for (const LayerAttentionMap& layer : map.layers) {
      SCOPED_TRACE("span " + std::to_string(spec.span_begin) + ":" + std::to_string(spec.span_end) +
                   " layer " + std::to_string(layer.layer));
      const testing::BruteForceLayer expected = testing::brute_force_layer(taps100(), c, layer.layer, spec);
      EXPECT_EQ(layer.sparse, static_cast<bool>(c.sparse_layers[layer.layer]));
      // Both sum f64 over the same f32 taps, in different orders: rounding of ~1e-16 each.
      EXPECT_NEAR(layer.visual_mass_share, expected.mass, 1e-12);
      if (layer.sparse) EXPECT_NEAR(layer.selected_visual_block_share, expected.block_share, 1e-12);
      else EXPECT_TRUE(std::isnan(layer.selected_visual_block_share));
      ASSERT_EQ(layer.heatmap.size(), expected.heat.size());
      double heat_sum = 0;
      for (size_t t = 0; t < expected.heat.size(); ++t) {
        EXPECT_NEAR(layer.heatmap[t], expected.heat[t], 1e-12) << "span token " << t;
        heat_sum += layer.heatmap[t];
      }
      EXPECT_NEAR(heat_sum, layer.visual_mass_share, 1e-12);  // (c) sums to (a)
      EXPECT_GE(layer.visual_mass_share, 0);
      EXPECT_LE(layer.visual_mass_share, 1 + 1e-12);
    }
  }
}

TEST(AttentionMap, ResultDoesNotDependOnTheThreadCount) {
  const AttentionMapSpec spec = specs()[0];
  set_num_threads(1);
  const AttentionMap one = measure_attention_map(tiny(), prompt100(), spec);
  set_num_threads(2);
  const AttentionMap two = measure_attention_map(tiny(), prompt100(), spec);
  set_num_threads(0);
  for (size_t l = 0; l < one.layers.size(); ++l) {
    EXPECT_EQ(one.layers[l].visual_mass_share, two.layers[l].visual_mass_share);
    EXPECT_EQ(one.layers[l].heatmap, two.layers[l].heatmap);
  }
}

// Sum_t P(t) v(t) of every (head, query) row against the layer's attention output before
// o_proj ("layers.N.attn_heads"): the probabilities are what the layer attended with.
TEST(AttentionMap, ProbabilitiesReproduceTheLayersAttentionOutput) {
  const ModelConfig& c = tiny().config();
  const std::map<std::string, Tensor>& taps = taps100();
  const int64_t T = 100, Hq = c.num_heads, Hkv = c.num_kv_heads, D = c.head_dim, G = Hq / Hkv;
  for (int64_t layer = 0; layer < c.num_layers; ++layer) {
    SCOPED_TRACE("layer " + std::to_string(layer));
    const LayerAttentionInputs in = inputs_of(taps, layer);
    const Tensor& v = taps.at("layers." + std::to_string(layer) + ".v");
    const Tensor& o = taps.at("layers." + std::to_string(layer) + ".attn_heads");
    ASSERT_EQ(o.shape(), (Shape{T, Hq, D}));
    double worst = 0, worst_dense_on_sparse = 0;
    int64_t restricted_rows = 0;  // MSA rows whose selection leaves visible keys out
    for (int64_t head = 0; head < Hq; ++head)
      for (int64_t i = 0; i < T; ++i) {
        std::vector<double> p(i + 1);
        attention_probabilities(in, head, i, p);
        const auto error_of_p = [&](const std::vector<double>& probs) {
          double e = 0;
          for (int64_t d = 0; d < D; ++d) {
            double sum = 0;
            for (int64_t t = 0; t <= i; ++t) sum += probs[t] * v.get((t * Hkv + head / G) * D + d);
            e = std::max(e, std::abs(sum - o.get((i * Hq + head) * D + d)));
          }
          return e;
        };
        worst = std::max(worst, error_of_p(p));
        if (in.topk.defined() && std::count(p.begin(), p.end(), 0.0) > 0) {
          // The control: dense probabilities on this MSA row must NOT reproduce it.
          ++restricted_rows;
          LayerAttentionInputs dense = in;
          dense.topk = Tensor();
          std::vector<double> q(i + 1);
          attention_probabilities(dense, head, i, q);
          worst_dense_on_sparse = std::max(worst_dense_on_sparse, error_of_p(q));
        }
      }
    // The forward's f32 attention (|v| ~ 1, <= 100 keys) against the f64 recomputation: the
    // observed error is 5.5e-7; 1e-5 leaves room for another summation order.
    EXPECT_LT(worst, 1e-5);
    if (c.sparse_layers[layer]) {
      EXPECT_GT(restricted_rows, 0) << "the prompt is too short for the selection to matter";
      EXPECT_GT(worst_dense_on_sparse, 1e-3) << "dense probabilities reproduced an MSA layer's output";
    }
  }
}

TEST(AttentionMap, ProbabilitiesFollowTheRowOfTheHeadsGroup) {
  // A hand-made MSA layer: T 8, blocks of 2, Hq 4 over Hkv 2; group 0 selects blocks {3, 1},
  // group 1 selects {3, 0} for query 7. Equal logits (q = 0), so P is uniform over the keys.
  const int64_t T = 8, Hq = 4, Hkv = 2, D = 2;
  Tensor topk = Tensor::full({Hkv, T, 2}, DType::i32, -1);
  for (int64_t g = 0; g < Hkv; ++g)
    for (int64_t i = 0; i < T; ++i) topk.set((g * T + i) * 2, static_cast<double>(i / 2));
  topk.set((0 * T + 7) * 2 + 1, 1);
  topk.set((1 * T + 7) * 2 + 1, 0);
  const LayerAttentionInputs in{.q = Tensor::zeros({T, Hq, D}, DType::f32),
                                .k = testing::random_normal({T, Hkv, D}),
                                .topk = topk,
                                .block_size = 2};
  std::vector<double> p(8);
  attention_probabilities(in, 1, 7, p);  // head 1: group 0, keys 2, 3, 6, 7
  EXPECT_EQ(p, (std::vector<double>{0, 0, 0.25, 0.25, 0, 0, 0.25, 0.25}));
  attention_probabilities(in, 2, 7, p);  // head 2: group 1, keys 0, 1, 6, 7
  EXPECT_EQ(p, (std::vector<double>{0.25, 0.25, 0, 0, 0, 0, 0.25, 0.25}));
  std::vector<double> p6(7);
  attention_probabilities(in, 0, 6, p6);  // own block 3 is cut at the query: key 6 only
  EXPECT_EQ(p6, (std::vector<double>{0, 0, 0, 0, 0, 0, 1}));
}

TEST(AttentionMap, MalformedInputsAreErrors) {
  const int64_t T = 8, Hq = 4, Hkv = 2, D = 2;
  Tensor topk = Tensor::full({Hkv, T, 2}, DType::i32, -1);
  for (int64_t g = 0; g < Hkv; ++g)
    for (int64_t i = 0; i < T; ++i) topk.set((g * T + i) * 2, static_cast<double>(i / 2));
  LayerAttentionInputs in{.q = testing::random_normal({T, Hq, D}),
                          .k = testing::random_normal({T, Hkv, D}),
                          .topk = topk.clone(),
                          .block_size = 2};
  std::vector<double> p(6);
  in.topk.set((0 * T + 5) * 2 + 1, 3);  // block 3 lies after query 5's own block 2
  expect_error([&] { attention_probabilities(in, 0, 5, p); }, "topk[0, 5, 1]");
  in.topk.set((0 * T + 5) * 2 + 1, 2);  // a repeat of its own block
  expect_error([&] { attention_probabilities(in, 0, 5, p); }, "not listed before");
  in.topk.set((0 * T + 5) * 2 + 0, -1);  // -1 before an id
  expect_error([&] { attention_probabilities(in, 0, 5, p); }, "suffix");
  in.topk = topk;
  expect_error([&] { attention_probabilities(in, 4, 5, p); }, "'head'");
  expect_error([&] { attention_probabilities(in, 0, 8, p); }, "'query'");
  expect_error([&] { attention_probabilities(in, 0, 4, p); }, "'p'");
  in.k = testing::random_normal({T, 3, D});  // Hq 4 not a multiple of 3
  expect_error([&] { attention_probabilities(in, 0, 5, p); }, "'k'");
  in.k = testing::random_normal({T, Hkv, D}, 1.0, DType::bf16);
  expect_error([&] { attention_probabilities(in, 0, 5, p); }, "f32");
  in.k = testing::random_normal({T, Hkv, D});
  in.topk = Tensor::full({Hkv, T - 1, 2}, DType::i32, 0);
  expect_error([&] { attention_probabilities(in, 0, 5, p); }, "'topk'");
}

TEST(AttentionMap, SpecErrorsNameTheField) {
  const ModelConfig& c = tiny().config();
  const auto resolve = [&](AttentionMapSpec spec) { resolve_attention_map_spec(spec, c, 100); };
  AttentionMapSpec good{.span_begin = 16, .span_end = 80, .grid_rows = 8, .grid_cols = 8};
  EXPECT_NO_THROW(resolve(good));
  AttentionMapSpec s = good;
  s.span_end = 101;
  expect_error([&] { resolve(s); }, "'span'");
  s = good;
  s.span_begin = s.span_end;
  expect_error([&] { resolve(s); }, "'span'");
  s = good;
  s.grid_cols = 9;
  expect_error([&] { resolve(s); }, "'grid': expected rows x cols = 64");
  s = good;
  s.span_end = 100;
  s.grid_rows = 12;
  s.grid_cols = 7;
  expect_error([&] { resolve(s); }, "give a query range");
  s = good;
  s.query_begin = 90;
  s.query_end = 90;
  expect_error([&] { resolve(s); }, "'queries'");
  s = good;
  s.layers = {0, 3};
  expect_error([&] { resolve(s); }, "'layers'");
  s = good;
  s.heads = {2, 1};
  expect_error([&] { resolve(s); }, "ascending");
  s = good;
  s.heads = {4};
  expect_error([&] { resolve(s); }, "'heads'");
  expect_error([&] { resolve_attention_map_spec(good, c, 0); }, "'tokens'");
  // The measurement names a layer whose q / k never came (a recorder given no forward).
  AttentionMapRecorder recorder(c, 100, good);
  expect_error([&] { recorder.finish(); }, "layer 0");
}

TEST(AttentionMap, RecorderRefusesAPromptSplitOverSteps) {
  // The keys of one step's taps are that step's tokens only: a chunked prefill cannot be
  // measured, and the recorder says so instead of measuring the first chunk.
  const ModelConfig& c = tiny().config();
  AttentionMapRecorder recorder(c, 100, {.span_begin = 16, .span_end = 80, .grid_rows = 8, .grid_cols = 8});
  KvCache cache(c, 7);
  SequenceCache sequence;
  const std::vector<int32_t>& tokens = prompt100();
  const ForwardRequest first{.sequence = &sequence, .tokens = std::span(tokens).first(50)};
  expect_error([&] { tiny().forward({&first, 1}, cache, recorder.tap()); }, "the whole prompt of 100 tokens in one step");
}

// ---- rendering ----

double luminance(const std::array<uint8_t, 3>& c) { return 0.2126 * c[0] + 0.7152 * c[1] + 0.0722 * c[2]; }

TEST(AttentionMapPng, ColourScaleBrightensMonotonicallyAndClamps) {
  double last = -1;
  for (int i = 0; i <= 1000; ++i) {
    const double l = luminance(heatmap_colour(i / 1000.0));
    EXPECT_GT(l, last - 0.6) << "t = " << i / 1000.0;  // rounding to bytes wiggles by < 1
    last = l;
  }
  EXPECT_LT(luminance(heatmap_colour(0)) + 150, luminance(heatmap_colour(1)));
  EXPECT_EQ(heatmap_colour(-3), heatmap_colour(0));
  EXPECT_EQ(heatmap_colour(7), heatmap_colour(1));
  EXPECT_EQ(heatmap_colour(std::nan("")), heatmap_colour(0));
}

TEST(AttentionMapPng, LayoutPanelsAndLimits) {
  const HeatmapLayout square = heatmap_layout(8, 8, nullptr);
  EXPECT_EQ(square.panel_width, 480);  // 60-pixel cells
  EXPECT_EQ(square.panel_height, 480);
  EXPECT_GE(square.width, square.bar_x + square.bar_width);
  EXPECT_GE(square.height, square.panel_y + square.panel_height);
  const HeatmapLayout thin = heatmap_layout(1, 1000, nullptr);  // 1-pixel columns, 48 high
  EXPECT_EQ(thin.panel_width, 1000);
  EXPECT_EQ(thin.panel_height, 48);
  std::vector<uint8_t> rgb(30 * 20 * 3, 0);
  const RgbImageView image{.width = 30, .height = 20, .rgb = rgb};
  const HeatmapLayout over = heatmap_layout(3, 4, &image);
  EXPECT_EQ(over.panel_width, 30);
  EXPECT_EQ(over.panel_height, 20);
  expect_error([] { heatmap_layout(1, kMaxHeatmapSide + 1, nullptr); }, "'grid'");
  const RgbImageView short_bytes{.width = 30, .height = 21, .rgb = rgb};
  expect_error([&] { heatmap_layout(3, 4, &short_bytes); }, "RGB bytes");
}

class AttentionMapPngFiles : public testing::TempDirTest {
 protected:
  void SetUp() override {
    TempDirTest::SetUp();
    if (!attention_map_png_available()) GTEST_SKIP() << "built without cairo";
  }
  // A 2 x 3 map with distinct values 0..5 (times 0.01), so each cell's colour is known.
  static AttentionMap small_map() {
    AttentionMap map;
    map.spec = {.span_begin = 4, .span_end = 10, .grid_rows = 2, .grid_cols = 3, .query_begin = 10,
                .query_end = 12, .layers = {1}, .heads = {0, 1}};
    map.tokens = 12;
    map.uniform_visual_share = 0.5;
    map.layers.push_back({.layer = 1, .sparse = true, .visual_mass_share = 0.15,
                          .selected_visual_block_share = 0.5, .heatmap = {0, 0.01, 0.02, 0.03, 0.04, 0.05}});
    return map;
  }
};

TEST_F(AttentionMapPngFiles, HeatmapAloneHasTheScaleColoursInItsCells) {
  const AttentionMap map = small_map();
  write_attention_map_png(path("alone.png"), map, map.layers[0]);
  const testing::DecodedPng png = testing::decode_png(path("alone.png"));
  ASSERT_TRUE(png.ok) << png.error;
  const HeatmapLayout l = heatmap_layout(2, 3, nullptr);
  ASSERT_EQ(png.width, l.width);
  ASSERT_EQ(png.height, l.height);
  const int64_t cell = l.panel_width / 3;
  for (int64_t r = 0; r < 2; ++r)
    for (int64_t c = 0; c < 3; ++c) {
      const std::array<uint8_t, 3> want = heatmap_colour((r * 3 + c) / 5.0);
      for (const auto& [dx, dy] : {std::pair{0L, 0L}, {cell - 1, cell - 1}, {cell / 2, cell / 2}}) {
        const uint8_t* got = png.at(l.panel_x + c * cell + dx, l.panel_y + r * cell + dy);
        EXPECT_EQ((std::array<uint8_t, 3>{got[0], got[1], got[2]}), want) << "cell " << r << "," << c;
      }
    }
  // The bar: the maximum's colour at its top, the minimum's at its bottom.
  const uint8_t* top = png.at(l.bar_x + 5, l.bar_y);
  const uint8_t* bottom = png.at(l.bar_x + 5, l.bar_y + l.bar_height - 1);
  EXPECT_LT(std::abs(top[0] - heatmap_colour(1)[0]) + std::abs(top[1] - heatmap_colour(1)[1]), 6);
  EXPECT_LT(std::abs(bottom[0] - heatmap_colour(0)[0]) + std::abs(bottom[1] - heatmap_colour(0)[1]), 6);
  // Text was drawn (dark pixels in the title band), and the corner stays white.
  int64_t dark = 0;
  for (int64_t y = 0; y < l.panel_y - 2; ++y)
    for (int64_t x = 0; x < l.width; ++x) dark += png.at(x, y)[0] < 100;
  EXPECT_GT(dark, 200);
  EXPECT_EQ(png.at(l.width - 1, l.height - 1)[0], 255);
}

TEST_F(AttentionMapPngFiles, OverlayBlendsTheImageUnderTheHeatmap) {
  const AttentionMap map = small_map();
  // A 60 x 40 image: left half (200, 100, 50), right half (20, 220, 120).
  const int64_t W = 60, H = 40;
  std::vector<uint8_t> rgb(W * H * 3);
  for (int64_t y = 0; y < H; ++y)
    for (int64_t x = 0; x < W; ++x) {
      const uint8_t left[3] = {200, 100, 50}, right[3] = {20, 220, 120};
      std::copy_n(x < W / 2 ? left : right, 3, rgb.data() + (y * W + x) * 3);
    }
  const RgbImageView image{.width = W, .height = H, .rgb = rgb};
  for (const HeatmapUpsampling upsampling : {HeatmapUpsampling::nearest, HeatmapUpsampling::bilinear}) {
    write_attention_map_png(path("overlay.png"), map, map.layers[0],
                            {.image = &image, .alpha = 0.25, .upsampling = upsampling});
    const testing::DecodedPng png = testing::decode_png(path("overlay.png"));
    ASSERT_TRUE(png.ok) << png.error;
    const HeatmapLayout l = heatmap_layout(2, 3, &image);
    ASSERT_EQ(png.width, l.width);
    ASSERT_EQ(png.height, l.height);
    ASSERT_EQ(l.panel_width, W);
    // Cell (r, c) covers x in [20c, 20c + 20), y in [20r, 20r + 20); at its centre both
    // upsamplings give the cell's own value.
    for (int64_t r = 0; r < 2; ++r)
      for (int64_t c = 0; c < 3; ++c) {
        const int64_t x = 20 * c + 10 - (c == 1 ? 2 : 0), y = 20 * r + 10;  // cell 1: left half
        const std::array<uint8_t, 3> heat = heatmap_colour((r * 3 + c) / 5.0);
        const uint8_t* under = rgb.data() + (y * W + x) * 3;
        const uint8_t* got = png.at(l.panel_x + x, l.panel_y + y);
        for (int ch = 0; ch < 3; ++ch) {
          const double want = 0.75 * under[ch] + 0.25 * heat[ch];
          // Bilinear samples at pixel centres, half a pixel from the token centre: +-2 levels.
          EXPECT_NEAR(got[ch], want, upsampling == HeatmapUpsampling::nearest ? 0.5 : 2.5)
              << "cell " << r << "," << c << " channel " << ch;
        }
      }
  }
}

TEST_F(AttentionMapPngFiles, ReadRgbPngCompositesAlphaAndRefusesBadFiles) {
  std::vector<uint8_t> rgba = {255, 0, 0, 255,  0, 0, 255, 0,  0, 255, 0, 128,  10, 20, 30, 255};
  ASSERT_TRUE(testing::write_png(path("in.png"), 2, 2, 4, rgba));
  const RgbImage image = read_rgb_png(path("in.png"));
  ASSERT_EQ(image.width, 2);
  ASSERT_EQ(image.height, 2);
  EXPECT_EQ(std::vector<uint8_t>(image.rgb.begin(), image.rgb.begin() + 6), (std::vector<uint8_t>{255, 0, 0, 255, 255, 255}));
  EXPECT_NEAR(image.rgb[6], 127, 1);  // half-transparent green over white
  EXPECT_EQ(image.rgb[7], 255);
  EXPECT_EQ(std::vector<uint8_t>(image.rgb.begin() + 9, image.rgb.end()), (std::vector<uint8_t>{10, 20, 30}));

  expect_error([&] { read_rgb_png(path("missing.png")); }, "cannot open");
  std::ofstream(path("text.png")) << "not a png, just text that is long enough";
  expect_error([&] { read_rgb_png(path("text.png")); }, "expected a PNG");
  // A header claiming 100000 x 1 pixels: refused before decoding.
  std::string bytes = testing::read_bytes(path("in.png"));
  std::string huge = bytes;
  huge[16] = 0, huge[17] = 1, huge[18] = static_cast<char>(0x86), huge[19] = static_cast<char>(0xa0);
  std::ofstream(path("huge.png"), std::ios::binary) << huge;
  expect_error([&] { read_rgb_png(path("huge.png")); }, "100000x2");
  std::ofstream(path("cut.png"), std::ios::binary) << bytes.substr(0, bytes.size() / 2);
  expect_error([&] { read_rgb_png(path("cut.png")); }, "cut.png");
}

TEST(AttentionMapPngUnavailable, SaysCairoIsMissing) {
  if (attention_map_png_available()) GTEST_SKIP() << "built with cairo";
  AttentionMap map;
  expect_error([&] { write_attention_map_png("/tmp/never.png", map, LayerAttentionMap{}); }, "cairo");
  expect_error([&] { read_rgb_png("/tmp/never.png"); }, "cairo");
}

}  // namespace
}  // namespace msa
