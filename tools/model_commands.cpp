// `msa make-model`, `msa logits`, `msa run` and `msa vision-encode`: the MiniMax-M3 runtime
// from the command line (see docs/model.md, docs/vision.md).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <climits>
#include <functional>
#include <iostream>
#include <new>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "cache_dtype_flag.h"
#include "cli_args.h"
#include "commands.h"
#include "dense_engine_flag.h"
#include "media_prompt.h"
#include "pixel_inputs.h"
#include "output_paths.h"
#include "msa/model.h"
#include "msa/model_engine.h"
#include "msa/model_random.h"
#include "msa/model_shard.h"
#include "msa/parallel_model.h"
#include "msa/safetensors.h"
#include "tp_processes.h"
#ifdef MSA_WITH_CUDA
#include "cuda/common/device_buffer.h"
#endif
#ifdef MSA_WITH_TOKENIZER
#include "msa/tokenizer.h"
#endif

namespace msa::cli {
namespace {

constexpr const char* kMakeModelUsage =
    "usage: msa make-model --config tiny|small|m3-layer|tiny-vl|m3-vision|tiny-tp|tiny-tp-cuda|m3-full --out DIR\n"
    "                      [--dtype f32|bf16|f16|mxfp8|nvfp4] [--layers N] [--seed S]\n"
    "                      [--shard-gb G | --shard-mb N] [--force]\n"
    "  writes a randomly initialised M3-shaped checkpoint (config.json + safetensors) and a\n"
    "  byte-level BPE tokenizer (tokenizer.json + tokenizer_config.json); tiny-vl,\n"
    "  m3-vision and m3-full add the vision tower and projector (and the processors' configs)\n"
    "  (--dtype mxfp8: the MXFP8 release's layout; nvfp4: ModelOpt NVFP4 experts, the rest bf16;\n"
    "  --layers N: the preset's first N layers; --shard-gb: shards of at most G GB (1e9 bytes)\n"
    "  with model.safetensors.index.json, default 5 for m3-full, one file otherwise)\n"
    "  (--force: write into an existing non-empty directory, replacing its model files)\n";
constexpr const char* kLogitsUsage =
    "usage: msa logits --model DIR --tokens 1,2,3 --out OUT.safetensors [--chunk N]\n"
    "                  [--pixels PIXELS.safetensors] [--dump INTERMEDIATES.safetensors]\n"
    "                  [--cache-dtype f32|bf16|fp8] [--threads N] [--device cpu|cuda] [--check-weights]\n"
    "                  [--dense-engine auto|msa|cudnn|cudnn-gathered]\n"
    "  writes the f32 logits [n_tokens, vocab] of one prefill as tensor `logits`\n"
    "  (--pixels: images / videos for the prompt's placeholder tokens, as `msa vision-encode`\n"
    "  reads them; the vision path runs on the CPU)\n"
    "  (--out and --dump may not lie inside --model; --check-weights: scan every weight for\n"
    "  NaN / infinity first)\n"
    "  (--chunk: prefill N tokens per forward step; --dump: every layer's intermediates;\n"
    "  --device cuda: weights and bf16 cache on the GPU, the default cache dtype there;\n"
    "  --dense-engine: its dense attention on ours or cuDNN's SDPA (paged, or over K/V gathered\n"
    "  out of the pages); auto = gathered cuDNN for prefill steps, ours for decode)\n";
constexpr const char* kRunUsage =
    "usage: msa run --model DIR (--prompt-tokens 1,2,3 | --prompt TEXT) [--max-tokens N]\n"
    "               [--image FILE]... [--video FILE_OR_DIR]... [--fps F] [--folder-fps F]\n"
    "               [--raw-prompt] [--print-prompt]\n"
    "               [--temperature T] [--top-k K] [--top-p P] [--seed S] [--stop 1,2]\n"
    "               [--cache-tokens N] [--cache-dtype f32|bf16|fp8] [--chunk N] [--threads N]\n"
    "               [--device cpu|cuda] [--dense-engine auto|msa|cudnn|cudnn-gathered] [--decode-graphs on|off]\n"
    "               [--check-weights] [--tp N]\n"
    "  streams the generated token ids to stdout, speeds to stderr\n"
    "  (--decode-graphs on: with --device cuda, decode steps replay per-bucket CUDA graphs;\n"
    "  default on)\n"
    "  (--tp N: tensor / expert parallel over N in-process ranks on the CPU, each with its\n"
    "  share of the heads, MLP columns and experts (docs/parallel.md); text only; with\n"
    "  --device cuda: one process per GPU over NCCL, rank r on GPU r, rank 0 prints)\n"
    "  (--cache-tokens 0: prompt + max-tokens; --check-weights: scan every weight for NaN /\n"
    "  infinity first)\n"
    "  (--device cuda: weights and bf16 cache on the GPU, the default cache dtype there;\n"
    "  --dense-engine: its dense attention on ours or cuDNN's SDPA (paged, or over K/V gathered\n"
    "  out of the pages); auto = gathered cuDNN for prefill steps, ours for decode)\n"
    "  --image (PNG, JPEG) and --video (a video file, or a folder of PNG / JPEG frames), each\n"
    "  repeatable: preprocessed with DIR's processor configs and encoded by the vision tower\n"
    "  on the model's device (--device cuda: on the GPU). With --prompt the media are placed as\n"
    "  MiniMaxM3VLProcessor places them: the chat template renders one user message whose\n"
    "  content is the images, the videos, then the text, and every image marker becomes\n"
    "  ]<]start of image[>[ + t*h*w/4 x ]<]image[>[ + ]<]end of image[>[ (a video: per temporal\n"
    "  patch ]<]S.S seconds[>[ + the same brackets around h*w/4 x ]<]video[>[). Without a chat\n"
    "  template, or with --raw-prompt, the markers go before the text in the raw token stream\n"
    "  (BOS first, no template). Markers written in the --prompt text stay where they are (one\n"
    "  per file). With --prompt-tokens the ids must already hold the placeholders; their counts\n"
    "  must match the media's. --fps: video frames sampled per second (default: the config's);\n"
    "  --folder-fps: a frames folder's frame rate (default: --fps). --print-prompt: the prompt's\n"
    "  token ids to stderr (\"prompt: 1 2 3\") before generating\n";

constexpr const char* kVisionEncodeUsage =
    "usage: msa vision-encode --model DIR --pixels PIXELS.safetensors --out OUT.safetensors\n"
    "                         [--dump INTERMEDIATES.safetensors] [--threads N] [--device cpu|cuda]\n"
    "  runs the vision tower and the projector (on the CPU, or with --device cuda on the GPU:\n"
    "  bf16 GEMM inputs, f32 accumulation) on the images and videos of PIXELS:\n"
    "  pixel_values [N, C*T*P*P] + image_grid_thw [images, 3] and/or pixel_values_videos +\n"
    "  video_grid_thw (transformers' names; int32/int64 grids of (t, h, w)). Writes f32\n"
    "  image_features [N, vision hidden] (the ViT's output) and image_embeds [N / m^2, hidden]\n"
    "  (the projector's: the placeholder tokens' rows), video_features / video_embeds alike\n"
    "  (--dump: the vision path's intermediates, docs/vision.md)\n";

void apply_threads(Args& args) { msa::set_num_threads(args.get_threads()); }

// The ranges of the runtime's numeric flags (far above real use).
constexpr int kMaxTokensFlag = 1 << 24;  // --max-tokens, --chunk
constexpr int64_t kMaxCacheTokens = int64_t{1} << 30;
constexpr int kMaxRanks = 256;  // --tp: in-process ranks (make_local_communicators)

// Runs `body` with the shared error handling: usage errors exit 2 with the usage text,
// msa::Error exits 2, anything else 1.
int guarded(const char* name, const char* usage, int argc, char** argv,
            const std::function<void(Args&)>& body, std::set<std::string> switches = {"help"},
            std::set<std::string> repeatable = {}) {
  try {
    Args args(argc, argv, std::move(switches), std::move(repeatable));
    if (args.has("help")) {
      std::fputs(usage, stdout);
      return 0;
    }
    body(args);
    return 0;
  } catch (const UsageError& e) {
    std::cerr << "msa " << name << ": " << e.what() << "\n" << usage;
    return 2;
  } catch (const msa::Error& e) {
    std::cerr << "msa " << name << ": error: " << e.what() << "\n";
    return 2;
  } catch (const std::bad_alloc&) {
    std::cerr << "msa " << name << ": error: out of memory\n";
    return 2;
  } catch (const std::exception& e) {  // e.g. a file system error
    std::cerr << "msa " << name << ": error: " << e.what() << "\n";
    return 2;
  }
}

DType parse_dtype(const std::string& text) {
  if (text == "f32" || text == "float32") return DType::f32;
  if (text == "bf16" || text == "bfloat16") return DType::bf16;
  if (text == "f16" || text == "float16") return DType::f16;
  throw UsageError("--dtype: expected f32, bf16 or f16, got \"" + text + "\"");
}

Device parse_device(Args& args) {
  const std::string text = args.get_string("device", "cpu");
  if (text == "cpu") return Device::cpu;
  if (text == "cuda") return Device::cuda;
  throw UsageError("--device: expected cpu or cuda, got \"" + text + "\"");
}

void make_model(Args& args) {
  const std::string preset = args.get_string("config");
  const std::string out = args.get_string("out");
  ModelConfig config;
  try {
    config = model_config_preset(preset);
  } catch (const msa::Error&) {
    throw UsageError("--config: expected tiny, small, m3-layer, tiny-vl, m3-vision, tiny-tp or m3-full, got \"" +
                     preset + "\"");
  }
  const int64_t layers = args.get_int64("layers", config.num_layers, 1, config.num_layers);
  config = first_layers(config, layers);
  RandomCheckpointOptions options;
  const std::string dtype = args.get_string("dtype", config.dtype);
  if (dtype == "mxfp8" || dtype == "nvfp4") {
    options.format = dtype == "mxfp8" ? CheckpointFormat::mxfp8 : CheckpointFormat::nvfp4;
    options.dtype = DType::bf16;
  } else {
    try {
      options.dtype = parse_dtype(dtype);
    } catch (const UsageError&) {
      throw UsageError("--dtype: expected f32, bf16, f16, mxfp8 or nvfp4, got \"" + dtype + "\"");
    }
  }
  options.seed = args.get_seed("seed", 0);
  // One file, or shards: the release's ~5 GB for the full-size preset.
  const double shard_gb = args.get_double("shard-gb", preset == "m3-full" ? 5.0 : 0.0, 0.0, 1e4);
  const int shard_mb = args.get_int("shard-mb", 0, 0, 1 << 20);
  if (shard_mb > 0) options.shard_bytes = int64_t{shard_mb} << 20;
  else if (shard_gb > 0) options.shard_bytes = std::max<int64_t>(1, std::llround(shard_gb * 1e9));
  const bool force = args.get_switch("force");
  args.finish();
  check_new_model_directory("out", out, force);
  const int64_t parameters = write_random_checkpoint(config, out, options);
  write_random_tokenizer(config, out);
  std::printf("wrote %s: %s config, %lld layers, %lld parameters (%s), %.3f GB of tensors\n", out.c_str(),
              preset.c_str(), static_cast<long long>(config.num_layers), static_cast<long long>(parameters),
              options.format == CheckpointFormat::floats ? std::string(dtype_name(options.dtype)).c_str() : dtype.c_str(),
              static_cast<double>(random_checkpoint_bytes(config, options)) / 1e9);
}

void logits_command(Args& args) {
  const std::string model_dir = args.get_string("model");
  const std::vector<int32_t> tokens = parse_token_ids("tokens", args.get_string("tokens"));
  const std::string out = args.get_string("out");
  const std::string dump = args.get_string("dump", "");
  const std::string pixels = args.get_string("pixels", "");
  const int chunk_arg = args.get_int("chunk", 0, 0, kMaxTokensFlag);  // 0: all tokens at once
  const Device device = parse_device(args);
  const DType cache_dtype = read_cache_dtype_flag(args, device);
  const DenseAttentionEngine dense_engine = read_dense_engine_flag(args, device == Device::cuda);
  const bool check_weights = args.get_switch("check-weights");
  apply_threads(args);
  args.finish();
  std::vector<NamedPath> inputs = {{"model", model_dir}};
  if (!pixels.empty()) inputs.push_back({"pixels", pixels});
  check_output_path("out", out, inputs);
  inputs.push_back({"out", out});
  if (!dump.empty()) check_output_path("dump", dump, inputs);

  Model model = Model::load(model_dir, device, check_weights);
  model.set_dense_attention_engine(dense_engine);
  const int64_t n = static_cast<int64_t>(tokens.size());
  const int64_t chunk = chunk_arg > 0 ? chunk_arg : n;
  // Images and videos: their rows at the prompt's placeholder tokens (prompt positions).
  std::vector<VisualRows> visual;
  EncodedPixels encoded;
  if (!pixels.empty()) {
    if (!model.config().vision)
      throw UsageError("--pixels: the model in " + model_dir + " has no vision tower (no vision_config)");
    encoded = encode_pixel_inputs(model, load_pixel_inputs("pixels", pixels));
    visual = place_visual_rows(tokens, *model.config().vision, model.config().hidden_size,
                               encoded.images, encoded.videos);
  }
  KvCache cache(model.config(), (n + model.config().block_size - 1) / model.config().block_size,
                cache_dtype, device);
  SequenceCache sequence;
  std::vector<std::pair<std::string, Tensor>> dumped;
  int64_t step = 0;
  const ForwardTap tap = [&](const std::string& name, const Tensor& value) {
    // Tensors are views of scratch buffers: keep copies. Chunks get a step suffix.
    dumped.emplace_back(chunk < n ? name + ".step" + std::to_string(step) : name, value.clone());
  };
  Tensor logits = Tensor::zeros({n, model.config().vocab_size}, DType::f32);
  for (int64_t begin = 0; begin < n; begin += chunk, ++step) {
    const int64_t end = std::min(n, begin + chunk);
    const std::vector<VisualRows> step_visual = visual_rows_in_range(visual, begin, end);
    const ForwardRequest request{.sequence = &sequence,
                                 .tokens = std::span(tokens).subspan(begin, end - begin),
                                 .all_logits = true,
                                 .visual = step_visual};
    const Tensor part = model.forward({&request, 1}, cache, dump.empty() ? nullptr : tap);
    std::copy_n(part.data<float>(), part.numel(),
                logits.data<float>() + begin * model.config().vocab_size);
  }
  if (const int64_t at = first_non_finite(logits); at >= 0)
    throw Error("the logits are not finite (" + std::to_string(logits.get(at)) + " at [token, id] " +
                index_string(logits.shape(), at) +
                "); the checkpoint may hold non-finite weights (--check-weights scans them)");
  save_safetensors(out, {{"logits", logits}});
  if (!dump.empty()) save_safetensors(dump, dumped);
}

// f32 [rows, cols] tensors one after another (the row blocks of one output).
Tensor concat_rows(const std::vector<Tensor>& parts) {
  int64_t rows = 0;
  for (const Tensor& part : parts) rows += part.size(0);
  Tensor out = Tensor::zeros({rows, parts.front().size(1)}, DType::f32);
  float* dst = out.data<float>();
  for (const Tensor& part : parts) {
    const Tensor dense = part.to(DType::f32);  // contiguous
    std::copy_n(dense.data<float>(), dense.numel(), dst);
    dst += dense.numel();
  }
  return out;
}

void vision_encode_command(Args& args) {
  const std::string model_dir = args.get_string("model");
  const std::string pixels = args.get_string("pixels");
  const std::string out = args.get_string("out");
  const std::string dump = args.get_string("dump", "");
  const Device device = parse_device(args);
  apply_threads(args);
  args.finish();
  check_output_path("out", out, {{"model", model_dir}, {"pixels", pixels}});
  if (!dump.empty())
    check_output_path("dump", dump, {{"model", model_dir}, {"pixels", pixels}, {"out", out}});
  const PixelInputs media = load_pixel_inputs("pixels", pixels);
  const Model model = Model::load(model_dir, device);
  if (!model.config().vision)
    throw UsageError("--model: " + model_dir + " has no vision tower (its config.json has no vision_config)");
  const VisionConfig& config = *model.config().vision;
  const VisionWeights& weights = *model.weights().vision;
  std::vector<std::pair<std::string, Tensor>> outputs, dumped;
  std::string kind;
  const ForwardTap tap = [&](const std::string& name, const Tensor& value) {
    // Views of scratch buffers: keep copies. A long video runs in several batches of
    // segments: later batches get a suffix.
    std::string key = kind + "." + name;
    for (int batch = 1; std::any_of(dumped.begin(), dumped.end(), [&](const auto& e) { return e.first == key; });
         ++batch)
      key = kind + "." + name + ".batch" + std::to_string(batch);
    dumped.emplace_back(key, value.clone());
  };
  const auto encode = [&](const char* name, const Tensor& values, const std::vector<VisionGrid>& grids) {
    if (grids.empty()) return;
    kind = name;
    if (device == Device::cpu) {
      const Tensor features = vision_tower_forward(weights, config, values, grids, Impl::cpu,
                                                   dump.empty() ? nullptr : tap);
      outputs.emplace_back(kind + "_features", features);
      outputs.emplace_back(kind + "_embeds",
                           vision_projector_forward(weights, config, features, dump.empty() ? nullptr : tap));
      return;
    }
    // On the device the tower and the projector run as one call (Model::encode_vision); the
    // features are its last layer's tap, batch by batch in row order (a download per layer
    // and batch: this command is for inspection, not speed).
    const std::string last = "vision.layers." + std::to_string(config.num_layers - 1);
    std::vector<Tensor> feature_batches;
    const ForwardTap device_tap = [&](const std::string& tap_name, const Tensor& value) {
      if (tap_name == last) feature_batches.push_back(value.clone());
      if (!dump.empty()) tap(tap_name, value);
    };
    const std::vector<Tensor> embeds = model.encode_vision(values, grids, device_tap);
    outputs.emplace_back(kind + "_features", concat_rows(feature_batches));
    outputs.emplace_back(kind + "_embeds", concat_rows(embeds));
  };
  encode("image", media.image_pixels, media.image_grids);
  encode("video", media.video_pixels, media.video_grids);
  save_safetensors(out, outputs);
  if (!dump.empty()) save_safetensors(dump, dumped);
}

// The --image / --video / --fps / --folder-fps flags of `msa run` and `msa attn-map`.
PromptMediaFiles parse_media_files(Args& args, bool videos) {
  PromptMediaFiles files;
  files.images = args.get_strings("image");
  if (videos) {
    files.videos = args.get_strings("video");
    files.video_fps = args.get_double("fps", 0, 0, 1e6, /*min_open=*/true);
    files.folder_fps = args.get_double("folder-fps", 0, 0, 1e6, /*min_open=*/true);
    if (files.videos.empty() && (args.has("fps") || args.has("folder-fps")))
      throw UsageError("--fps and --folder-fps apply to --video only");
  }
  return files;
}

// `run_args`: the command's own arguments (argv of `run`), which --tp with --device cuda
// passes on to the processes of the other ranks.
void run_command(Args& args, const std::vector<std::string>& run_args) {
  const std::string model_dir = args.get_string("model");
  const bool has_tokens = args.has("prompt-tokens"), has_text = args.has("prompt");
  if (has_tokens == has_text) throw UsageError("give exactly one of --prompt-tokens and --prompt");
  GenerationRequest request;
  request.max_tokens = args.get_int("max-tokens", 16, 1, kMaxTokensFlag);
  request.sampling.temperature = args.get_double("temperature", 0, 0, 1e6);  // 0: greedy
  request.sampling.top_k = args.get_int("top-k", 0, 0, INT32_MAX);            // 0: all
  request.sampling.top_p = args.get_double("top-p", 1, 0, 1, /*min_open=*/true);
  request.sampling.seed = args.get_seed("seed", 0);
  const bool stop_given = args.has("stop");
  if (stop_given) request.stop_tokens = parse_token_ids("stop", args.get_string("stop"));
  EngineOptions options;
  options.cache_tokens = args.get_int64("cache-tokens", 0, 0, kMaxCacheTokens);  // 0: what it needs
  options.prefill_chunk = args.get_int("chunk", 256, 1, kMaxTokensFlag);
  const Device device = parse_device(args);
  options.cache_dtype = read_cache_dtype_flag(args, device);
  const DenseAttentionEngine dense_engine = read_dense_engine_flag(args, device == Device::cuda);
  const std::string prompt_text = has_text ? args.get_string("prompt") : "";
  if (has_tokens) request.prompt = parse_token_ids("prompt-tokens", args.get_string("prompt-tokens"));
  const PromptMediaFiles media_files = parse_media_files(args, /*videos=*/true);
  const bool raw_prompt = args.get_switch("raw-prompt");
  const bool print_prompt = args.get_switch("print-prompt");
  const bool check_weights = args.get_switch("check-weights");
  const int tp = args.get_int("tp", 1, 1, kMaxRanks);
  // --tp with --device cuda: one process per GPU over NCCL (tp_processes.h), even for one rank.
  const bool tp_cuda = device == Device::cuda && args.has("tp");
  // Set by rank 0 for the processes it starts (internal, not in the usage text).
  const bool tp_child = args.has("nccl-id");
  const std::string nccl_id_file = tp_child ? args.get_string("nccl-id") : "";
  const int tp_rank = args.get_int("rank", 0, 0, kMaxRanks - 1);
  const std::optional<bool> decode_graphs = parse_on_off(args, "decode-graphs");
  apply_threads(args);
  args.finish();
  if (raw_prompt && !has_text) throw UsageError("--raw-prompt applies to --prompt only");
  if (tp_child && (!tp_cuda || tp_rank < 1 || tp_rank >= tp))
    throw UsageError("--nccl-id / --rank: a rank 1..N-1 of --tp N --device cuda (rank 0 starts these)");
  if (tp_cuda) {
#ifdef MSA_WITH_CUDA
    const int devices = msa::cuda::device_count();
    if (tp > devices)
      throw Error("--tp " + std::to_string(tp) + " --device cuda: one GPU per rank, and " +
                  std::to_string(devices) + " CUDA device(s) are visible");
#endif
    if (!nccl_available())
      throw Error("--tp with --device cuda needs NCCL, which this build of msa does not include");
  }
  if ((tp > 1 || tp_cuda) && (!media_files.images.empty() || !media_files.videos.empty()))
    throw UsageError("--image / --video: not with --tp (the parallel model runs text only)");

  const auto load_start = std::chrono::steady_clock::now();
  // The media first: a bad file is named before the weights are read.
  const PromptMedia media = load_prompt_media(model_dir, media_files);
  // With --tp every rank loads its own part of the weights below; here the config only.
  std::optional<Model> single;
  std::optional<ModelConfig> parallel_config;
  if (tp > 1 || tp_cuda) {
    parallel_config = load_model_config(model_dir);
    make_shard_plan(*parallel_config, 0, tp);  // a world size the model cannot take, named now
    if (check_weights) check_weights_finite(SafetensorsModel::open(model_dir));
  } else {
    single.emplace(Model::load(model_dir, device, check_weights));
    single->set_dense_attention_engine(dense_engine);
    if (decode_graphs) single->set_decode_graphs(*decode_graphs);
  }
  const ModelConfig& config = single ? single->config() : *parallel_config;
  if (!media.empty() && !config.vision)
    throw UsageError(std::string(media.images.empty() ? "--video" : "--image") + ": the model in " +
                     model_dir + " has no vision tower (its config.json has no vision_config)");
#ifdef MSA_WITH_TOKENIZER
  std::optional<Tokenizer> tokenizer;
  std::error_code no_tokenizer;
  if (has_text || std::filesystem::exists(std::filesystem::path(model_dir) / "tokenizer.json", no_tokenizer)) {
    tokenizer = Tokenizer::from_model_dir(model_dir);
    if (has_text && media.empty())
      request.prompt = tokenizer->encode(prompt_text, /*add_special_tokens=*/true);
    else if (has_text)
      request.prompt = build_media_prompt(*tokenizer, prompt_text, media, *config.vision,
                                          raw_prompt ? PromptLayout::raw : PromptLayout::chat_template)
                           .tokens;
  }
#else
  if (has_text)
    throw Error("--prompt needs the tokenizer, which this build of msa does not include; "
                "use --prompt-tokens");
#endif
  if (config.vision) {
    check_placeholder_counts(request.prompt, *config.vision, media,
                             has_tokens ? "--prompt-tokens" : "--prompt");
    if (!media.empty()) request.visual = encode_prompt_media(*single, request.prompt, media);
  }
  if (print_prompt) {
    std::string line = "prompt:";
    for (int32_t id : request.prompt) line += " " + std::to_string(id);
    std::fprintf(stderr, "%s\n", line.c_str());
  }
  if (!stop_given) request.stop_tokens = config.eos_token_ids;
  if (options.cache_tokens == 0)
    options.cache_tokens = static_cast<int64_t>(request.prompt.size()) + request.max_tokens;
  const double load_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count();

  std::vector<int32_t> generated;
  EngineStats stats;
  const auto print_token = [&](int32_t token) {
    std::printf("%s%d", generated.empty() ? "" : " ", token);
    std::fflush(stdout);
    generated.push_back(token);
  };
  bool prints = true;  // rank 0 (or the only process) prints the text and the speeds
  if (tp_cuda) {
    // Rank 0 starts the others (their stdout is /dev/null); rank r runs on device r.
    TpProcesses processes =
        tp_child ? TpProcesses::join(tp_rank, tp, nccl_id_file) : TpProcesses::start(tp, run_args);
    const int rank = processes.rank();
    prints = rank == 0;
    {
      const std::unique_ptr<Communicator> comm = make_nccl_communicator(rank, tp, processes.id(), rank);
      const ParallelModel model = ParallelModel::load(model_dir, *comm, Device::cuda);
      generate_on_rank(model, request,
                       {.cache_tokens = options.cache_tokens,
                        .prefill_chunk = options.prefill_chunk,
                        .cache_dtype = options.cache_dtype},
                       rank == 0 ? std::function<void(int32_t)>(print_token) : nullptr, &stats);
    }
    processes.wait();
  } else if (single) {
    Engine engine(*single, options);
    engine.submit(request);
    while (!engine.idle())
      for (const TokenEvent& event : engine.step()) print_token(event.token);
    stats = engine.stats();
  } else {
    // One thread per rank, sharing the cores: each rank's OpenMP team gets its share.
    const int threads_per_rank = std::max(1, num_threads() / tp);
    const auto comms = make_local_communicators(tp);
    run_on_ranks(
        comms,
        [&](Communicator& comm) {
          const ParallelModel model = ParallelModel::load(model_dir, comm);
          EngineStats rank_stats;
          generate_on_rank(model, request,
                           {.cache_tokens = options.cache_tokens,
                            .prefill_chunk = options.prefill_chunk,
                            .cache_dtype = options.cache_dtype},
                           comm.rank() == 0 ? std::function<void(int32_t)>(print_token) : nullptr,
                           &rank_stats);
          if (comm.rank() == 0) stats = rank_stats;
        },
        threads_per_rank);
  }
  if (!prints) return;
  std::printf("\n");
  std::fflush(stdout);
#ifdef MSA_WITH_TOKENIZER
  if (tokenizer) {  // the text may hold NUL bytes: write all of it
    const std::string text = tokenizer->decode(generated, true);
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::printf("\n");
  }
#endif
  const EngineStats& s = stats;
  const std::string where =
      tp_cuda                ? "cuda, " + std::to_string(tp) + (tp > 1 ? " ranks (one process per GPU)" : " rank")
      : device == Device::cuda ? std::string("cuda")
      : tp > 1 ? std::to_string(tp) + " ranks x " + std::to_string(std::max(1, num_threads() / tp)) + " threads"
               : std::to_string(num_threads()) + " threads";
  std::fprintf(stderr,
               "load %.2f s | prefill %lld tokens in %.3f s (%.1f tok/s) | decode %lld tokens in "
               "%.3f s (%.1f tok/s) | %s\n",
               load_seconds, static_cast<long long>(s.prefill_tokens), s.prefill_seconds,
               s.prefill_seconds > 0 ? s.prefill_tokens / s.prefill_seconds : 0.0,
               static_cast<long long>(s.decode_tokens), s.decode_seconds,
               s.decode_seconds > 0 ? s.decode_tokens / s.decode_seconds : 0.0,
               where.c_str());
}

}  // namespace
}  // namespace msa::cli

int run_make_model_command(int argc, char** argv) {
  return msa::cli::guarded("make-model", msa::cli::kMakeModelUsage, argc, argv,
                           msa::cli::make_model, {"help", "force"});
}
int run_logits_command(int argc, char** argv) {
  return msa::cli::guarded("logits", msa::cli::kLogitsUsage, argc, argv, msa::cli::logits_command,
                           {"help", "check-weights"});
}
int run_vision_encode_command(int argc, char** argv) {
  return msa::cli::guarded("vision-encode", msa::cli::kVisionEncodeUsage, argc, argv,
                           msa::cli::vision_encode_command);
}
int run_run_command(int argc, char** argv) {
  const std::vector<std::string> run_args(argv, argv + argc);
  return msa::cli::guarded("run", msa::cli::kRunUsage, argc, argv,
                           [&](msa::cli::Args& args) { msa::cli::run_command(args, run_args); },
                           {"help", "check-weights", "raw-prompt", "print-prompt"}, {"image", "video"});
}
