// msa bench-model --vision (tools/bench_vision.h): the vision tower per layer on the CPU or
// the GPU, on M3's widths (--config m3-vision: 4 of the 32 layers; --layers to change).
//
// Inputs: one 672 x 672 image (48 x 48 = 2304 patches, one segment) and one 64-frame
// 448 x 448 video (32 temporal patches x 32 x 32 = 32768 patches, 8 segments of 4096, run in
// two batches of 16384 rows as Model::encode_vision does). Random weights (bf16 matrices,
// the f32 patch embedding) and pixels, made on the host: the times do not depend on them.
//
// Work counted (the denominators of "% of peak"): per ViT layer the GEMMs q, k, v, o
// (4 * 2 N Hv^2) and fc1 + fc2 (2 * 2 N Hv I), the attention 4 S^2 Hv per segment of S
// patches (QK^T and PV); the patch embedding 2 N (C T P P) Hv; the projector 2 N Hv Hp +
// 2 N Hp H + 2 (N / m^2) (m^2 H) Hp + 2 (N / m^2) Hp H. Peak: the GPU's measured bf16
// matmul rate (`msa bench`'s 8192^3 cuBLASLt GEMM), the CPU's measured f32 FMA rate.
// Times: the median repeat (by the ViT's time) after the warm-up calls.
#include "bench_vision.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <optional>

#include "cli_args.h"
#include "engine_flag.h"
#include "machine_peak.h"
#ifdef MSA_WITH_CUDA
#include "cuda/common/device_buffer.h"
#endif
#include "msa/model.h"
#include "msa/ops.h"

namespace msa::cli {

double VisionTiming::vit_ms() const {
  double total = embed_ms;
  for (const auto& layer : layer_ms) total += layer[0] + layer[1] + layer[2];
  return total;
}

namespace {

constexpr const char* kUsage =
    "usage: msa bench-model --vision [--device cuda|cpu] [--config m3-vision | --model DIR]\n"
    "                       [--layers N] [--inputs image,video] [--repeats R] [--warmup W]\n"
    "                       [--attention-engine automatic|wgmma|mma_sync] [--threads N] [--json FILE]\n"
    "  the vision tower's time per layer (GEMMs, attention, the rest; the CPU: the layer's\n"
    "  total) and the projector's, on a 672 x 672 image (2304 patches) and a 64-frame\n"
    "  448 x 448 video (32768 patches, 8 segments of 4096), in ms and in % of the machine's\n"
    "  measured matmul peak. --config m3-vision (default): M3's ViT widths with random\n"
    "  weights, 4 layers unless --layers; --model DIR: a checkpoint's tower (its first --layers\n"
    "  layers). Defaults: --repeats 5 --warmup 1 on cuda, --repeats 1 --warmup 0 on the CPU\n"
    "  (the video takes minutes per layer on a few cores: use --layers 1 there).\n"
    "  --attention-engine (cuda): the dense attention kernel, automatic (default: the measured\n"
    "  choice, attention.cu use_dense_wgmma) or one pinned.\n";

struct Options {
  Device device = Device::cuda;
  std::string preset = "m3-vision", model_dir, json_path, attention_engine = "automatic";
  int64_t layers = 0;  // 0: the config's
  std::vector<std::string> inputs;
  int repeats = 5, warmup = 1;
};

Options parse_options(Args& args) {
  Options o;
  args.get_switch("vision");
  const std::string device = args.get_string("device", "cuda");
  if (device == "cpu") o.device = Device::cpu;
  else if (device != "cuda") throw UsageError("--device: expected cuda or cpu, got \"" + device + "\"");
  o.model_dir = args.get_string("model", "");
  const bool preset_given = args.has("config");
  o.preset = args.get_string("config", o.preset);
  if (!o.model_dir.empty() && preset_given) throw UsageError("give --model or --config, not both");
  o.layers = args.get_int("layers", 0, 0, 1 << 10);
  const std::string inputs = args.get_string("inputs", "image,video");
  for (size_t begin = 0; begin <= inputs.size();) {
    const size_t end = std::min(inputs.find(',', begin), inputs.size());
    const std::string name = inputs.substr(begin, end - begin);
    if (name != "image" && name != "video")
      throw UsageError("--inputs: expected a comma list of image and video, got \"" + inputs + "\"");
    o.inputs.push_back(name);
    begin = end + 1;
  }
  const bool cpu = o.device == Device::cpu;
  o.repeats = args.get_int("repeats", cpu ? 1 : 5, 1, 1000);
  o.warmup = args.get_int("warmup", cpu ? 0 : 1, 0, 1000);
  set_num_threads(args.get_threads());
  o.json_path = args.get_string("json", "");
  o.attention_engine = args.get_string("attention-engine", "automatic");
  parse_engine_flag(o.attention_engine, "--attention-engine");  // checked here, used by time_vision_cuda
  if (cpu && args.has("attention-engine")) throw UsageError("--attention-engine: cuda only");
  return o;
}

// A fast deterministic uniform fill with the given standard deviation (the values do not
// change the times; a normal generator over 0.3B weights would dominate the start-up).
class FastRandom {
 public:
  explicit FastRandom(uint64_t seed) : state_(seed * 0x9e3779b97f4a7c15ull + 1) {}
  float uniform(float stddev) {  // in [-sqrt(3) s, sqrt(3) s): variance s^2
    state_ ^= state_ << 13;
    state_ ^= state_ >> 7;
    state_ ^= state_ << 17;
    const float unit = static_cast<float>(state_ >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    return (2.0f * unit - 1.0f) * 1.7320508f * stddev;
  }

 private:
  uint64_t state_;
};

Tensor random_tensor(const Shape& shape, DType dtype, float stddev, FastRandom& rng) {
  Tensor t = Tensor::zeros(shape, dtype);
  const int64_t n = t.numel();
  if (dtype == DType::f32) {
    float* p = t.data<float>();
    for (int64_t i = 0; i < n; ++i) p[i] = rng.uniform(stddev);
  } else {
    auto* p = static_cast<uint16_t*>(t.raw());
    for (int64_t i = 0; i < n; ++i) p[i] = float_to_bf16(rng.uniform(stddev));
  }
  return t;
}

LinearWeights random_linear(int64_t out, int64_t in, FastRandom& rng) {
  return {random_tensor({out, in}, DType::bf16, 1.0f / std::sqrt(static_cast<float>(in)), rng),
          Tensor::zeros({out}, DType::f32)};
}

LayerNormWeights unit_norm(int64_t dim) {
  return {Tensor::full({dim}, DType::f32, 1.0), Tensor::zeros({dim}, DType::f32)};
}

VisionWeights random_vision_weights(const VisionConfig& c, int64_t text_hidden) {
  FastRandom rng(1);
  const int64_t Hv = c.hidden_size, I = c.intermediate_size, Hp = c.projector_hidden_size;
  VisionWeights w;
  w.patch_embedding = random_tensor({Hv, c.patch_values()}, DType::f32,
                                    1.0f / std::sqrt(static_cast<float>(c.patch_values())), rng);
  w.pre_norm = unit_norm(Hv);
  for (int64_t layer = 0; layer < c.num_layers; ++layer) {
    VisionLayerWeights l;
    l.norm1 = unit_norm(Hv);
    l.norm2 = unit_norm(Hv);
    l.q_proj = random_linear(Hv, Hv, rng);
    l.k_proj = random_linear(Hv, Hv, rng);
    l.v_proj = random_linear(Hv, Hv, rng);
    l.out_proj = random_linear(Hv, Hv, rng);
    l.fc1 = random_linear(I, Hv, rng);
    l.fc2 = random_linear(Hv, I, rng);
    w.layers.push_back(std::move(l));
  }
  w.linear_1 = random_linear(Hp, Hv, rng);
  w.linear_2 = random_linear(text_hidden, Hp, rng);
  w.merge_linear_1 = random_linear(Hp, c.merge_window() * text_hidden, rng);
  w.merge_linear_2 = random_linear(text_hidden, Hp, rng);
  return w;
}

struct Input {
  std::string name;
  VisionGrid grid;
};

Input make_input(const std::string& name) {
  if (name == "image") return {"image 672x672", {.t = 1, .h = 48, .w = 48}};
  return {"video 64x448x448", {.t = 32, .h = 32, .w = 32}};
}

struct Work {  // FLOPs
  double layer_gemm = 0, layer_attention = 0, embed = 0, projector = 0;
  int64_t patches = 0, segments = 0;
};

Work count_work(const VisionConfig& c, int64_t text_hidden, const VisionGrid& grid) {
  Work w;
  const double N = static_cast<double>(grid.patches()), Hv = static_cast<double>(c.hidden_size);
  const double I = static_cast<double>(c.intermediate_size), Hp = static_cast<double>(c.projector_hidden_size);
  const double H = static_cast<double>(text_hidden), m2 = static_cast<double>(c.merge_window());
  w.patches = grid.patches();
  w.layer_gemm = 4 * 2 * N * Hv * Hv + 2 * 2 * N * Hv * I;
  for (const VisionSegment& s : vision_segments({&grid, 1}, c)) {
    const double S = static_cast<double>(s.grid.patches());
    w.layer_attention += 4 * S * S * Hv;
    ++w.segments;
  }
  w.embed = 2 * N * static_cast<double>(c.patch_values()) * Hv;
  w.projector = 2 * N * Hv * Hp + 2 * N * Hp * H + 2 * (N / m2) * (m2 * H) * Hp + 2 * (N / m2) * Hp * H;
  return w;
}

// The CPU tower timed through its tap: the time between consecutive taps is the part that
// ends at the later one ("vision.patch_embed", "vision.pre_norm": the embedding; each
// "vision.layers.N": layer N), summed over the batches; the projector timed on its own.
VisionTiming time_vision_cpu(const VisionConfig& c, const VisionWeights& w, const Tensor& pixels,
                             const VisionGrid& grid) {
  using Clock = std::chrono::steady_clock;
  VisionTiming t;
  t.layer_ms.assign(static_cast<size_t>(c.num_layers), {0, 0, 0});
  const auto start = Clock::now();
  auto last = start;
  const ForwardTap tap = [&](const std::string& name, const Tensor&) {
    const auto now = Clock::now();
    const double ms = std::chrono::duration<double, std::milli>(now - last).count();
    last = now;
    const std::string prefix = "vision.layers.";
    if (name.rfind(prefix, 0) == 0)
      t.layer_ms.at(std::stoul(name.substr(prefix.size())))[2] += ms;
    else
      t.embed_ms += ms;
  };
  const Tensor features = vision_tower_forward(w, c, pixels, {&grid, 1}, Impl::cpu, tap);
  const auto projector_start = Clock::now();
  vision_projector_forward(w, c, features);
  const auto end = Clock::now();
  t.projector_ms = std::chrono::duration<double, std::milli>(end - projector_start).count();
  t.wall_ms = std::chrono::duration<double, std::milli>(end - start).count();
  return t;
}

const VisionTiming& median_run(std::vector<VisionTiming>& runs) {
  std::sort(runs.begin(), runs.end(), [](const VisionTiming& a, const VisionTiming& b) { return a.vit_ms() < b.vit_ms(); });
  return runs[runs.size() / 2];
}

std::string fixed3(double value) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3f", value);
  return text;
}

double percent(double flops, double ms, double peak_tflops) {
  return ms > 0 ? 100.0 * flops / (ms * 1e-3) / (peak_tflops * 1e12) : 0.0;
}

struct Report {
  FILE* json = nullptr;
  std::string device, machine, attention_engine;
  double peak_tflops = 0;
  int64_t layers = 0;
  int repeats = 0;

  // One row: text and (with --json) a JSON line.
  // other_flops: work timed in other_ms (the embedding inside the ViT's total).
  void row(const Input& input, const Work& work, const std::string& part, double gemm_ms, double attention_ms,
           double other_ms, double gemm_flops, double attention_flops, double other_flops = 0) const {
    const double total_ms = gemm_ms + attention_ms + other_ms, flops = gemm_flops + attention_flops + other_flops;
    const bool split = gemm_ms > 0 || attention_ms > 0;
    auto cell = [](double ms, double pct, bool show) {
      char text[48];
      if (!show) return std::string("-");
      std::snprintf(text, sizeof text, "%.3f (%.0f%%)", ms, pct);
      return std::string(text);
    };
    std::printf("| %s | %lld | %lld | %s | %s | %s | %s | %.3f (%.0f%%) |\n", input.name.c_str(),
                static_cast<long long>(work.patches), static_cast<long long>(work.segments), part.c_str(),
                cell(gemm_ms, percent(gemm_flops, gemm_ms, peak_tflops), split).c_str(),
                cell(attention_ms, percent(attention_flops, attention_ms, peak_tflops), split && attention_flops > 0).c_str(),
                split ? fixed3(other_ms).c_str() : "-", total_ms,
                percent(flops, total_ms, peak_tflops));
    if (!json) return;
    std::fprintf(json,
                 "{\"bench\":\"vision\",\"device\":\"%s\",\"machine\":\"%s\",\"input\":\"%s\",\"patches\":%lld,"
                 "\"segments\":%lld,\"layers\":%lld,\"part\":\"%s\",\"gemm_ms\":%.6f,\"attention_ms\":%.6f,"
                 "\"other_ms\":%.6f,\"total_ms\":%.6f,\"gemm_gflop\":%.3f,\"attention_gflop\":%.3f,"
                 "\"peak_tflops\":%.2f,\"peak_percent\":%.2f,\"split\":%s,\"repeats\":%d,\"attention_engine\":\"%s\"}\n",
                 device.c_str(), machine.c_str(), input.name.c_str(), static_cast<long long>(work.patches),
                 static_cast<long long>(work.segments), static_cast<long long>(layers), part.c_str(), gemm_ms,
                 attention_ms, other_ms, total_ms, gemm_flops * 1e-9, attention_flops * 1e-9, peak_tflops,
                 percent(flops, total_ms, peak_tflops), split ? "true" : "false", repeats, attention_engine.c_str());
  }
};

int run(Args& args) {
  if (args.get_switch("help")) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  const Options o = parse_options(args);
  args.finish();
#ifdef MSA_WITH_CUDA
  if (o.device == Device::cuda && cuda::device_count() < 1) throw Error("--device cuda: no CUDA device is visible");
#else
  if (o.device == Device::cuda)
    throw Error("--device cuda: this build of msa has no CUDA backend (configure with -DMSA_CUDA=ON)");
#endif

  // ---- the tower ----
  VisionConfig config;
  VisionWeights weights;
  int64_t text_hidden = 0;
  std::string source;
  std::optional<Model> model;
  if (!o.model_dir.empty()) {
    model.emplace(Model::load(o.model_dir, Device::cpu));
    if (!model->config().vision)
      throw UsageError("--model: " + o.model_dir + " has no vision tower (its config.json has no vision_config)");
    config = *model->config().vision;
    weights = *model->weights().vision;
    text_hidden = model->config().hidden_size;
    source = o.model_dir;
  } else {
    ModelConfig c;
    try {
      c = model_config_preset(o.preset);
    } catch (const Error&) {
      throw UsageError("--config: expected a preset with a vision tower (m3-vision, tiny-vl), got \"" + o.preset + "\"");
    }
    if (!c.vision) throw UsageError("--config: " + o.preset + " has no vision tower (use m3-vision)");
    config = *c.vision;
    if (o.layers > 0) config.num_layers = o.layers;
    text_hidden = c.hidden_size;
    std::fprintf(stderr, "[bench-model --vision] random weights for %lld layers ...\n",
                 static_cast<long long>(config.num_layers));
    weights = random_vision_weights(config, text_hidden);
    source = o.preset + " preset, random weights";
  }
  if (o.layers > 0 && o.layers < static_cast<int64_t>(weights.layers.size())) weights.layers.resize(o.layers);
  if (o.layers > 0 && o.layers > config.num_layers)
    throw UsageError("--layers: the tower has " + std::to_string(config.num_layers) + " layers");
  if (o.layers > 0) config.num_layers = o.layers;

  Report report;
  report.layers = config.num_layers;
  report.repeats = o.repeats;
  report.attention_engine = o.device == Device::cuda ? o.attention_engine : "cpu";
  if (o.device == Device::cuda) {
#ifdef MSA_WITH_CUDA
    std::fprintf(stderr, "[bench-model --vision] measuring the bf16 matmul peak ...\n");
    report.peak_tflops = cuda_matmul_peak_tflops(report.machine);
    report.device = "cuda";
#endif
  } else {
    const MachinePeak peak = measure_machine_peak();
    report.peak_tflops = peak.gflops * 1e-3;
    report.device = "cpu";
    report.machine = std::to_string(num_threads()) + " threads";
  }
  if (!o.json_path.empty()) {
    report.json = std::fopen(o.json_path.c_str(), "w");
    if (!report.json) throw Error("--json: cannot write " + o.json_path);
  }
  std::printf("msa bench-model --vision: %s, %s (peak %.3g TFLOP/s %s)\n", report.device.c_str(),
              report.machine.c_str(), report.peak_tflops,
              o.device == Device::cuda ? "bf16 matmul" : "f32 FMA");
  std::printf("tower: %s; hidden %lld, %lld heads x %lld, MLP %lld, %lld layers, projector %lld -> %lld; "
              "median of %d repeats after %d warm-up; attention engine %s\n",
              source.c_str(), static_cast<long long>(config.hidden_size), static_cast<long long>(config.num_heads),
              static_cast<long long>(config.head_dim()), static_cast<long long>(config.intermediate_size),
              static_cast<long long>(config.num_layers), static_cast<long long>(config.projector_hidden_size),
              static_cast<long long>(text_hidden), o.repeats, o.warmup, report.attention_engine.c_str());
  std::printf("\n| input | patches | segments | part | GEMMs ms (%% peak) | attention ms (%% peak) | other ms | "
              "total ms (%% peak) |\n|---|---|---|---|---|---|---|---|\n");
  std::fflush(stdout);

  for (const std::string& name : o.inputs) {
    const Input input = make_input(name);
    const Work work = count_work(config, text_hidden, input.grid);
    FastRandom rng(7);
    const Tensor pixels = random_tensor({input.grid.patches(), config.patch_values()}, DType::f32, 1.0f, rng);
    std::fprintf(stderr, "[bench-model --vision] %s: %lld patches ...\n", input.name.c_str(),
                 static_cast<long long>(work.patches));
    std::vector<VisionTiming> runs;
#ifdef MSA_WITH_CUDA
    if (o.device == Device::cuda) runs = time_vision_cuda(config, weights, pixels, {input.grid}, o.warmup, o.repeats, o.attention_engine);
#endif
    if (o.device == Device::cpu) {
      for (int i = 0; i < o.warmup; ++i) time_vision_cpu(config, weights, pixels, input.grid);
      for (int i = 0; i < o.repeats; ++i) runs.push_back(time_vision_cpu(config, weights, pixels, input.grid));
    }
    const VisionTiming& t = median_run(runs);
    double gemm = 0, attention = 0, other = 0;
    for (size_t layer = 0; layer < t.layer_ms.size(); ++layer) {
      const auto& l = t.layer_ms[layer];
      report.row(input, work, "layer " + std::to_string(layer), l[0], l[1], l[2], work.layer_gemm, work.layer_attention);
      gemm += l[0];
      attention += l[1];
      other += l[2];
    }
    const double layers = static_cast<double>(t.layer_ms.size());
    report.row(input, work, "embed", 0, 0, t.embed_ms, work.embed, 0);
    report.row(input, work, "ViT total", gemm, attention, other + t.embed_ms, layers * work.layer_gemm,
               layers * work.layer_attention, work.embed);
    report.row(input, work, "projector", 0, 0, t.projector_ms, work.projector, 0);
    std::printf("| %s | | | wall (tower + projector, with copies) | | | | %.3f |\n", input.name.c_str(), t.wall_ms);
    std::fflush(stdout);
  }
  if (report.json) std::fclose(report.json);
  return 0;
}

}  // namespace
}  // namespace msa::cli

int run_bench_vision_command(int argc, char** argv) {
  using namespace msa::cli;
  return run_reporting_errors("bench-model --vision", kUsage, [&] {
    Args args(argc, argv, {"help", "vision"});
    return run(args);
  });
}
