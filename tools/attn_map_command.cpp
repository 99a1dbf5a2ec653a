// `msa attn-map`: the attention maps of a prompt's text queries over a span of tokens, layer
// by layer (msa/attention_map.h, docs/attention-maps.md): one JSON document and one PNG per
// layer.
#include <algorithm>
#include <charconv>
#include <climits>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "attn_map_report.h"
#include "cli_args.h"
#include "commands.h"
#include "msa/attention_map.h"
#include "msa/model.h"
#include "media_prompt.h"
#include "output_paths.h"
#ifdef MSA_WITH_TOKENIZER
#include "msa/tokenizer.h"
#endif

namespace msa::cli {
namespace {

namespace fs = std::filesystem;

constexpr const char* kUsage =
    "usage: msa attn-map --model DIR (--prompt TEXT | --tokens 1,2,3) --out DIR\n"
    "                    (--image FILE [--image FILE]... [--span-image K] [--raw-prompt]\n"
    "                     | --span A:B --grid RxC [--image-rgb IMAGE.png])\n"
    "                    [--queries C:D] [--layers 0,3,...] [--heads 0,1,...]\n"
    "                    [--alpha X] [--upsample nearest|bilinear] [--threads N]\n"
    "  measures, per layer, the attention of the text queries (the prompt after the span, or\n"
    "  --queries C:D) on a span of tokens, recomputed from the q and k the CPU forward attends\n"
    "  with (MSA layers: over their selected blocks), and writes DIR/attention_map.json and\n"
    "  DIR/layer_N.png\n"
    "  --image: the span is that image's visual tokens: the prompt is built as `msa run --image`\n"
    "    builds it (the chat template places the images; --raw-prompt: before the text,\n"
    "    without the template), the vision tower's rows go into the forward, the grid is\n"
    "    (grid_h/2) x (grid_w/2) and the heatmaps are drawn over the resized image;\n"
    "    --span-image K: which image is the span (0-based, default 0). With --tokens the ids\n"
    "    must hold the placeholders.\n"
    "  --span A:B --grid RxC: any token range (text-only use), R * C = B - A tokens, row-major\n"
    "    (an image's merged tokens: grid_h/2 x grid_w/2); --image-rgb: a PNG under the heatmaps\n"
    "  --layers, --heads: 0-based ids (default: all); --alpha: the heatmap's opacity over an\n"
    "    image (default 0.6)\n"
    "  (docs/attention-maps.md; the PNGs need a build with cairo, the JSON does not)\n";

constexpr int64_t kMaxPosition = INT32_MAX;  // --span, --queries

int64_t parse_int(const std::string& flag, const std::string& item, const std::string& text,
                  const std::string& expected) {
  int64_t value = 0;
  const char* end = item.data() + item.size();
  const auto [stop, error] = std::from_chars(item.data(), end, value);
  if (item.empty() || error != std::errc() || stop != end || value < 0 || value > kMaxPosition)
    throw UsageError("--" + flag + ": expected " + expected + ", got \"" + text + "\"");
  return value;
}

// "A:B" (--span, --queries) or "RxC" (--grid): two integers in [0, 2^31) around `separator`.
std::pair<int64_t, int64_t> parse_pair(const std::string& flag, const std::string& text,
                                       char separator, const std::string& expected) {
  const size_t at = text.find(separator);
  if (at == std::string::npos)
    throw UsageError("--" + flag + ": expected " + expected + ", got \"" + text + "\"");
  return {parse_int(flag, text.substr(0, at), text, expected),
          parse_int(flag, text.substr(at + 1), text, expected)};
}

// "0,3,5": ids >= 0, returned ascending; a repeat is an error. Empty when the flag is absent.
std::vector<int64_t> parse_id_list(Args& args, const std::string& flag) {
  if (!args.has(flag)) return {};
  const std::string text = args.get_string(flag);
  const std::string expected = "comma-separated 0-based ids";
  std::vector<int64_t> ids;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    ids.push_back(parse_int(flag, text.substr(start, comma - start), text, expected));
    start = comma + 1;
  }
  std::sort(ids.begin(), ids.end());
  if (const auto repeat = std::adjacent_find(ids.begin(), ids.end()); repeat != ids.end())
    throw UsageError("--" + flag + ": expected " + expected + " without repeats, got " +
                     std::to_string(*repeat) + " twice in \"" + text + "\"");
  return ids;
}

// "layer_07.png": zero-padded to the widest layer id of the model.
std::string png_name(int64_t layer, int64_t num_layers) {
  std::string digits = std::to_string(layer);
  const size_t width = std::to_string(std::max<int64_t>(num_layers - 1, 0)).size();
  return "layer_" + std::string(width - std::min(width, digits.size()), '0') + digits + ".png";
}

void attn_map_command(Args& args) {
  const std::string model_dir = args.get_string("model");
  const bool has_tokens = args.has("tokens"), has_text = args.has("prompt");
  if (has_tokens == has_text) throw UsageError("give exactly one of --tokens and --prompt");
  const std::string prompt = has_text ? args.get_string("prompt") : "";
  std::vector<int32_t> tokens = has_tokens ? parse_token_ids("tokens", args.get_string("tokens"))
                                           : std::vector<int32_t>{};
  PromptMediaFiles media_files;
  media_files.images = args.get_strings("image");
  const bool with_images = !media_files.images.empty();
  const int64_t span_image = args.get_int64("span-image", 0, 0, INT32_MAX);
  const bool raw_prompt = args.get_switch("raw-prompt");
  if (with_images && (args.has("span") || args.has("grid") || args.has("image-rgb")))
    throw UsageError("--image sets the span, the grid and the overlay itself: leave out --span, "
                     "--grid and --image-rgb");
  if (!with_images && (args.has("span-image") || raw_prompt))
    throw UsageError("--span-image and --raw-prompt apply to --image only");
  if (with_images && span_image >= static_cast<int64_t>(media_files.images.size()))
    throw UsageError("--span-image: expected an image index below " + std::to_string(media_files.images.size()) +
                     " (the --image count), got " + std::to_string(span_image));
  AttentionMapSpec spec;
  if (!with_images) {
    std::tie(spec.span_begin, spec.span_end) =
        parse_pair("span", args.get_string("span"), ':', "a token range A:B (0-based, B exclusive)");
    std::tie(spec.grid_rows, spec.grid_cols) =
        parse_pair("grid", args.get_string("grid"), 'x', "rows x columns RxC, e.g. 24x24");
  }
  if (args.has("queries"))
    std::tie(spec.query_begin, spec.query_end) = parse_pair(
        "queries", args.get_string("queries"), ':', "a token range C:D (0-based, D exclusive)");
  spec.layers = parse_id_list(args, "layers");
  spec.heads = parse_id_list(args, "heads");
  const std::string out = args.get_string("out");
  const std::string image_path = args.get_string("image-rgb", "");
  HeatmapPngOptions options;
  options.alpha = args.get_double("alpha", options.alpha, 0, 1);
  const std::string upsample = args.get_string("upsample", "nearest");
  if (upsample == "bilinear") options.upsampling = HeatmapUpsampling::bilinear;
  else if (upsample != "nearest")
    throw UsageError("--upsample: expected nearest or bilinear, got \"" + upsample + "\"");
  set_num_threads(args.get_threads());
  args.finish();

  // Nothing is read or computed before the outputs are known to replace no input.
  std::vector<NamedPath> inputs = {{"model", model_dir}};
  if (!image_path.empty()) inputs.push_back({"image-rgb", image_path});
  for (const std::string& file : media_files.images) inputs.push_back({"image", file});
  check_output_path("out", out, inputs);
  if (!image_path.empty() && !attention_map_png_available())
    throw Error("--image-rgb: this build of msa reads and writes PNGs through cairo, which it "
                "was built without (install libcairo2-dev and reconfigure)");

  // The media before the weights: a bad file is named first.
  const PromptMedia media = load_prompt_media(model_dir, media_files);
  const Model model = Model::load(model_dir);
  const ModelConfig& config = model.config();
  if (with_images && !config.vision)
    throw UsageError("--image: the model in " + model_dir + " has no vision tower (its config.json has no vision_config)");
  AttentionMapSource source{.model_dir = model_dir, .prompt = prompt};
#ifdef MSA_WITH_TOKENIZER
  std::optional<Tokenizer> tokenizer;
  std::error_code no_file;
  if (has_text || fs::exists(fs::path(model_dir) / "tokenizer.json", no_file))
    tokenizer = Tokenizer::from_model_dir(model_dir);
  if (has_text && !with_images) tokens = tokenizer->encode(prompt, /*add_special_tokens=*/true);
  if (has_text && with_images)
    tokens = build_media_prompt(*tokenizer, prompt, media, *config.vision,
                                raw_prompt ? PromptLayout::raw : PromptLayout::chat_template)
                 .tokens;
  if (tokenizer)
    for (int32_t id : tokens) source.token_texts.push_back(tokenizer->decode(std::span(&id, 1)));
#else
  if (has_text)
    throw Error("--prompt needs the tokenizer, which this build of msa does not include; use --tokens");
#endif
  std::vector<VisualRows> visual;
  std::optional<RgbImage> image;
  if (config.vision) check_placeholder_counts(tokens, *config.vision, media, has_text ? "--prompt" : "--tokens");
  if (with_images) {
    // The span: the chosen image's placeholder tokens, laid out as its merge windows.
    std::tie(spec.span_begin, spec.span_end) = image_placeholder_span(tokens, *config.vision, media, span_image);
    const vision::PixelPatches& chosen = media.images[static_cast<size_t>(span_image)];
    spec.grid_rows = chosen.grid_h / media.image_merge_size;
    spec.grid_cols = chosen.grid_w / media.image_merge_size;
    image = RgbImage{.width = chosen.resized.at(0).width, .height = chosen.resized.at(0).height,
                     .rgb = chosen.resized.at(0).rgb};
  }
  // The spec against the prompt first: a bad span names itself before the forward runs.
  spec = resolve_attention_map_spec(spec, config, static_cast<int64_t>(tokens.size()));
  if (!image_path.empty()) image = read_rgb_png(image_path);
  const RgbImageView image_view = image ? image->view() : RgbImageView{};
  if (image) options.image = &image_view;
  // The PNG layout is checked before the forward too (grid or image too large to draw).
  if (attention_map_png_available()) heatmap_layout(spec.grid_rows, spec.grid_cols, options.image);
  // The vision tower last: its rows are what the span's keys are made of.
  if (with_images) visual = encode_prompt_media(model, tokens, media);

  std::error_code error;
  fs::create_directories(out, error);
  if (!fs::is_directory(out))
    throw UsageError("--out: expected a directory (it is created when missing), got \"" + out +
                     "\"" + (error ? " (" + error.message() + ")" : ""));
  const std::string json_path = (fs::path(out) / "attention_map.json").string();
  check_output_path("out", json_path, inputs);
  for (int64_t layer : spec.layers)
    check_output_path("out", (fs::path(out) / png_name(layer, config.num_layers)).string(), inputs);

  const AttentionMap map = measure_attention_map(model, tokens, spec, visual);
  source.tokens = tokens;
  source.block_size = config.block_size;
  source.topk_blocks = config.topk_blocks;
  if (image) {
    source.image = with_images ? media.image_files[static_cast<size_t>(span_image)] : image_path;
    source.image_width = image->width;
    source.image_height = image->height;
  }
  const bool pngs = attention_map_png_available();
  for (const LayerAttentionMap& layer : map.layers) {
    const std::string name = png_name(layer.layer, config.num_layers);
    source.pngs.push_back(pngs ? name : "");
    if (pngs) write_attention_map_png((fs::path(out) / name).string(), map, layer, options);
    std::printf("layer %lld (%s): %.1f%% of the text queries' attention on the span", static_cast<long long>(layer.layer),
                layer.sparse ? "MSA" : "dense", 100 * layer.visual_mass_share);
    if (layer.sparse)
      std::printf(", %.1f%% of selected blocks hold span tokens", 100 * layer.selected_visual_block_share);
    std::printf("\n");
  }
  std::printf("uniform attention over the visible keys would put %.1f%% on the span\n",
              100 * map.uniform_visual_share);
  std::ofstream json_file(json_path, std::ios::binary | std::ios::trunc);
  const std::string json = attention_map_json(map, source);
  json_file.write(json.data(), static_cast<std::streamsize>(json.size()));
  json_file.close();
  if (!json_file) throw Error("cannot write " + json_path);
  std::printf("wrote %s%s\n", json_path.c_str(),
              pngs ? (" and " + std::to_string(map.layers.size()) + " PNG(s) in " + out).c_str() : "");
  if (!pngs)
    std::fprintf(stderr,
                 "msa attn-map: no PNGs written: they need cairo, which this build of msa lacks "
                 "(install libcairo2-dev and reconfigure); the JSON holds every map\n");
}

}  // namespace
}  // namespace msa::cli

int run_attn_map_command(int argc, char** argv) {
  using namespace msa::cli;
  return run_reporting_errors("attn-map", kUsage, [&] {
    Args args(argc, argv, {"help", "raw-prompt"}, {"image"});
    if (args.has("help")) {
      std::fputs(kUsage, stdout);
      return 0;
    }
    attn_map_command(args);
    return 0;
  });
}
