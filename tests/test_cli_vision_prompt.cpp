// `msa run --image/--video` and `msa attn-map --image` end to end on a checkpoint made by
// `msa make-model --config tiny-vl`: the prompt the chat template builds (against ids built here
// piece by piece), the generated tokens (against the Engine given the same visual rows, encoded
// here from the media front end), chunked prefill through the image, two images, a video from a
// folder of frames, the raw layout, errors naming the file or both counts, and the attention
// maps over the image's tokens.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli_runner.h"
#include "msa/attention_map.h"
#include "msa/model.h"
#include "msa/model_engine.h"
#include "msa/model_vision.h"
#include "msa/tokenizer.h"
#include "msa/vision_media.h"
#include "png_files.h"
#include "test_util.h"

namespace msa {
namespace {

namespace fs = std::filesystem;
namespace mv = msa::vision;
using nlohmann::json;
using testing::CliResult;
using testing::run_cli;
using testing::shell_quote;

const std::string& made_model() {
  static const std::string dir = testing::make_model_with_cli("tiny-vl", 3, "vision_prompt_model");
  return dir;
}
const Model& model() {
  static const Model m = Model::load(made_model());
  return m;
}
const Tokenizer& tokenizer() {
  static const Tokenizer t = Tokenizer::from_model_dir(made_model());
  return t;
}
const VisionConfig& vision() { return *model().config().vision; }

// A smooth gradient with a disc: something an eye would call a picture (fixed, no randomness).
std::vector<uint8_t> picture(int64_t width, int64_t height, int shift) {
  std::vector<uint8_t> rgb(static_cast<size_t>(width * height * 3));
  for (int64_t y = 0; y < height; ++y)
    for (int64_t x = 0; x < width; ++x) {
      uint8_t* p = rgb.data() + (y * width + x) * 3;
      const int64_t dx = x - width / 2, dy = y - height / 2;
      const bool disc = dx * dx + dy * dy < (height / 3) * (height / 3);
      p[0] = static_cast<uint8_t>(disc ? 220 : (x * 255 / width + shift) % 256);
      p[1] = static_cast<uint8_t>(disc ? 60 : y * 255 / height);
      p[2] = static_cast<uint8_t>((shift * 7 + 90) % 256);
    }
  return rgb;
}

std::string write_picture(const fs::path& path, int64_t width, int64_t height, int shift = 0) {
  EXPECT_TRUE(testing::write_png(path.string(), width, height, 3, picture(width, height, shift)));
  return path.string();
}

std::vector<int32_t> parse_ids(const std::string& text) {
  std::vector<int32_t> ids;
  std::istringstream in(text);
  for (int32_t id; in >> id;) ids.push_back(id);
  return ids;
}

struct RunOutput {
  std::vector<int32_t> prompt, generated;
};

// `msa run ... --print-prompt`: the "prompt:" line of stderr and the first stdout line.
RunOutput run_ok(const std::string& args) {
  const fs::path dir = testing::fresh_dir("vision_prompt_run");
  const CliResult result = run_cli("run --model " + shell_quote(made_model()) + " --print-prompt " + args, dir,
                                   /*merge_stderr=*/false);
  EXPECT_EQ(result.exit_code, 0) << result.err;
  RunOutput out;
  const size_t at = result.err.find("prompt:");
  EXPECT_NE(at, std::string::npos) << result.err;
  if (at != std::string::npos)
    out.prompt = parse_ids(result.err.substr(at + 7, result.err.find('\n', at) - at - 7));
  out.generated = parse_ids(result.out.substr(0, result.out.find('\n')));
  return out;
}

void append(std::vector<int32_t>& ids, const std::vector<int32_t>& more) { ids.insert(ids.end(), more.begin(), more.end()); }
std::vector<int32_t> text_ids(const std::string& text) { return tokenizer().encode(text, false); }

// The image's placeholder block as MiniMaxM3VLProcessor writes it.
std::vector<int32_t> image_block(const mv::PixelPatches& image) {
  std::vector<int32_t> ids = {vision().vision_start_token_id};
  ids.insert(ids.end(), static_cast<size_t>(image.grid_h * image.grid_w / 4), vision().image_token_id);
  ids.push_back(vision().vision_end_token_id);
  return ids;
}

// The made chat template's user turn around `inner`, then the assistant's header.
std::vector<int32_t> chat(const std::vector<int32_t>& inner, const std::string& text) {
  std::vector<int32_t> ids = text_ids(tokenizer().bos_token() + "]~b]user\n");
  append(ids, inner);
  append(ids, text_ids(text + "[e~[\n]~b]ai\n"));
  return ids;
}

mv::PixelPatches image_patches(const std::string& path) {
  return mv::preprocess_image(mv::decode_image(path), mv::load_image_processor_config(made_model()));
}

// Greedy tokens of the Engine given the prompt and the media's rows (encoded here, one call
// per kind as the CLI does).
std::vector<int32_t> engine_tokens(const std::vector<int32_t>& prompt, const std::vector<mv::PixelPatches>& images,
                                   const std::vector<mv::PixelPatches>& videos, int64_t max_tokens, int64_t chunk = 256) {
  const auto encode = [](const std::vector<mv::PixelPatches>& media) -> std::vector<Tensor> {
    if (media.empty()) return {};
    int64_t rows = 0;
    std::vector<VisionGrid> grids;
    for (const auto& m : media) {
      rows += m.pixel_values.size(0);
      grids.push_back({.t = m.grid_t, .h = m.grid_h, .w = m.grid_w});
    }
    Tensor values = Tensor::zeros({rows, media[0].pixel_values.size(1)}, DType::f32);
    float* dst = values.data<float>();
    for (const auto& m : media) dst = std::copy_n(m.pixel_values.data<float>(), m.pixel_values.numel(), dst);
    return model().encode_vision(values, grids);
  };
  GenerationRequest request{.prompt = prompt, .max_tokens = max_tokens,
                            .stop_tokens = model().config().eos_token_ids};
  request.visual = place_visual_rows(prompt, vision(), model().config().hidden_size, encode(images), encode(videos));
  Engine engine(model(), {.cache_tokens = static_cast<int64_t>(prompt.size()) + max_tokens, .prefill_chunk = chunk});
  engine.submit(request);
  std::vector<int32_t> out;
  while (!engine.idle())
    for (const TokenEvent& event : engine.step()) out.push_back(event.token);
  return out;
}

TEST(CliVisionPrompt, OneImageThroughTheChatTemplate) {
  const fs::path dir = testing::fresh_dir("vision_prompt_one");
  const std::string image = write_picture(dir / "picture.png", 100, 70);
  const RunOutput out = run_ok("--image " + shell_quote(image) + " --prompt 'what is this' --max-tokens 6");
  const mv::PixelPatches patches = image_patches(image);
  EXPECT_EQ(out.prompt, chat(image_block(patches), "what is this"));
  ASSERT_EQ(out.generated.size(), 6u);
  EXPECT_EQ(out.generated, engine_tokens(out.prompt, {patches}, {}, 6));
  // Chunked prefill through the image gives the same tokens.
  const RunOutput chunked = run_ok("--image " + shell_quote(image) + " --prompt 'what is this' --max-tokens 6 --chunk 5");
  EXPECT_EQ(chunked.prompt, out.prompt);
  EXPECT_EQ(chunked.generated, out.generated);
  // --prompt-tokens holding the same placeholders: the same answer.
  std::string ids;
  for (int32_t id : out.prompt) ids += (ids.empty() ? "" : ",") + std::to_string(id);
  const RunOutput by_ids = run_ok("--image " + shell_quote(image) + " --prompt-tokens " + ids + " --max-tokens 6");
  EXPECT_EQ(by_ids.generated, out.generated);
}

TEST(CliVisionPrompt, ImagesChangeTheAnswerLogits) {
  // Two different pictures of the same size: the same prompt ids, different visual rows; the
  // Engine's tokens follow the rows (a check that the rows are used at all).
  const fs::path dir = testing::fresh_dir("vision_prompt_rows");
  const std::string a = write_picture(dir / "a.png", 84, 56, 0), b = write_picture(dir / "b.png", 84, 56, 120);
  const RunOutput out_a = run_ok("--image " + shell_quote(a) + " --prompt 'look' --max-tokens 8 --temperature 0");
  const RunOutput out_b = run_ok("--image " + shell_quote(b) + " --prompt 'look' --max-tokens 8");
  EXPECT_EQ(out_a.prompt, out_b.prompt);
  EXPECT_NE(out_a.generated, out_b.generated);  // fixed weights and pictures: they differ
  EXPECT_EQ(out_a.generated, engine_tokens(out_a.prompt, {image_patches(a)}, {}, 8));
  EXPECT_EQ(out_b.generated, engine_tokens(out_b.prompt, {image_patches(b)}, {}, 8));
}

TEST(CliVisionPrompt, TwoImagesInOrder) {
  const fs::path dir = testing::fresh_dir("vision_prompt_two");
  const std::string a = write_picture(dir / "a.png", 100, 70, 10), b = write_picture(dir / "b.png", 60, 168, 50);
  const RunOutput out = run_ok("--image " + shell_quote(a) + " --image " + shell_quote(b) +
                               " --prompt 'compare them' --max-tokens 5");
  const mv::PixelPatches pa = image_patches(a), pb = image_patches(b);
  ASSERT_NE(pa.grid_h * pa.grid_w, pb.grid_h * pb.grid_w);  // the order shows in the counts
  std::vector<int32_t> inner = image_block(pa);
  append(inner, image_block(pb));
  EXPECT_EQ(out.prompt, chat(inner, "compare them"));
  EXPECT_EQ(out.generated, engine_tokens(out.prompt, {pa, pb}, {}, 5));
}

TEST(CliVisionPrompt, VideoFromAFolderOfFrames) {
  const fs::path dir = testing::fresh_dir("vision_prompt_video");
  fs::create_directories(dir / "frames");
  for (int i = 0; i < 6; ++i) write_picture(dir / "frames" / ("f" + std::to_string(i) + ".png"), 84, 56, 30 * i);
  const RunOutput out = run_ok("--video " + shell_quote((dir / "frames").string()) +
                               " --fps 2 --prompt 'what happens' --max-tokens 5");
  const mv::VideoProcessorConfig config = mv::load_video_processor_config(made_model());
  const mv::PixelPatches video = mv::preprocess_video(
      mv::load_video((dir / "frames").string(), config, {.sample_fps = 2}), config);
  ASSERT_EQ(video.grid_t, 3);
  // Per temporal patch: its time (frames 0, 2, 4 at 2 fps), then the bracketed placeholders.
  std::vector<int32_t> inner;
  for (const char* seconds : {"]<]0.0 seconds[>[", "]<]1.0 seconds[>[", "]<]2.0 seconds[>["}) {
    append(inner, text_ids(seconds));
    inner.push_back(vision().vision_start_token_id);
    inner.insert(inner.end(), static_cast<size_t>(video.grid_h * video.grid_w / 4), vision().video_token_id);
    inner.push_back(vision().vision_end_token_id);
  }
  EXPECT_EQ(out.prompt, chat(inner, "what happens"));
  EXPECT_EQ(out.generated, engine_tokens(out.prompt, {}, {video}, 5));
  const RunOutput chunked = run_ok("--video " + shell_quote((dir / "frames").string()) +
                                   " --fps 2 --prompt 'what happens' --max-tokens 5 --chunk 7");
  EXPECT_EQ(chunked.generated, out.generated);
}

TEST(CliVisionPrompt, RawLayoutAndMarkersInTheText) {
  const fs::path dir = testing::fresh_dir("vision_prompt_raw");
  const std::string image = write_picture(dir / "p.png", 56, 56);
  const mv::PixelPatches patches = image_patches(image);
  // --raw-prompt: BOS (the tokenizer's post-processor), the image, the text; no template.
  const RunOutput raw = run_ok("--image " + shell_quote(image) + " --prompt 'hello' --raw-prompt --max-tokens 3");
  std::vector<int32_t> expected = tokenizer().encode("", true);
  append(expected, image_block(patches));
  append(expected, text_ids("hello"));
  EXPECT_EQ(raw.prompt, expected);
  EXPECT_EQ(raw.generated, engine_tokens(raw.prompt, {patches}, {}, 3));
  // A marker in the text stays where it is.
  const RunOutput placed = run_ok("--image " + shell_quote(image) + " --prompt 'left ]<]image[>[ right' --max-tokens 3");
  std::vector<int32_t> inner = text_ids("left ");
  append(inner, image_block(patches));
  EXPECT_EQ(placed.prompt, chat(inner, " right"));
}

void expect_failure(const std::string& args, const std::vector<std::string>& needles) {
  const CliResult result = run_cli(args);
  EXPECT_EQ(result.exit_code, 2) << args << "\n" << result.out;
  for (const std::string& needle : needles)
    EXPECT_NE(result.out.find(needle), std::string::npos) << args << "\nmissing: " << needle << "\n" << result.out;
}

TEST(CliVisionPrompt, BadMediaAndCountMismatchesExitTwo) {
  const fs::path dir = testing::fresh_dir("vision_prompt_errors");
  const std::string image = write_picture(dir / "p.png", 56, 56);  // 4 placeholders
  const std::string model_flag = "run --model " + shell_quote(made_model()) + " --max-tokens 2 ";
  {
    std::FILE* f = std::fopen((dir / "notes.png").string().c_str(), "wb");
    std::fputs("<!DOCTYPE html>", f);
    std::fclose(f);
  }
  expect_failure(model_flag + "--prompt hi --image " + shell_quote((dir / "notes.png").string()),
                 {(dir / "notes.png").string(), "not a PNG or JPEG image"});
  expect_failure(model_flag + "--prompt hi --image " + shell_quote((dir / "missing.png").string()),
                 {(dir / "missing.png").string(), "cannot open"});
  expect_failure(model_flag + "--prompt hi --video " + shell_quote((dir / "nothing").string()),
                 {(dir / "nothing").string()});
  const std::string I = std::to_string(vision().image_token_id);
  // Placeholders without media, and counts that disagree: both counts named.
  expect_failure(model_flag + "--prompt-tokens 5," + I + "," + I + "," + I + ",7",
                 {"holds 3 image placeholder tokens", "no --image"});
  expect_failure(model_flag + "--prompt-tokens 5," + I + "," + I + ",7 --image " + shell_quote(image),
                 {"holds 2 image placeholder tokens", "need 4", image + ": 4"});
  expect_failure(model_flag + "--prompt-tokens 5,6,7 --image " + shell_quote(image),
                 {"holds 0 image placeholder tokens", "need 4"});
  expect_failure(model_flag + "--prompt 'a ]<]image[>[ b ]<]image[>[' --image " + shell_quote(image),
                 {"2 image marker(s)", "got 1 --image"});
  expect_failure(model_flag + "--prompt hi --fps 2", {"--fps"});
  // A text-only model has no vision tower.
  const fs::path text_only = dir / "tiny";
  ASSERT_EQ(run_cli("make-model --config tiny --out " + shell_quote(text_only.string())).exit_code, 0);
  expect_failure("run --model " + shell_quote(text_only.string()) + " --prompt hi --image " + shell_quote(image),
                 {"no vision tower"});
  const CliResult help = run_cli("run --help");
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_NE(help.out.find("--image"), std::string::npos);
  EXPECT_NE(help.out.find("Without a chat"), std::string::npos);
}

TEST(CliVisionPrompt, AttnMapOverTheImage) {
  const fs::path dir = testing::fresh_dir("vision_prompt_attn");
  const std::string a = write_picture(dir / "a.png", 112, 84, 0), b = write_picture(dir / "b.png", 56, 56, 80);
  const fs::path out = dir / "maps";
  const CliResult result = run_cli("attn-map --model " + shell_quote(made_model()) + " --image " + shell_quote(a) +
                                   " --image " + shell_quote(b) + " --span-image 1 --prompt 'where is the disc'" +
                                   " --out " + shell_quote(out.string()));
  ASSERT_EQ(result.exit_code, 0) << result.out;
  const json doc = json::parse(testing::read_bytes((out / "attention_map.json").string()));
  const std::vector<int32_t> tokens = doc["tokens"].get<std::vector<int32_t>>();
  const mv::PixelPatches pa = image_patches(a), pb = image_patches(b);
  // The span: image 1's placeholders, after image 0's block and image 1's start token.
  std::vector<int32_t> inner = image_block(pa);
  append(inner, image_block(pb));
  ASSERT_EQ(tokens, chat(inner, "where is the disc"));
  const int64_t begin = static_cast<int64_t>(text_ids(tokenizer().bos_token() + "]~b]user\n").size() +
                                             image_block(pa).size() + 1);
  const int64_t n = pb.grid_h * pb.grid_w / 4;
  EXPECT_EQ(doc["span"], (json{{"begin", begin}, {"end", begin + n}}));
  EXPECT_EQ(doc["grid"], (json{{"rows", pb.grid_h / 2}, {"cols", pb.grid_w / 2}}));
  for (int64_t i = begin; i < begin + n; ++i) EXPECT_EQ(tokens[static_cast<size_t>(i)], vision().image_token_id);
  EXPECT_EQ(doc["image"]["width"], pb.resized[0].width);
  EXPECT_EQ(doc["image"]["height"], pb.resized[0].height);
  // The maps are those of the forward with the images' rows (the Engine's input).
  // (the CLI encodes both images in one call: so does this, so the numbers agree to the bit)
  const int64_t total = pa.pixel_values.size(0) + pb.pixel_values.size(0);
  Tensor values = Tensor::zeros({total, pa.pixel_values.size(1)}, DType::f32);
  std::copy_n(pb.pixel_values.data<float>(), pb.pixel_values.numel(),
              std::copy_n(pa.pixel_values.data<float>(), pa.pixel_values.numel(), values.data<float>()));
  const std::vector<Tensor> images = model().encode_vision(
      values, std::vector<VisionGrid>{{1, pa.grid_h, pa.grid_w}, {1, pb.grid_h, pb.grid_w}});
  const std::vector<VisualRows> visual = place_visual_rows(tokens, vision(), model().config().hidden_size, images, {});
  const AttentionMap map = measure_attention_map(
      model(), tokens, {.span_begin = begin, .span_end = begin + n, .grid_rows = pb.grid_h / 2, .grid_cols = pb.grid_w / 2},
      visual);
  ASSERT_EQ(doc["layers"].size(), map.layers.size());
  for (size_t i = 0; i < map.layers.size(); ++i)
    EXPECT_NEAR(doc["layers"][i]["visual_mass_share"].get<double>(), map.layers[i].visual_mass_share, 1e-12);
  if (attention_map_png_available()) {
    const RgbImageView view{.width = pb.resized[0].width, .height = pb.resized[0].height, .rgb = pb.resized[0].rgb};
    const HeatmapLayout layout = heatmap_layout(pb.grid_h / 2, pb.grid_w / 2, &view);
    for (int64_t layer = 0; layer < model().config().num_layers; ++layer) {
      const testing::DecodedPng png = testing::decode_png((out / ("layer_" + std::to_string(layer) + ".png")).string());
      ASSERT_TRUE(png.ok) << png.error;
      EXPECT_EQ(png.width, layout.width);
      EXPECT_EQ(png.height, layout.height);
    }
  }
  // --image with --span is refused; a bad image is named.
  const std::string base = "attn-map --model " + shell_quote(made_model()) + " --prompt hi --out " +
                           shell_quote((dir / "maps2").string());
  expect_failure(base + " --image " + shell_quote(a) + " --span 1:2 --grid 1x1", {"leave out --span"});
  expect_failure(base + " --image " + shell_quote((dir / "none.png").string()), {(dir / "none.png").string()});
  expect_failure(base + " --image " + shell_quote(a) + " --span-image 1", {"--span-image"});
}

}  // namespace
}  // namespace msa
