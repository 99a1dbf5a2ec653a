// The vision tower and its merge into the text model: vision_config parsing and its errors,
// patch positions and 3D RoPE angles by hand, video segmenting, the ViT and the projector
// against a plain f64 reference written here from docs/vision.md, weight names and errors,
// visual rows in forward steps (chunked prefill through an image, bad rows), the engine, and
// the CLI. Parity with transformers: tests/parity/test_m3_parity.py.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>

#include "cli_runner.h"
#include "model/tensor_math.h"
#include "msa/model.h"
#include "msa/model_engine.h"
#include "msa/model_random.h"
#include "msa/model_vision.h"
#include "msa/safetensors.h"
#include "op_cases.h"
#include "released_config.h"

namespace msa {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::expect_error;
using testing::fresh_dir;
using testing::random_normal;
using testing::relative_error;

// f32 against f64 over a few hundred products per output (widths 40..80, segments of <= 48
// patches) stays near 1e-6 relative (norm-wise); a wrong term (a missed rotation, a patch
// in the wrong segment) is O(1e-1).
constexpr double kTolerance = 1e-5;

// `msa ARGS...` (each argument quoted), stdout and stderr together in `out`.
testing::CliResult cli(const std::vector<std::string>& args) {
  std::string text;
  for (const std::string& arg : args) text += (text.empty() ? "" : " ") + testing::shell_quote(arg);
  return testing::run_cli(text);
}

// ---- the tiny-vl model ----

const fs::path& tiny_vl_dir() { return testing::made_model_dir("tiny_vl", "tiny-vl", 5, DType::f32); }

const Model& tiny_vl() {
  static const Model model = Model::load(tiny_vl_dir().string());
  return model;
}

const VisionConfig& vision() { return *tiny_vl().config().vision; }

// Random pixel values for `grids`, rows of every grid in order.
Tensor random_pixels(const std::vector<VisionGrid>& grids) {
  int64_t rows = 0;
  for (const VisionGrid& g : grids) rows += g.patches();
  return random_normal({rows, vision().patch_values()});
}

// Text tokens that are never a placeholder or bracket (ids 3..492 of tiny-vl's 512).
std::vector<int32_t> text_tokens(int64_t n, int32_t salt) {
  std::vector<int32_t> tokens;
  for (int64_t i = 0; i < n; ++i) tokens.push_back(static_cast<int32_t>((i * 37 + salt * 11 + 5) % 490 + 3));
  return tokens;
}

// start, `count` placeholders, end.
void append_image(std::vector<int32_t>& tokens, int64_t count, int32_t placeholder) {
  tokens.push_back(vision().vision_start_token_id);
  tokens.insert(tokens.end(), count, placeholder);
  tokens.push_back(vision().vision_end_token_id);
}

// ---- the plain f64 reference of the vision path (docs/vision.md, written independently) ----

std::vector<double> as_f64(const Tensor& t) {
  const Tensor d = t.to(DType::f64);
  return {d.data<double>(), d.data<double>() + d.numel()};
}

struct RefLinear {
  std::vector<double> w, b;
  int64_t out, in;
  RefLinear(const LinearWeights& l)
      : w(as_f64(l.weight)), b(as_f64(l.bias)), out(l.weight.size(0)), in(l.weight.size(1)) {}
  std::vector<double> operator()(const std::vector<double>& x) const {
    const int64_t rows = static_cast<int64_t>(x.size()) / in;
    std::vector<double> y(rows * out);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t o = 0; o < out; ++o) {
        double sum = b[o];
        for (int64_t i = 0; i < in; ++i) sum += x[r * in + i] * w[o * in + i];
        y[r * out + o] = sum;
      }
    return y;
  }
};

std::vector<double> ref_layer_norm(const std::vector<double>& x, const LayerNormWeights& n, double eps) {
  const std::vector<double> w = as_f64(n.weight), b = as_f64(n.bias);
  const int64_t dim = static_cast<int64_t>(w.size()), rows = static_cast<int64_t>(x.size()) / dim;
  std::vector<double> y(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    double mean = 0, var = 0;
    for (int64_t i = 0; i < dim; ++i) mean += x[r * dim + i] / dim;
    for (int64_t i = 0; i < dim; ++i) var += (x[r * dim + i] - mean) * (x[r * dim + i] - mean) / dim;
    for (int64_t i = 0; i < dim; ++i) y[r * dim + i] = (x[r * dim + i] - mean) / std::sqrt(var + eps) * w[i] + b[i];
  }
  return y;
}

void ref_gelu(std::vector<double>& x) {
  for (double& v : x) v = 0.5 * v * (1 + std::erf(v / std::sqrt(2.0)));
}

// (t, h, w) of patch i of a t x h x w segment, decoded from its index (t, then merge windows
// in raster order, then the window's rows and columns).
std::array<double, 3> ref_position(int64_t i, int64_t h, int64_t w, int64_t m) {
  const int64_t t = i / (h * w), within = i % (h * w), window = within / (m * m);
  const int64_t hb = window / (w / m), wb = window % (w / m);
  const int64_t mh = within % (m * m) / m, mw = within % m;
  return {static_cast<double>(t), static_cast<double>(hb * m + mh), static_cast<double>(wb * m + mw)};
}

// The ViT on one segment's rows: patch GEMM, pre-norm, blocks with 3D RoPE and full
// attention over the segment.
std::vector<double> ref_vit_segment(const VisionWeights& weights, const VisionConfig& c,
                                    const std::vector<double>& pixels, const VisionGrid& grid) {
  const int64_t n = grid.patches(), Hv = c.hidden_size, heads = c.num_heads, D = c.head_dim();
  const int64_t F = D / 3 / 2;
  const std::vector<double> patch = as_f64(weights.patch_embedding);
  std::vector<double> x(n * Hv, 0.0);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t o = 0; o < Hv; ++o)
      for (int64_t i = 0; i < c.patch_values(); ++i) x[r * Hv + o] += pixels[r * c.patch_values() + i] * patch[o * c.patch_values() + i];
  x = ref_layer_norm(x, weights.pre_norm, c.layer_norm_eps);
  const auto rope = [&](std::vector<double>& v) {
    for (int64_t r = 0; r < n; ++r) {
      const auto pos = ref_position(r, grid.h, grid.w, c.spatial_merge_size);
      for (int64_t head = 0; head < heads; ++head) {
        double* e = v.data() + (r * heads + head) * D;
        for (int64_t i = 0; i < 3 * F; ++i) {
          const double angle = pos[i / F] * std::pow(c.rope_theta, -2.0 * (i % F) / (2.0 * F));
          const double a = e[i], b = e[i + 3 * F];
          e[i] = a * std::cos(angle) - b * std::sin(angle);
          e[i + 3 * F] = b * std::cos(angle) + a * std::sin(angle);
        }
      }
    }
  };
  for (const VisionLayerWeights& l : weights.layers) {
    const std::vector<double> xn = ref_layer_norm(x, l.norm1, c.layer_norm_eps);
    std::vector<double> q = RefLinear(l.q_proj)(xn), k = RefLinear(l.k_proj)(xn), v = RefLinear(l.v_proj)(xn);
    rope(q);
    rope(k);
    std::vector<double> o(n * Hv, 0.0);
    for (int64_t head = 0; head < heads; ++head)
      for (int64_t i = 0; i < n; ++i) {
        std::vector<double> p(n);
        double max = -1e300, sum = 0;
        for (int64_t j = 0; j < n; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += q[(i * heads + head) * D + d] * k[(j * heads + head) * D + d];
          p[j] = dot / std::sqrt(static_cast<double>(D));
          max = std::max(max, p[j]);
        }
        for (double& e : p) sum += (e = std::exp(e - max));
        for (int64_t j = 0; j < n; ++j)
          for (int64_t d = 0; d < D; ++d) o[(i * heads + head) * D + d] += p[j] / sum * v[(j * heads + head) * D + d];
      }
    const std::vector<double> attn = RefLinear(l.out_proj)(o);
    for (size_t i = 0; i < x.size(); ++i) x[i] += attn[i];
    std::vector<double> hidden = RefLinear(l.fc1)(ref_layer_norm(x, l.norm2, c.layer_norm_eps));
    ref_gelu(hidden);
    const std::vector<double> mlp = RefLinear(l.fc2)(hidden);
    for (size_t i = 0; i < x.size(); ++i) x[i] += mlp[i];
  }
  return x;
}

// The ViT over grids: every image its own segment, a video cut into chunks of at most
// segment_max_frames temporal patches (independently of vision_segments).
Tensor ref_vit(const VisionWeights& weights, const VisionConfig& c, const Tensor& pixel_values,
               const std::vector<VisionGrid>& grids) {
  const std::vector<double> pixels = as_f64(pixel_values);
  std::vector<double> out;
  int64_t row = 0;
  for (const VisionGrid& g : grids) {
    for (int64_t t0 = 0; t0 < g.t; t0 += c.segment_max_frames) {
      const VisionGrid chunk{.t = std::min(c.segment_max_frames, g.t - t0), .h = g.h, .w = g.w};
      const std::vector<double> rows(pixels.begin() + row * c.patch_values(),
                                     pixels.begin() + (row + chunk.patches()) * c.patch_values());
      const std::vector<double> x = ref_vit_segment(weights, c, rows, chunk);
      out.insert(out.end(), x.begin(), x.end());
      row += chunk.patches();
    }
  }
  Tensor t = Tensor::zeros({row, c.hidden_size}, DType::f64);
  std::copy(out.begin(), out.end(), t.data<double>());
  return t;
}

// The projector: per patch, then each window's m^2 consecutive rows side by side (the
// reshape of [N, H] to [N / m^2, m^2 * H] is the identity on row-major data).
Tensor ref_projector(const VisionWeights& weights, const Tensor& features) {
  std::vector<double> inner = RefLinear(weights.linear_1)(as_f64(features));
  ref_gelu(inner);
  const std::vector<double> patches = RefLinear(weights.linear_2)(inner);  // [N, H]: m^2 rows a window
  std::vector<double> merged = RefLinear(weights.merge_linear_1)(patches);
  ref_gelu(merged);
  const std::vector<double> out = RefLinear(weights.merge_linear_2)(merged);
  const int64_t H = weights.linear_2.weight.size(0);
  Tensor t = Tensor::zeros({static_cast<int64_t>(out.size()) / H, H}, DType::f64);
  std::copy(out.begin(), out.end(), t.data<double>());
  return t;
}

void expect_close(const Tensor& got, const Tensor& want, const std::string& what) {
  SCOPED_TRACE(what);
  ASSERT_EQ(got.shape(), want.shape());
  EXPECT_LT(relative_error(got, want), kTolerance);
  EXPECT_LT(testing::max_abs_diff(got, want), 10 * kTolerance);
}

// ---- config ----

// The released config.json's VL fields (CLIP-style vision_config, img_token_compression_config,
// top-level *_index and projector fields), tiny widths, on the released text config.
std::string released_vl_config(const std::string& vision_extra = "", const std::string& top_extra = "") {
  std::string text = kReleasedConfigJson;
  text.erase(text.rfind('}'));  // reopen the top-level object
  return text + R"(, "image_token_index": 900, "video_token_index": 901, "image_seq_length": 576,
    "projector_hidden_act": "gelu", "projector_hidden_size": 48, "multimodal_projector_bias": true,
    "vision_feature_layer": -1, "vision_feature_select_strategy": "full", "num_reward_heads": 0,
    "process_image_mode": "dynamic_res", "image_grid_pinpoints": [[336, 672], [672, 336]],
    "vision_start_token_id": 902, "vision_end_token_id": 903,
    "img_token_compression_config": {"image_token_compression_method": "patch_merge",
                                     "spatial_merge_size": 2, "temporal_patch_size": 2},)" +
         top_extra + R"(
    "vision_config": {"model_type": "clip_vision_model", "hidden_size": 40, "num_attention_heads": 2,
      "num_hidden_layers": 2, "intermediate_size": 80, "patch_size": 14, "image_size": 2016,
      "projection_dim": 48, "position_embedding_type": "rope", "rope_mode": "3d", "rope_theta": 500.0,
      "attention_dropout": 0.0, "hidden_act": "gelu", "layer_norm_eps": 1e-6, "num_channels": 3,
      "vocab_size": 32000, "vision_segment_max_frames": 3,)" +
         vision_extra + R"(
      "img_token_compression_config": {"image_token_compression_method": "patch_merge",
                                       "spatial_merge_size": 2, "temporal_patch_size": 2}}})";
}

TEST(VisionConfig, ReadsTheReleasedSpelling) {
  const ModelConfig c = parse_model_config(released_vl_config(), "released");
  ASSERT_TRUE(c.vision.has_value());
  const VisionConfig& v = *c.vision;
  EXPECT_EQ(v.hidden_size, 40);
  EXPECT_EQ(v.num_heads, 2);
  EXPECT_EQ(v.head_dim(), 20);
  EXPECT_EQ(v.num_layers, 2);
  EXPECT_EQ(v.intermediate_size, 80);
  EXPECT_EQ(v.rope_theta, 500.0);
  EXPECT_EQ(v.layer_norm_eps, 1e-6);
  EXPECT_EQ(v.segment_max_frames, 3);
  EXPECT_EQ(v.projector_hidden_size, 48);
  EXPECT_EQ(v.patch_values(), 1176);
  EXPECT_EQ(v.rope_frequencies_per_axis(), 3);
  EXPECT_EQ(v.image_token_id, 900);
  EXPECT_EQ(v.video_token_id, 901);
  EXPECT_EQ(v.vision_start_token_id, 902);
  EXPECT_EQ(v.vision_end_token_id, 903);
}

TEST(VisionConfig, ReadsTheTransformersSpellingAndM3Defaults) {
  // transformers' MiniMaxM3VLConfig.to_dict(): rope_parameters (axial), flat merge / temporal
  // sizes, no segment length (then 4), no brackets (then M3's ids).
  const ModelConfig c = parse_model_config(R"({"image_token_index": 200025, "video_token_index": 200026,
      "projector_hidden_size": 64, "text_config": {"vocab_size": 512, "hidden_size": 64,
      "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
      "mlp_layer_types": ["dense"], "dense_intermediate_size": 8},
      "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
      "num_attention_heads": 2, "num_channels": 3, "image_size": 2016, "patch_size": 14,
      "temporal_patch_size": 2, "spatial_merge_size": 2, "hidden_act": "gelu", "layer_norm_eps": 1e-05,
      "rope_parameters": {"rope_theta": 10000.0, "rope_type": "axial"}, "model_type": "minimax_m3_vl_vision"}})",
                                           "transformers");
  ASSERT_TRUE(c.vision.has_value());
  EXPECT_EQ(c.vision->segment_max_frames, 4);
  EXPECT_EQ(c.vision->rope_theta, 1e4);
  EXPECT_EQ(c.vision->projector_hidden_size, 64);
  EXPECT_EQ(c.vision->image_token_id, 200025);  // outside this vocabulary: legal, unusable
  EXPECT_EQ(c.vision->vision_start_token_id, 200029);
  EXPECT_EQ(c.vision->vision_end_token_id, 200030);
  // An empty vision_config is M3's tower.
  const ModelConfig m3 = parse_model_config(
      std::string(kReleasedConfigJson).substr(0, std::string(kReleasedConfigJson).rfind('}')) +
          R"(, "vision_config": {}})",
      "defaults");
  EXPECT_EQ(m3.vision->hidden_size, 1280);
  EXPECT_EQ(m3.vision->head_dim(), 80);
  EXPECT_EQ(m3.vision->rope_frequencies_per_axis(), 13);
  EXPECT_EQ(m3.vision->intermediate_size, 5120);
  EXPECT_EQ(m3.vision->num_layers, 32);
  EXPECT_EQ(m3.vision->projector_hidden_size, 6144);
}

TEST(VisionConfig, TextOnlyConfigStaysValid) {
  EXPECT_FALSE(parse_model_config(kReleasedConfigJson, "text").vision.has_value());
  EXPECT_FALSE(model_config_preset("tiny").vision.has_value());
}

TEST(VisionConfig, NamesTheBadField) {
  const auto expect_rejected = [](const std::string& json, const std::string& words) {
    SCOPED_TRACE(words);
    expect_error([&] { parse_model_config(json, "c.json"); }, words);
  };
  expect_rejected(released_vl_config(R"("hidden_act": "quick_gelu",)"), "vision_config.hidden_act");
  expect_rejected(released_vl_config(R"("rope_mode": "2d",)"), "vision_config.rope_mode");
  expect_rejected(released_vl_config(R"("rope_parameters": {"rope_type": "default"},)"),
                  "vision_config.rope_parameters.rope_type");
  expect_rejected(released_vl_config(R"("rope_parameters": {"rope_theta": 7.0},)"),
                  "'vision_config.rope_theta' and 'vision_config.rope_parameters.rope_theta'");
  expect_rejected(released_vl_config(R"("spatial_merge_size": 3,)"),
                  "'vision_config.spatial_merge_size' (3) and 'img_token_compression_config.spatial_merge_size' (2)");
  expect_rejected(released_vl_config(R"("vision_segment_max_frames": 0, "x": 1,)"),
                  "vision_config.vision_segment_max_frames");
  expect_rejected(released_vl_config(R"("num_attention_heads": 3, "x": 1,)"), "config.vision_config.hidden_size");
  expect_rejected(released_vl_config(R"("layer_norm_eps": 0, "x": 1,)"), "vision_config.layer_norm_eps");
  expect_rejected(released_vl_config(R"("hidden_size": 1.5, "x": 1,)"), "vision_config.hidden_size");
  expect_rejected(released_vl_config("", R"("projector_hidden_act": "relu",)"), "projector_hidden_act");
  expect_rejected(released_vl_config("", R"("vision_feature_layer": -2,)"), "vision_feature_layer");
  expect_rejected(released_vl_config("", R"("multimodal_projector_bias": false,)"), "multimodal_projector_bias");
  expect_rejected(released_vl_config("", R"("image_token_id": 5,)"),
                  "'image_token_index' (900) and 'image_token_id' (5)");
  expect_rejected(released_vl_config("", R"("vision_end_token_id": 900, "x": 1,)"), "vision_end_token_id");
  expect_rejected(released_vl_config("", R"("vision_config2": 1, "vision_start_token_id": -1,)"),
                  "vision_start_token_id");
}

TEST(VisionConfig, PresetsRoundTripThroughJson) {
  for (const char* name : {"tiny-vl", "m3-vision"}) {
    const ModelConfig preset = model_config_preset(name);
    const ModelConfig back = parse_model_config(model_config_to_json(preset), name);
    ASSERT_TRUE(back.vision.has_value()) << name;
    const VisionConfig &a = *preset.vision, &b = *back.vision;
    EXPECT_EQ(std::tie(a.hidden_size, a.num_layers, a.num_heads, a.intermediate_size, a.patch_size,
                       a.temporal_patch_size, a.spatial_merge_size, a.segment_max_frames,
                       a.projector_hidden_size, a.image_token_id, a.video_token_id,
                       a.vision_start_token_id, a.vision_end_token_id),
              std::tie(b.hidden_size, b.num_layers, b.num_heads, b.intermediate_size, b.patch_size,
                       b.temporal_patch_size, b.spatial_merge_size, b.segment_max_frames,
                       b.projector_hidden_size, b.image_token_id, b.video_token_id,
                       b.vision_start_token_id, b.vision_end_token_id))
        << name;
    EXPECT_EQ(b.rope_theta, a.rope_theta);
  }
  const VisionConfig m3 = *model_config_preset("m3-vision").vision;
  EXPECT_EQ(m3.hidden_size, 1280);
  EXPECT_EQ(m3.num_heads, 16);
  EXPECT_EQ(m3.intermediate_size, 5120);
  EXPECT_EQ(m3.projector_hidden_size, 6144);
  EXPECT_EQ(model_config_preset("m3-vision").hidden_size, 6144);
}

// ---- geometry ----

TEST(VisionGeometry, PatchPositionsFollowTheMergeWindows) {
  // t = 2, 2 x 4 patches, 2 x 2 windows: per t, window (0,0) then (0,1), each row-major.
  const std::vector<PatchPosition> got = vision_patch_positions({.t = 2, .h = 2, .w = 4}, 2);
  const std::vector<std::array<int64_t, 3>> want = {
      {0, 0, 0}, {0, 0, 1}, {0, 1, 0}, {0, 1, 1}, {0, 0, 2}, {0, 0, 3}, {0, 1, 2}, {0, 1, 3},
      {1, 0, 0}, {1, 0, 1}, {1, 1, 0}, {1, 1, 1}, {1, 0, 2}, {1, 0, 3}, {1, 1, 2}, {1, 1, 3}};
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_EQ((std::array<int64_t, 3>{got[i].t, got[i].h, got[i].w}), want[i]) << "patch " << i;
  // 4 x 4 with 2 x 2 windows: patch 6 is window 1 (row 0, column 1), inner (1, 0).
  const std::vector<PatchPosition> square = vision_patch_positions({.t = 1, .h = 4, .w = 4}, 2);
  EXPECT_EQ(square[6].h, 1);
  EXPECT_EQ(square[6].w, 2);
  EXPECT_EQ(square[9].h, 2);  // window 2 = (1, 0), inner (0, 1)
  EXPECT_EQ(square[9].w, 1);
}

TEST(VisionGeometry, RopeAnglesByHand) {
  VisionConfig c;
  c.hidden_size = 40;
  c.num_heads = 2;  // head dim 20: 3 frequencies per axis, 18 rotated channels, 2 pass through
  c.rope_theta = 100;
  const std::vector<float> inv = vision_rope_inverse_frequencies(c);
  ASSERT_EQ(inv.size(), 3u);
  EXPECT_FLOAT_EQ(inv[0], 1.0f);
  EXPECT_FLOAT_EQ(inv[1], 0.21544347f);  // 100^(-2/6)
  EXPECT_FLOAT_EQ(inv[2], 0.04641589f);  // 100^(-4/6)
  const std::vector<PatchPosition> positions = {{.t = 0, .h = 0, .w = 0}, {.t = 1, .h = 2, .w = 3}};
  const std::vector<float> angles = vision_rope_angles(positions, inv);
  ASSERT_EQ(angles.size(), 18u);
  for (int i = 0; i < 9; ++i) EXPECT_EQ(angles[i], 0.0f);
  const float want[9] = {1, 0.21544347f, 0.04641589f, 2, 0.43088694f, 0.09283178f,
                         3, 0.64633041f, 0.13924767f};
  for (int i = 0; i < 9; ++i) EXPECT_NEAR(angles[9 + i], want[i], 1e-6) << "angle " << i;
  // M3: head dim 80 gives 13 frequencies, theta^(-2k/26).
  EXPECT_EQ(vision_rope_inverse_frequencies(VisionConfig{}).size(), 13u);
  EXPECT_FLOAT_EQ(vision_rope_inverse_frequencies(VisionConfig{})[12], std::pow(1e4f, -24.0f / 26.0f));

  // Applied to one head of 20 channels: channel i and i + 9 turn by angle i, 18 and 19 stay.
  std::vector<float> x(20);
  for (int i = 0; i < 20; ++i) x[i] = static_cast<float>(i + 1);
  std::vector<float> y = x;
  model::apply_rope_angles(y.data(), 1, 1, 20, angles.data() + 9, 9);
  for (int i = 0; i < 9; ++i) {
    const double a = want[i];
    EXPECT_NEAR(y[i], x[i] * std::cos(a) - x[i + 9] * std::sin(a), 1e-5) << i;
    EXPECT_NEAR(y[i + 9], x[i + 9] * std::cos(a) + x[i] * std::sin(a), 1e-5) << i + 9;
  }
  EXPECT_EQ(y[18], x[18]);
  EXPECT_EQ(y[19], x[19]);
}

TEST(VisionGeometry, SegmentsSplitLongVideosOnly) {
  VisionConfig c;  // 4 temporal patches per segment, 2 x 2 merge
  const std::vector<VisionGrid> grids = {
      {.t = 1, .h = 4, .w = 6}, {.t = 10, .h = 2, .w = 2}, {.t = 4, .h = 2, .w = 4}, {.t = 5, .h = 2, .w = 2}};
  const std::vector<VisionSegment> got = vision_segments(grids, c);
  // (first_row, t, source)
  const std::vector<std::array<int64_t, 3>> want = {{0, 1, 0},   {24, 4, 1},  {40, 4, 1}, {56, 2, 1},
                                                    {64, 4, 2},  {96, 4, 3},  {112, 1, 3}};
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ((std::array<int64_t, 3>{got[i].first_row, got[i].grid.t, got[i].source}), want[i]) << i;
    EXPECT_EQ(got[i].grid.h, grids[got[i].source].h);
    EXPECT_EQ(got[i].grid.w, grids[got[i].source].w);
  }
  c.segment_max_frames = 1;  // every temporal patch its own segment
  EXPECT_EQ(vision_segments(grids, c).size(), 1u + 10u + 4u + 5u);
}

TEST(VisionGeometry, BadGridsAreNamed) {
  const VisionConfig c;
  const auto rejected = [&](std::vector<VisionGrid> grids, const std::string& words) {
    expect_error([&] { vision_segments(grids, c); }, words);
  };
  rejected({{.t = 1, .h = 2, .w = 2}, {.t = 1, .h = 3, .w = 2}}, "argument 'grids[1].h': expected a multiple of spatial_merge_size (2)");
  rejected({{.t = 0, .h = 2, .w = 2}}, "argument 'grids[0].t'");
  rejected({{.t = 1, .h = 2, .w = -2}}, "argument 'grids[0].w'");
  rejected({{.t = 1, .h = 256, .w = 258}}, "argument 'grids[0]': expected segments of at most 65536 patches");
  rejected({{.t = 9, .h = 128, .w = 130}}, "argument 'grids[0]': expected segments of at most 65536 patches");
  EXPECT_EQ(vision_segments(std::vector<VisionGrid>{{.t = 4, .h = 128, .w = 128}}, c).size(), 1u);
  const std::vector<VisionGrid> many(70000, VisionGrid{.t = 40, .h = 32, .w = 32});  // 2.9e9 patches
  rejected(many, "expected at most 2147483647 patches in all grids");
}

// ---- the tower and the projector against the f64 reference ----

TEST(VisionTower, MatchesTheF64Reference) {
  MSA_RESEED_AND_TRACE();
  // An image, a video of 6 temporal patches (segments of 4 + 2), a second small image.
  const std::vector<VisionGrid> grids = {{.t = 1, .h = 4, .w = 6}, {.t = 6, .h = 2, .w = 4}, {.t = 1, .h = 2, .w = 2}};
  const Tensor pixels = random_pixels(grids);
  const VisionWeights& w = *tiny_vl().weights().vision;
  const Tensor want = ref_vit(w, vision(), pixels, grids);
  expect_close(vision_tower_forward(w, vision(), pixels, grids, Impl::cpu), want, "cpu attention");
  expect_close(vision_tower_forward(w, vision(), pixels, grids, Impl::reference), want, "reference attention");
  // bf16 pixel values are read as their f32 values.
  const Tensor bf16 = pixels.to(DType::bf16);
  expect_close(vision_tower_forward(w, vision(), bf16, grids), ref_vit(w, vision(), bf16, grids), "bf16 input");
}

TEST(VisionTower, SegmentsAreIndependent) {
  MSA_RESEED_AND_TRACE();
  // A video of 6 temporal patches equals its two chunks given as grids of their own (what
  // transformers' video processor passes), and differs from one unsegmented grid.
  const Tensor pixels = random_pixels({{.t = 6, .h = 2, .w = 4}});
  const VisionWeights& w = *tiny_vl().weights().vision;
  const Tensor whole = vision_tower_forward(w, vision(), pixels, std::vector<VisionGrid>{{.t = 6, .h = 2, .w = 4}});
  const Tensor chunks = vision_tower_forward(
      w, vision(), pixels, std::vector<VisionGrid>{{.t = 4, .h = 2, .w = 4}, {.t = 2, .h = 2, .w = 4}});
  EXPECT_TRUE(testing::bitwise_equal(whole, chunks));
  VisionConfig one_segment = vision();
  one_segment.segment_max_frames = 6;
  EXPECT_GT(relative_error(vision_tower_forward(w, one_segment, pixels, std::vector<VisionGrid>{{.t = 6, .h = 2, .w = 4}}),
                           whole),
            1e-2);
}

TEST(VisionTower, ManySegmentsRunInBatchesWithTheSameResult) {
  MSA_RESEED_AND_TRACE();
  // 4200 images of 2 x 2 patches: more patches than one batch holds (16384).
  const std::vector<VisionGrid> grids(4200, VisionGrid{.t = 1, .h = 2, .w = 2});
  const Tensor pixels = random_pixels(grids);
  const VisionWeights& w = *tiny_vl().weights().vision;
  const Tensor all = vision_tower_forward(w, vision(), pixels, grids);
  for (const int64_t image : {0, 4095, 4096, 4199}) {
    const Tensor one = vision_tower_forward(w, vision(), pixels.slice0(4 * image, 4 * image + 4),
                                            std::vector<VisionGrid>{grids[image]});
    // The same math; only the GEMMs' blocking differs with the batch's row count.
    EXPECT_LT(relative_error(one, all.slice0(4 * image, 4 * image + 4).clone()), kTolerance) << image;
  }
}

TEST(VisionProjector, MatchesTheF64ReferenceAndChecksItsInput) {
  MSA_RESEED_AND_TRACE();
  const VisionWeights& w = *tiny_vl().weights().vision;
  const Tensor features = random_normal({24, vision().hidden_size});
  const Tensor got = vision_projector_forward(w, vision(), features);
  EXPECT_EQ(got.shape(), (Shape{6, tiny_vl().config().hidden_size}));
  expect_close(got, ref_projector(w, features), "projector");
  expect_error([&] { vision_projector_forward(w, vision(), random_normal({6, vision().hidden_size})); },
               "argument 'features': expected [N, 40] with N a positive multiple of 4");
  expect_error([&] { vision_projector_forward(w, vision(), random_normal({8, 41})); }, "argument 'features'");
}

TEST(VisionTower, EncodeVisionIsTowerThenProjectorPerGrid) {
  MSA_RESEED_AND_TRACE();
  const std::vector<VisionGrid> grids = {{.t = 1, .h = 4, .w = 6}, {.t = 6, .h = 2, .w = 4}};
  const Tensor pixels = random_pixels(grids);
  const VisionWeights& w = *tiny_vl().weights().vision;
  const std::vector<Tensor> rows = tiny_vl().encode_vision(pixels, grids);
  ASSERT_EQ(rows.size(), 2u);
  const Tensor projected = ref_projector(w, ref_vit(w, vision(), pixels, grids));
  EXPECT_EQ(rows[0].shape(), (Shape{6, 64}));
  EXPECT_EQ(rows[1].shape(), (Shape{12, 64}));
  expect_close(rows[0], projected.slice0(0, 6).clone(), "image rows");
  expect_close(rows[1], projected.slice0(6, 18).clone(), "video rows");
}

TEST(VisionTower, BadInputsAreNamed) {
  const std::vector<VisionGrid> grid = {{.t = 1, .h = 2, .w = 2}};
  expect_error([&] { tiny_vl().encode_vision(random_normal({5, 1176}), grid); },
               "argument 'pixel_values': expected a [4, 1176] tensor");
  expect_error([&] { tiny_vl().encode_vision(random_normal({4, 1175}), grid); }, "argument 'pixel_values'");
  expect_error([&] { tiny_vl().encode_vision(Tensor::zeros({4, 1176}, DType::i32), grid); },
               "argument 'pixel_values': expected a float tensor");
  expect_error([&] { tiny_vl().encode_vision(random_normal({4, 1176}), {}); }, "argument 'grids'");
  static const Model text = [] {
    const fs::path dir = fresh_dir("text_only");
    write_random_checkpoint(model_config_preset("tiny"), dir.string(), {.seed = 1, .dtype = DType::f32});
    return Model::load(dir.string());
  }();
  expect_error([&] { text.encode_vision(random_normal({4, 1176}), grid); },
               "expected a model with a vision tower");
}

// ---- weights ----

fs::path edited_vl_checkpoint(const std::string& name,
                              const std::function<void(std::vector<std::pair<std::string, Tensor>>&)>& edit) {
  const fs::path dir = fresh_dir(name);
  fs::copy_file(tiny_vl_dir() / "config.json", dir / "config.json");
  const SafetensorsFile file = SafetensorsFile::open((tiny_vl_dir() / "model.safetensors").string());
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const std::string& tensor : file.names()) tensors.emplace_back(tensor, file.get(tensor).clone());
  edit(tensors);
  save_safetensors((dir / "model.safetensors").string(), tensors);
  return dir;
}

TEST(VisionWeights, MissingMisshapedAndUnexpectedTensorsAreNamed) {
  const std::string bias = "patch_merge_mlp.linear_1.bias";
  std::string error = error_of([&] {
    Model::load(edited_vl_checkpoint("vl_missing", [&](auto& t) {
      std::erase_if(t, [&](const auto& e) { return e.first == bias; });
    }).string());
  });
  EXPECT_NE(error.find("missing tensor '" + bias + "' or 'model.multi_modal_projector.merge_linear_1.bias' (shape [48])"),
            std::string::npos)
      << error;
  const std::string patch = "vision_tower.vision_model.embeddings.patch_embedding.weight";
  error = error_of([&] {
    Model::load(edited_vl_checkpoint("vl_shape", [&](auto& t) {
      for (auto& e : t)
        if (e.first == patch) e.second = Tensor::zeros({40, 3, 1, 14, 14}, DType::f32);
    }).string());
  });
  EXPECT_NE(error.find("tensor '" + patch + "': expected shape [40, 3, 2, 14, 14], got [40, 3, 1, 14, 14]"),
            std::string::npos)
      << error;
  error = error_of([&] {
    Model::load(edited_vl_checkpoint("vl_extra", [&](auto& t) {
      t.emplace_back("vision_tower.vision_model.encoder.layers.2.mlp.fc1.bias", Tensor::zeros({80}, DType::f32));
    }).string());
  });
  EXPECT_NE(error.find("unexpected tensor 'vision_tower.vision_model.encoder.layers.2.mlp.fc1.bias'"),
            std::string::npos)
      << error;
}

// transformers >= 5.12 names (in-memory layout, save_original_format=False) load into the
// same weights; the patch embedding in bf16 is widened to f32.
TEST(VisionWeights, TransformersNamesLoadTheSameModel) {
  MSA_RESEED_AND_TRACE();
  const auto renamed = [](std::string name) {
    const std::pair<std::string, std::string> rules[] = {
        {"vision_tower.vision_model.embeddings.patch_embedding.", "model.vision_tower.embeddings.proj."},
        {"vision_tower.vision_model.encoder.layers.", "model.vision_tower.layers."},
        {"vision_tower.vision_model.pre_layrnorm.", "model.vision_tower.pre_layrnorm."},
        {"multi_modal_projector.", "model.multi_modal_projector."},
        {"patch_merge_mlp.linear_", "model.multi_modal_projector.merge_linear_"}};
    for (const auto& [from, to] : rules)
      if (name.starts_with(from)) return to + name.substr(from.size());
    return name;
  };
  const fs::path dir = edited_vl_checkpoint("vl_renamed", [&](auto& tensors) {
    for (auto& e : tensors) {
      const std::string before = e.first;
      e.first = renamed(e.first);
      if (before.ends_with("patch_embedding.weight")) e.second = e.second.to(DType::bf16);
    }
  });
  const Model model = Model::load(dir.string());
  EXPECT_EQ(model.weights().vision->patch_embedding.dtype(), DType::f32);
  const std::vector<VisionGrid> grids = {{.t = 2, .h = 2, .w = 4}};
  const Tensor pixels = random_pixels(grids);
  // Same weights but the patch embedding, which went through bf16: compare against the
  // original model with that one matrix rounded the same way.
  const fs::path rounded = edited_vl_checkpoint("vl_rounded", [&](auto& tensors) {
    for (auto& e : tensors)
      if (e.first.ends_with("patch_embedding.weight")) e.second = e.second.to(DType::bf16).to(DType::f32);
  });
  EXPECT_TRUE(testing::bitwise_equal(model.encode_vision(pixels, grids)[0],
                                     Model::load(rounded.string()).encode_vision(pixels, grids)[0]));
}

// ---- visual rows in the text model ----

TEST(VisualRows, PlaceFollowsThePlaceholdersInOrder) {
  const VisionConfig& v = vision();
  std::vector<int32_t> prompt = text_tokens(3, 1);
  append_image(prompt, 4, v.image_token_id);                 // image 0: 4 rows
  prompt.push_back(7);
  for (int frame = 0; frame < 3; ++frame) append_image(prompt, 2, v.video_token_id);  // video: 3 x 2
  append_image(prompt, 2, v.image_token_id);                 // image 1: 2 rows
  const Tensor image0 = random_normal({4, 64}), image1 = random_normal({2, 64}), video = random_normal({6, 64});
  const std::vector<Tensor> images = {image0, image1}, videos = {video};
  const std::vector<VisualRows> placed = place_visual_rows(prompt, v, 64, images, videos);
  // (first_token, rows, source tensor, first source row)
  ASSERT_EQ(placed.size(), 5u);
  const std::vector<std::tuple<int64_t, int64_t, const Tensor*, int64_t>> want = {
      {4, 4, &image0, 0}, {11, 2, &video, 0}, {15, 2, &video, 2}, {19, 2, &video, 4}, {23, 2, &image1, 0}};
  for (size_t i = 0; i < want.size(); ++i) {
    const auto& [first, rows, source, source_row] = want[i];
    EXPECT_EQ(placed[i].first_token, first) << i;
    EXPECT_EQ(placed[i].rows.size(0), rows) << i;
    EXPECT_EQ(placed[i].rows.raw(), source->data<float>() + source_row * 64) << i;  // a view
  }
  // The chunk [12, 20) holds the second row of frame 0, frame 1 and the first row of frame 2.
  const std::vector<VisualRows> chunk = visual_rows_in_range(placed, 12, 20);
  ASSERT_EQ(chunk.size(), 3u);
  EXPECT_EQ(chunk[0].first_token, 0);
  EXPECT_EQ(chunk[0].rows.size(0), 1);
  EXPECT_EQ(chunk[0].rows.raw(), video.data<float>() + 1 * 64);
  EXPECT_EQ(chunk[1].first_token, 3);
  EXPECT_EQ(chunk[1].rows.size(0), 2);
  EXPECT_EQ(chunk[2].first_token, 7);
  EXPECT_EQ(chunk[2].rows.size(0), 1);
  EXPECT_EQ(chunk[2].rows.raw(), video.data<float>() + 4 * 64);
  expect_error([&] { place_visual_rows(prompt, v, 64, std::vector<Tensor>{image0}, videos); },
               "the prompt has 6 image placeholder tokens (id 500), the images give 4 rows");
  expect_error([&] { place_visual_rows(prompt, v, 64, images, std::vector<Tensor>{random_normal({6, 63})}); },
               "argument 'video[0]'");
}

Tensor prefill(const Model& model, const std::vector<int32_t>& tokens,
               const std::vector<VisualRows>& visual, int64_t chunk) {
  KvCache cache(model.config(), 64);
  SequenceCache sequence;
  const int64_t n = static_cast<int64_t>(tokens.size()), V = model.config().vocab_size;
  Tensor logits = Tensor::zeros({n, V}, DType::f32);
  for (int64_t begin = 0; begin < n; begin += chunk) {
    const int64_t end = std::min(n, begin + chunk);
    const std::vector<VisualRows> step = visual_rows_in_range(visual, begin, end);
    const ForwardRequest request{.sequence = &sequence, .tokens = std::span(tokens).subspan(begin, end - begin),
                                 .all_logits = true, .visual = step};
    const Tensor part = model.forward({&request, 1}, cache);
    std::copy_n(part.data<float>(), part.numel(), logits.data<float>() + begin * V);
  }
  return logits;
}

// A prompt with an image of 6 rows and a video of 3 frames x 2 rows, and its rows.
struct VisualPrompt {
  std::vector<int32_t> tokens;
  std::vector<Tensor> images, videos;
  std::vector<VisualRows> visual;
};

VisualPrompt visual_prompt(int32_t salt) {
  VisualPrompt p;
  p.tokens = text_tokens(20, salt);  // more than one 16-token block before the image
  append_image(p.tokens, 6, vision().image_token_id);
  const std::vector<int32_t> middle = text_tokens(5, salt + 1);
  p.tokens.insert(p.tokens.end(), middle.begin(), middle.end());
  for (int frame = 0; frame < 3; ++frame) append_image(p.tokens, 2, vision().video_token_id);
  const std::vector<int32_t> tail = text_tokens(9, salt + 2);
  p.tokens.insert(p.tokens.end(), tail.begin(), tail.end());
  p.images = tiny_vl().encode_vision(random_pixels({{.t = 1, .h = 4, .w = 6}}), std::vector<VisionGrid>{{.t = 1, .h = 4, .w = 6}});
  p.videos = tiny_vl().encode_vision(random_pixels({{.t = 3, .h = 2, .w = 4}}), std::vector<VisionGrid>{{.t = 3, .h = 2, .w = 4}});
  p.visual = place_visual_rows(p.tokens, vision(), tiny_vl().config().hidden_size, p.images, p.videos);
  return p;
}

TEST(VisualRows, ChunksThatCutAnImageGiveTheLogitsOfOneChunk) {
  MSA_RESEED_AND_TRACE();
  const VisualPrompt p = visual_prompt(1);
  const Tensor whole = prefill(tiny_vl(), p.tokens, p.visual, static_cast<int64_t>(p.tokens.size()));
  for (const int64_t chunk : {1, 3, 5, 7, 16, 23}) {
    SCOPED_TRACE("chunk " + std::to_string(chunk));
    EXPECT_LT(testing::max_abs_diff(prefill(tiny_vl(), p.tokens, p.visual, chunk), whole), 1e-4);
  }
  // The rows are used: without them (placeholder embeddings) the logits after the image differ,
  // before it they do not.
  const Tensor text = prefill(tiny_vl(), p.tokens, {}, static_cast<int64_t>(p.tokens.size()));
  EXPECT_LT(testing::max_abs_diff(text.slice0(0, 21).clone(), whole.slice0(0, 21).clone()), 1e-5);
  EXPECT_GT(testing::max_abs_diff(text.slice0(21, 22).clone(), whole.slice0(21, 22).clone()), 1e-2);
}

TEST(VisualRows, BatchedRequestsWithImagesEqualSeparateOnes) {
  MSA_RESEED_AND_TRACE();
  const VisualPrompt a = visual_prompt(2), b = visual_prompt(3);
  KvCache cache(tiny_vl().config(), 64);
  SequenceCache sa, sb;
  const ForwardRequest requests[] = {
      {.sequence = &sa, .tokens = a.tokens, .all_logits = true, .visual = a.visual},
      {.sequence = &sb, .tokens = b.tokens, .all_logits = true, .visual = b.visual}};
  const Tensor both = tiny_vl().forward(requests, cache);
  const int64_t n = static_cast<int64_t>(a.tokens.size());
  EXPECT_LT(testing::max_abs_diff(both.slice0(0, n).clone(), prefill(tiny_vl(), a.tokens, a.visual, n)), 1e-4);
  EXPECT_LT(testing::max_abs_diff(both.slice0(n, 2 * n).clone(), prefill(tiny_vl(), b.tokens, b.visual, n)), 1e-4);
}

TEST(VisualRows, BadRowsAreNamedAndLeaveTheSequenceAlone) {
  const VisualPrompt p = visual_prompt(4);
  KvCache cache(tiny_vl().config(), 64);
  SequenceCache sequence;
  const auto rejected = [&](std::vector<VisualRows> visual, const std::string& words) {
    SCOPED_TRACE(words);
    const ForwardRequest request{.sequence = &sequence, .tokens = p.tokens, .visual = visual};
    expect_error([&] { tiny_vl().forward({&request, 1}, cache); }, words);
    EXPECT_EQ(sequence.length, 0);
    EXPECT_TRUE(sequence.pages.empty());
  };
  const Tensor rows6 = p.images[0];
  rejected({{.first_token = 20, .rows = rows6}},
           "argument 'requests[0].visual[0]': expected rows for image (500) or video (501) placeholder "
           "tokens, got token 502 at index 20");
  rejected({{.first_token = 21, .rows = rows6}, {.first_token = 26, .rows = rows6.slice0(0, 1)}},
           "argument 'requests[0].visual[1]': expected rows for tokens no other span covers");
  rejected({{.first_token = static_cast<int64_t>(p.tokens.size()) - 2, .rows = rows6}},
           "argument 'requests[0].visual[0].first_token'");
  rejected({{.first_token = -1, .rows = rows6}}, "argument 'requests[0].visual[0].first_token'");
  rejected({{.first_token = 21, .rows = random_normal({6, 63})}},
           "argument 'requests[0].visual[0].rows': expected f32 rows [n >= 1, hidden = 64]");
  rejected({{.first_token = 21, .rows = rows6.to(DType::bf16)}},
           "argument 'requests[0].visual[0].rows': expected dtype f32");
  rejected({{.first_token = 21, .rows = Tensor()}}, "argument 'requests[0].visual[0].rows'");
}

// ---- the engine ----

std::vector<int32_t> generate(const Model& model, const GenerationRequest& request, EngineOptions options) {
  Engine engine(model, options);
  engine.submit(request);
  std::vector<int32_t> out;
  while (!engine.idle())
    for (const TokenEvent& event : engine.step()) out.push_back(event.token);
  return out;
}

TEST(VisionEngine, PrefillChunksThatCutImagesGiveTheSameTokens) {
  MSA_RESEED_AND_TRACE();
  const VisualPrompt p = visual_prompt(5);
  const GenerationRequest request{.prompt = p.tokens, .max_tokens = 8, .visual = p.visual};
  const std::vector<int32_t> whole = generate(tiny_vl(), request, {.cache_tokens = 256, .prefill_chunk = 256});
  ASSERT_EQ(whole.size(), 8u);
  // The first token is the argmax of the prompt's last logits.
  const Tensor logits = prefill(tiny_vl(), p.tokens, p.visual, 256);
  const int64_t V = tiny_vl().config().vocab_size, last = static_cast<int64_t>(p.tokens.size()) - 1;
  const float* row = logits.data<float>() + last * V;
  EXPECT_EQ(whole[0], std::max_element(row, row + V) - row);
  for (const int64_t chunk : {3, 5, 7, 22})
    EXPECT_EQ(generate(tiny_vl(), request, {.cache_tokens = 256, .prefill_chunk = chunk}), whole) << chunk;
  // Without the images the continuation differs (the rows reach the sampled tokens).
  GenerationRequest text_only = request;
  text_only.visual.clear();
  EXPECT_NE(generate(tiny_vl(), text_only, {.cache_tokens = 256}), whole);
}

TEST(VisionEngine, PrefixCacheSharesOnlyTheBlocksBeforeTheFirstImage) {
  MSA_RESEED_AND_TRACE();
  const VisualPrompt first = visual_prompt(6);
  VisualPrompt second = first;  // the same tokens, other images
  second.images = tiny_vl().encode_vision(random_pixels({{.t = 1, .h = 4, .w = 6}}), std::vector<VisionGrid>{{.t = 1, .h = 4, .w = 6}});
  second.visual = place_visual_rows(second.tokens, vision(), 64, second.images, first.videos);
  const EngineOptions cached{.cache_tokens = 512, .prefix_caching = true};
  Engine engine(tiny_vl(), cached);
  for (const VisualPrompt* p : {&first, static_cast<const VisualPrompt*>(&second)}) {
    engine.submit({.prompt = p->tokens, .max_tokens = 6, .visual = p->visual});
    while (!engine.idle()) engine.step();
  }
  // The image starts at token 20: one whole block of 16 tokens is shareable.
  EXPECT_EQ(engine.stats().cached_prompt_tokens, 16);
  // And the second request's tokens are its own, as when run alone.
  Engine again(tiny_vl(), cached);
  again.submit({.prompt = first.tokens, .max_tokens = 6, .visual = first.visual});
  while (!again.idle()) again.step();
  std::vector<int32_t> shared;
  again.submit({.prompt = second.tokens, .max_tokens = 6, .visual = second.visual});
  while (!again.idle())
    for (const TokenEvent& event : again.step()) shared.push_back(event.token);
  EXPECT_EQ(shared, generate(tiny_vl(), {.prompt = second.tokens, .max_tokens = 6, .visual = second.visual},
                             {.cache_tokens = 512}));
}

TEST(VisionEngine, SubmitChecksTheRows) {
  const VisualPrompt p = visual_prompt(7);
  Engine engine(tiny_vl(), {.cache_tokens = 256});
  expect_error([&] { engine.submit({.prompt = p.tokens, .visual = {{.first_token = 0, .rows = p.images[0]}}}); },
               "argument 'visual[0]': expected rows for image (500) or video (501) placeholder tokens");
  EXPECT_TRUE(engine.idle());
}

// ---- the CLI ----

TEST(VisionCli, VisionEncodeAndLogitsWithPixels) {
  MSA_RESEED_AND_TRACE();
  const fs::path dir = fresh_dir("vision_cli");
  ASSERT_EQ(cli({"make-model", "--config", "tiny-vl", "--out", (dir / "m").string()}).exit_code, 0);
  EXPECT_TRUE(fs::exists(dir / "m" / "preprocessor_config.json"));
  EXPECT_TRUE(fs::exists(dir / "m" / "video_preprocessor_config.json"));
  const Tensor pixels = random_normal({24, 1176});
  std::vector<int32_t> grid = {1, 4, 6};
  save_safetensors((dir / "pixels.safetensors").string(),
                   {{"pixel_values", pixels}, {"image_grid_thw", Tensor::from_vector(grid, {1, 3})}});
  const testing::CliResult encoded =
      cli({"vision-encode", "--model", (dir / "m").string(), "--pixels", (dir / "pixels.safetensors").string(),
               "--out", (dir / "enc.safetensors").string()});
  ASSERT_EQ(encoded.exit_code, 0) << encoded.out;
  const SafetensorsFile out = SafetensorsFile::open((dir / "enc.safetensors").string());
  EXPECT_EQ(out.get("image_features").shape(), (Shape{24, 40}));
  EXPECT_EQ(out.get("image_embeds").shape(), (Shape{6, 64}));
  const Model model = Model::load((dir / "m").string());
  EXPECT_TRUE(testing::bitwise_equal(out.get("image_embeds").clone(),
                                     model.encode_vision(pixels, std::vector<VisionGrid>{{.t = 1, .h = 4, .w = 6}})[0]));

  std::string tokens = "5,6,502,500,500,500,500,500,500,503,7";
  const testing::CliResult logits =
      cli({"logits", "--model", (dir / "m").string(), "--tokens", tokens, "--pixels",
               (dir / "pixels.safetensors").string(), "--chunk", "4", "--out", (dir / "l.safetensors").string()});
  ASSERT_EQ(logits.exit_code, 0) << logits.out;

  // Errors: placeholder count, a text-only model, a file without grids, a bad grid.
  const testing::CliResult wrong_count =
      cli({"logits", "--model", (dir / "m").string(), "--tokens", "5,500,6", "--pixels",
               (dir / "pixels.safetensors").string(), "--out", (dir / "l2.safetensors").string()});
  EXPECT_EQ(wrong_count.exit_code, 2);
  EXPECT_NE(wrong_count.out.find("the prompt has 1 image placeholder tokens (id 500), the images give 6 rows"),
            std::string::npos)
      << wrong_count.out;
  ASSERT_EQ(cli({"make-model", "--config", "tiny", "--out", (dir / "text").string()}).exit_code, 0);
  const testing::CliResult text_only =
      cli({"vision-encode", "--model", (dir / "text").string(), "--pixels", (dir / "pixels.safetensors").string(),
               "--out", (dir / "e2.safetensors").string()});
  EXPECT_EQ(text_only.exit_code, 2);
  EXPECT_NE(text_only.out.find("has no vision tower"), std::string::npos) << text_only.out;
  save_safetensors((dir / "nogrid.safetensors").string(), {{"pixel_values", pixels}});
  const testing::CliResult no_grid =
      cli({"vision-encode", "--model", (dir / "m").string(), "--pixels", (dir / "nogrid.safetensors").string(),
               "--out", (dir / "e3.safetensors").string()});
  EXPECT_EQ(no_grid.exit_code, 2);
  EXPECT_NE(no_grid.out.find("expected both 'pixel_values' and 'image_grid_thw' or neither"), std::string::npos)
      << no_grid.out;
  grid = {1, 3, 8};
  save_safetensors((dir / "badgrid.safetensors").string(),
                   {{"pixel_values", pixels}, {"image_grid_thw", Tensor::from_vector(grid, {1, 3})}});
  const testing::CliResult bad_grid =
      cli({"vision-encode", "--model", (dir / "m").string(), "--pixels", (dir / "badgrid.safetensors").string(),
               "--out", (dir / "e4.safetensors").string()});
  EXPECT_EQ(bad_grid.exit_code, 2);
  EXPECT_NE(bad_grid.out.find("argument 'grids[0].h'"), std::string::npos) << bad_grid.out;
}

}  // namespace
}  // namespace msa
