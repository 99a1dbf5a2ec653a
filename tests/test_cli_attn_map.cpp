// `msa attn-map` end to end on a checkpoint made by `msa make-model --config tiny`: the JSON's
// numbers against the brute force over the taps of the same prefill, the PNGs decoded by
// libpng at the layout's size, the overlay image, --prompt, and clear errors.
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "attention_map_brute_force.h"
#include "cli_runner.h"
#include "msa/attention_map.h"
#include "png_files.h"
#include "test_util.h"
#ifdef MSA_WITH_TOKENIZER
#include "msa/tokenizer.h"
#endif

namespace msa {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing::CliResult;
using testing::run_cli;
using testing::shell_quote;

// `msa make-model --config tiny` once: layers 0 (dense), 1 and 2 (MSA), Hq 4, blocks of 16,
// top-4; a tokenizer beside it.
const std::string& made_model() {
  static const std::string dir = testing::make_model_with_cli("tiny", 5, "attn_map_cli_model");
  return dir;
}
const Model& model() {
  static const Model m = Model::load(made_model());
  return m;
}

// 100 token ids: the MSA layers' selection matters from position 64 on.
std::vector<int32_t> tokens100() {
  std::vector<int32_t> ids;
  for (int i = 0; i < 100; ++i) ids.push_back((i * 29 + 3) % 480 + 10);
  return ids;
}
std::string id_list(const std::vector<int32_t>& ids) {
  std::string out;
  for (int32_t id : ids) out += (out.empty() ? "" : ",") + std::to_string(id);
  return out;
}

json read_json(const fs::path& path) { return json::parse(testing::read_bytes(path.string())); }

// Every JSON number of every layer against the brute force over the same prompt's taps.
void expect_json_matches_brute_force(const json& doc, const std::vector<int32_t>& tokens,
                                     const AttentionMapSpec& spec) {
  const std::map<std::string, Tensor> taps = testing::tap_one_prefill(model(), tokens);
  const ModelConfig& c = model().config();
  ASSERT_EQ(doc["layers"].size(), spec.layers.size());
  for (size_t i = 0; i < spec.layers.size(); ++i) {
    const json& layer = doc["layers"][i];
    const int64_t id = spec.layers[i];
    SCOPED_TRACE("layer " + std::to_string(id));
    ASSERT_EQ(layer["layer"].get<int64_t>(), id);
    const testing::BruteForceLayer expected = testing::brute_force_layer(taps, c, id, spec);
    EXPECT_EQ(layer["kind"], c.sparse_layers[id] ? "msa" : "dense");
    // JSON doubles round-trip exactly; the two computations differ by f64 rounding only.
    EXPECT_NEAR(layer["visual_mass_share"].get<double>(), expected.mass, 1e-12);
    if (c.sparse_layers[id])
      EXPECT_NEAR(layer["selected_visual_block_share"].get<double>(), expected.block_share, 1e-12);
    else
      EXPECT_TRUE(layer["selected_visual_block_share"].is_null());
    const json& heatmap = layer["heatmap"];
    ASSERT_EQ(heatmap.size(), static_cast<size_t>(spec.grid_rows));
    for (int64_t r = 0; r < spec.grid_rows; ++r) {
      ASSERT_EQ(heatmap[r].size(), static_cast<size_t>(spec.grid_cols));
      for (int64_t col = 0; col < spec.grid_cols; ++col)
        EXPECT_NEAR(heatmap[r][col].get<double>(), expected.heat[r * spec.grid_cols + col], 1e-12)
            << "cell " << r << "," << col;
    }
  }
}

// The PNG decodes (libpng) at the layout's size.
void expect_png(const fs::path& path, int64_t rows, int64_t cols, const RgbImageView* image) {
  const testing::DecodedPng png = testing::decode_png(path.string());
  ASSERT_TRUE(png.ok) << path << ": " << png.error;
  const HeatmapLayout layout = heatmap_layout(rows, cols, image);
  EXPECT_EQ(png.width, layout.width) << path;
  EXPECT_EQ(png.height, layout.height) << path;
}

TEST(CliAttnMap, JsonMatchesTheBruteForceAndPngsDecode) {
  const fs::path out = testing::fresh_dir("attn_map_cli") / "maps";
  const std::vector<int32_t> tokens = tokens100();
  const CliResult result = run_cli("attn-map --model " + shell_quote(made_model()) + " --tokens " +
                                   id_list(tokens) + " --span 16:80 --grid 8x8 --out " + shell_quote(out.string()));
  ASSERT_EQ(result.exit_code, 0) << result.out;
  EXPECT_NE(result.out.find("layer 1 (MSA)"), std::string::npos) << result.out;
  const json doc = read_json(out / "attention_map.json");
  EXPECT_EQ(doc["tokens"].get<std::vector<int32_t>>(), tokens);
  EXPECT_EQ(doc["num_tokens"], 100);
  EXPECT_EQ(doc["span"], (json{{"begin", 16}, {"end", 80}}));
  EXPECT_EQ(doc["grid"], (json{{"rows", 8}, {"cols", 8}}));
  EXPECT_EQ(doc["queries"], (json{{"begin", 80}, {"end", 100}}));
  EXPECT_EQ(doc["heads"], (json{0, 1, 2, 3}));
  EXPECT_EQ(doc["block_size"], 16);
  EXPECT_TRUE(doc["image"].is_null());
  double uniform = 0;  // mean over queries i of 64 / (i + 1)
  for (int i = 80; i < 100; ++i) uniform += 64.0 / (i + 1) / 20;
  EXPECT_NEAR(doc["uniform_visual_share"].get<double>(), uniform, 1e-12);
  const AttentionMapSpec spec{.span_begin = 16, .span_end = 80, .grid_rows = 8, .grid_cols = 8,
                              .query_begin = 80, .query_end = 100, .layers = {0, 1, 2}, .heads = {0, 1, 2, 3}};
  expect_json_matches_brute_force(doc, tokens, spec);
  for (int layer = 0; layer < 3; ++layer) {
    const std::string name = "layer_" + std::to_string(layer) + ".png";
    if (attention_map_png_available()) {
      EXPECT_EQ(doc["layers"][layer]["png"], name);
      expect_png(out / name, 8, 8, nullptr);
    } else {
      EXPECT_TRUE(doc["layers"][layer]["png"].is_null());
      EXPECT_FALSE(fs::exists(out / name));
      EXPECT_NE(result.out.find("need cairo"), std::string::npos) << result.out;
    }
  }
}

TEST(CliAttnMap, ChosenLayersHeadsAndQueriesOverAnImage) {
  if (!attention_map_png_available()) GTEST_SKIP() << "--image-rgb needs cairo";
  const fs::path dir = testing::fresh_dir("attn_map_cli_image");
  // A 64 x 32 gradient as the overlay.
  const int64_t W = 64, H = 32;
  std::vector<uint8_t> rgb(W * H * 3);
  for (int64_t i = 0; i < W * H; ++i) {
    rgb[3 * i] = static_cast<uint8_t>(4 * (i % W));
    rgb[3 * i + 1] = static_cast<uint8_t>(8 * (i / W));
    rgb[3 * i + 2] = 90;
  }
  ASSERT_TRUE(testing::write_png((dir / "image.png").string(), W, H, 3, rgb));
  const std::vector<int32_t> tokens = tokens100();
  const CliResult result =
      run_cli("attn-map --model " + shell_quote(made_model()) + " --tokens " + id_list(tokens) +
              " --span 20:84 --grid 4x16 --queries 50:100 --layers 2,0 --heads 3,1 --upsample bilinear"
              " --alpha 0.4 --image-rgb " + shell_quote((dir / "image.png").string()) + " --out " +
              shell_quote((dir / "maps").string()));
  ASSERT_EQ(result.exit_code, 0) << result.out;
  const json doc = read_json(dir / "maps" / "attention_map.json");
  EXPECT_EQ(doc["image"]["width"], W);
  EXPECT_EQ(doc["image"]["height"], H);
  EXPECT_EQ(doc["heads"], (json{1, 3}));
  const AttentionMapSpec spec{.span_begin = 20, .span_end = 84, .grid_rows = 4, .grid_cols = 16,
                              .query_begin = 50, .query_end = 100, .layers = {0, 2}, .heads = {1, 3}};
  expect_json_matches_brute_force(doc, tokens, spec);
  const RgbImageView image{.width = W, .height = H, .rgb = rgb};
  expect_png(dir / "maps" / "layer_0.png", 4, 16, &image);
  expect_png(dir / "maps" / "layer_2.png", 4, 16, &image);
  EXPECT_FALSE(fs::exists(dir / "maps" / "layer_1.png"));
}

#ifdef MSA_WITH_TOKENIZER
TEST(CliAttnMap, PromptTextIsTokenizedWithItsTokenTexts) {
  const fs::path out = testing::fresh_dir("attn_map_cli_prompt") / "maps";
  const std::string text = "the quick brown fox jumps over the lazy dog";
  const std::vector<int32_t> tokens = Tokenizer::from_model_dir(made_model()).encode(text, true);
  ASSERT_GE(tokens.size(), 8u);
  const CliResult result = run_cli("attn-map --model " + shell_quote(made_model()) + " --prompt " +
                                   shell_quote(text) + " --span 1:5 --grid 2x2 --out " + shell_quote(out.string()));
  ASSERT_EQ(result.exit_code, 0) << result.out;
  const json doc = read_json(out / "attention_map.json");
  EXPECT_EQ(doc["prompt"], text);
  EXPECT_EQ(doc["tokens"].get<std::vector<int32_t>>(), tokens);
  EXPECT_EQ(doc["token_texts"].size(), tokens.size());
  const AttentionMapSpec spec{.span_begin = 1, .span_end = 5, .grid_rows = 2, .grid_cols = 2,
                              .query_begin = 5, .query_end = static_cast<int64_t>(tokens.size()),
                              .layers = {0, 1, 2}, .heads = {0, 1, 2, 3}};
  expect_json_matches_brute_force(doc, tokens, spec);
}
#endif

TEST(CliAttnMap, BadInputGetsClearErrors) {
  const std::string model_flag = "attn-map --model " + shell_quote(made_model());
  const std::string out = " --out " + shell_quote((testing::fresh_dir("attn_map_cli_errors") / "maps").string());
  const std::string ten = " --tokens 5,6,7,8,9,10,11,12,13,14";
  const auto expect_failure = [&](const std::string& args, const std::string& words) {
    const CliResult result = run_cli(args);
    EXPECT_EQ(result.exit_code, 2) << args << "\n" << result.out;
    EXPECT_NE(result.out.find(words), std::string::npos) << args << "\n" << result.out;
  };
  expect_failure(model_flag + ten + " --span 2:6 --grid 2x3" + out, "'grid': expected rows x cols = 4");
  expect_failure(model_flag + ten + " --span 2:11 --grid 3x3" + out, "'span'");
  expect_failure(model_flag + ten + " --span 2:10 --grid 2x4" + out, "give a query range");
  expect_failure(model_flag + ten + " --span 2-6 --grid 2x2" + out, "--span: expected a token range A:B");
  expect_failure(model_flag + ten + " --span 2:6 --grid 2*2" + out, "--grid: expected rows x columns");
  expect_failure(model_flag + ten + " --span 2:6 --grid 2x2 --layers 0,5" + out, "'layers'");
  expect_failure(model_flag + ten + " --span 2:6 --grid 2x2 --heads 1,1" + out, "--heads");
  expect_failure(model_flag + ten + " --span 2:6 --grid 2x2 --queries 7:7" + out, "'queries'");
  expect_failure(model_flag + ten + " --span 2:6 --grid 2x2 --upsample cubic" + out, "--upsample");
  expect_failure(model_flag + ten + " --span 2:6 --grid 2x2 --alpha 2" + out, "--alpha");
  expect_failure(model_flag + ten + " --prompt hi --span 2:6 --grid 2x2" + out, "exactly one of --tokens and --prompt");
  expect_failure(model_flag + ten + " --span 2:6 --grid 2x2", "--out is required");
  expect_failure(model_flag + ten + " --span 2:6 --grid 2x2 --out " + shell_quote(made_model() + "/maps"),
                 "refusing to write");
  expect_failure(model_flag + ten + " --span 2:6 --grid 2x2 --image-rgb " +
                     shell_quote(made_model() + "/config.json") + out,
                 attention_map_png_available() ? "expected a PNG" : "cairo");
  expect_failure("attn-map --model /nonexistent/dir" + ten + " --span 2:6 --grid 2x2" + out, "model");
  const CliResult help = run_cli("attn-map --help");
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_NE(help.out.find("--span A:B"), std::string::npos) << help.out;
}

}  // namespace
}  // namespace msa
