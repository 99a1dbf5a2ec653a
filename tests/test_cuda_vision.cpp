// The vision tower and projector on the GPU (CudaVisionTower, Model::encode_vision of a
// Device::cuda model, `msa run --image --device cuda`) against the CPU path on the same bf16
// checkpoint. Skipped (not failed) without a CUDA device; label "gpu".
//
// Tolerance: the CUDA path rounds every GEMM input (LN outputs, q/k/v after RoPE, the
// attention's P and output, the GELU outputs, the projector's inputs) to bf16 (2^-9
// relative each) and accumulates in f32; the CPU keeps f32 activations over the same bf16
// weights. Per layer that is a few independent 2^-9 roundings, so after the tiny towers'
// 2 layers and the projector the error is expected near 1e-3..5e-3 of the tensor's largest
// value; the bar is max |cuda - cpu| / max |cpu| <= 2e-2 per output tensor (and per tap),
// the text model's bar (test_cuda_model.cpp). A missing row is NaN (the outputs and the
// device activations start as NaN) and fails.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <sstream>

#include "cli_runner.h"
#include "cuda/common/device_buffer.h"
#include "model/gpu/cuda_vision.h"
#include "model/gpu/kernels.h"
#include "model/layer_layout.h"
#include "model/tensor_math.h"
#include "msa/model.h"
#include "msa/model_random.h"
#include "gpu_checks.h"
#include "test_util.h"

namespace msa {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::fresh_dir;
using testing::run_cli;
using testing::shell_quote;

constexpr double kMaxRelative = 2e-2;

// max |got - want| / max |want| over the tensor, with the worst element's row, column and
// values in the message (printed on success too: the run's numbers for the log).
void expect_close(const Tensor& got, const Tensor& want, const std::string& what, double bar = kMaxRelative) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  ASSERT_EQ(got.dim(), 2) << what;
  const Tensor g = got.to(DType::f32), w = want.to(DType::f32);
  const int64_t cols = g.size(1), n = g.numel();
  const float* a = g.data<float>();
  const float* b = w.data<float>();
  double scale = 0, worst = 0;
  int64_t at = 0, nan_at = -1;
  for (int64_t i = 0; i < n; ++i) {
    scale = std::max(scale, std::fabs(static_cast<double>(b[i])));
    if (!std::isfinite(a[i]) && nan_at < 0) nan_at = i;
    const double d = std::fabs(static_cast<double>(a[i]) - b[i]);
    if (d > worst) worst = d, at = i;
  }
  ASSERT_LT(nan_at, 0) << what << ": not finite at row " << nan_at / cols << " col " << nan_at % cols
                       << " (got " << a[nan_at] << ", want " << b[nan_at] << ")";
  const double ratio = worst / std::max(scale, 1e-30);
  std::printf("%-48s max|d| %.3g / max|cpu| %.3g = %.3g (row %lld col %lld: cuda %.6g cpu %.6g)\n", what.c_str(),
              worst, scale, ratio, static_cast<long long>(at / cols), static_cast<long long>(at % cols), a[at], b[at]);
  EXPECT_LE(ratio, bar) << what << ": max |cuda - cpu| " << worst << " / max |cpu| " << scale << " at row " << at / cols
                        << " col " << at % cols << " (cuda " << a[at] << ", cpu " << b[at] << ")";
  EXPECT_GT(scale, 0) << what << ": the CPU output is all zeros (nothing compared)";
}

// Named intermediates of a call (a later batch's tap gets a "#k" suffix).
using Intermediates = std::map<std::string, Tensor>;
ForwardTap keep_into(Intermediates& parts) {
  return [&parts](const std::string& name, const Tensor& value) {
    std::string key = name;
    for (int k = 1; parts.count(key); ++k) key = name + "#" + std::to_string(k);
    parts.emplace(key, value.clone());
  };
}

// A small text model the CUDA text runtime takes (head dim 64, page 64) with `vision`.
ModelConfig text_with_vision(const VisionConfig& vision) {
  ModelConfig shape{.vocab_size = 512, .hidden_size = 256, .num_heads = 8, .num_kv_heads = 2, .head_dim = 64,
                    .rotary_dim = 32, .dense_intermediate_size = 384, .moe_intermediate_size = 128,
                    .shared_intermediate_size = 128, .num_experts = 8, .experts_per_token = 2, .index_heads = 2,
                    .index_head_dim = 64, .block_size = 64, .topk_blocks = 4};
  shape.bos_token_id = 1;
  shape.eos_token_ids = {2};
  shape.dtype = "bfloat16";
  ModelConfig c = with_layers(shape, 2, 1);
  c.vision = vision;
  c.vision->image_token_id = 500;  // placeholders inside the vocabulary
  c.vision->video_token_id = 501;
  c.vision->vision_start_token_id = 502;
  c.vision->vision_end_token_id = 503;
  c.validate();
  return c;
}

// A bf16 checkpoint (+ tokenizer, processor configs) of `config`, written once per name.
std::string checkpoint(const std::string& name, const ModelConfig& config) {
  static auto& written = *new std::map<std::string, std::string>();
  if (auto found = written.find(name); found != written.end()) return found->second;
  const fs::path dir = fresh_dir("cuda_vision_" + name);
  write_random_checkpoint(config, dir.string(), {.seed = 21, .dtype = DType::bf16});
  write_random_tokenizer(config, dir.string());
  return written[name] = dir.string();
}

// The CUDA tower against the CPU encode_vision, outputs and taps.
void compare_tower(const Model& cpu, const Tensor& pixels, const std::vector<VisionGrid>& grids,
                   const std::string& what) {
  model::gpu::CudaVisionTower tower(*cpu.config().vision, *cpu.weights().vision);
  Intermediates cpu_parts, gpu_parts;
  const std::vector<Tensor> want = cpu.encode_vision(pixels, grids, keep_into(cpu_parts));
  const std::vector<Tensor> got = tower.encode(pixels, grids, keep_into(gpu_parts));
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i)
    expect_close(got[i], want[i],
                 what + " grid " + std::to_string(i) + " (" + std::to_string(grids[i].t) + "x" +
                     std::to_string(grids[i].h) + "x" + std::to_string(grids[i].w) + ")");
  // The taps: the same names from the same batches.
  ASSERT_EQ(gpu_parts.size(), cpu_parts.size()) << what;
  for (const auto& [name, value] : cpu_parts) {
    ASSERT_TRUE(gpu_parts.count(name)) << what << ": the CUDA path did not report tap " << name;
    expect_close(gpu_parts.at(name), value, what + " tap " + name);
  }
  // A second call reuses the device memory and gives the same bits.
  const std::vector<Tensor> again = tower.encode(pixels, grids);
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_TRUE(testing::bitwise_equal(again[i], got[i])) << what << ": a repeated call differs, grid " << i;
}

// ---- the kernels against the CPU ops (model/tensor_math.h) ----

// Device copies of host f32 values, and back.
msa::cuda::DeviceBuffer to_device(const std::vector<float>& values) { return msa::cuda::DeviceBuffer::from(values); }
template <class T>
std::vector<T> to_host(const msa::cuda::DeviceBuffer& buffer, int64_t count) {
  std::vector<T> values(static_cast<size_t>(count));
  buffer.download(values.data(), values.size() * sizeof(T));
  return values;
}
std::vector<float> random_values(int64_t count, double stddev = 1.0) {
  const Tensor t = testing::random_normal({count}, stddev);
  return {t.data<float>(), t.data<float>() + count};
}

// |got - want| <= rel * |want| + abs, the first miss named (row, column, values).
void expect_values(const std::vector<float>& got, const std::vector<float>& want, int64_t cols, double rel,
                   double abs, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    if (!(std::fabs(got[i] - want[i]) <= rel * std::fabs(want[i]) + abs)) {
      ADD_FAILURE() << what << ": row " << i / cols << " col " << i % cols << ": cuda " << got[i] << ", cpu "
                    << want[i];
      return;
    }
}

std::vector<float> bf16_values(const std::vector<uint16_t>& bits) {
  std::vector<float> values(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) values[i] = bf16_to_float(bits[i]);
  return values;
}

// A bf16 output against the f32 reference: within one bf16 rounding (2^-8 relative: the two
// f32 values may straddle a rounding boundary).
constexpr double kBf16Rounding = 1.0 / 256;

// LayerNorm: edge widths (1, not a multiple of a warp or of the CTA, M3's 1280), one row and
// many; f32 out of place and in place, bf16 out.
TEST(CudaVisionKernels, LayerNormMatchesTheCpu) {
  MSA_REQUIRE_CUDA();
  for (const auto& [rows, dim] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {3, 7}, {5, 80}, {2, 257}, {17, 1280}}) {
    const std::string what = "layer_norm_rows " + std::to_string(rows) + "x" + std::to_string(dim);
    const std::vector<float> x = random_values(rows * dim, 3.0), w = random_values(dim), b = random_values(dim);
    std::vector<float> want(x.size());
    model::layer_norm(x.data(), want.data(), rows, dim, Tensor::from_vector(w, {dim}), Tensor::from_vector(b, {dim}),
                      1e-5);
    auto dx = to_device(x), dw = to_device(w), db = to_device(b);
    msa::cuda::DeviceBuffer out_f32(x.size() * 4), out_bf16(x.size() * 2);
    out_f32.fill_bytes(0xff);
    out_bf16.fill_bytes(0xff);
    model::gpu::layer_norm_rows(dx.as<float>(), rows, dim, dw.as<float>(), db.as<float>(), 1e-5f, out_bf16.as<uint16_t>(),
                                out_f32.as<float>(), nullptr);
    expect_values(to_host<float>(out_f32, rows * dim), want, dim, 1e-5, 1e-5, what + " f32");
    expect_values(bf16_values(to_host<uint16_t>(out_bf16, rows * dim)), want, dim, kBf16Rounding, 1e-5, what + " bf16");
    model::gpu::layer_norm_rows(dx.as<float>(), rows, dim, dw.as<float>(), db.as<float>(), 1e-5f, nullptr, dx.as<float>(),
                                nullptr);
    expect_values(to_host<float>(dx, rows * dim), want, dim, 1e-5, 1e-5, what + " in place");
  }
}

// Bias (+ exact GELU): one element, widths off the CTA size, more rows than the grid's y
// extent (8192: the row loop wraps); f32 back and bf16 out.
TEST(CudaVisionKernels, BiasGeluMatchesTheCpu) {
  MSA_REQUIRE_CUDA();
  for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {3, 300}, {9000, 3}, {4, 5120}})
    for (const bool gelu : {false, true}) {
      const std::string what = "bias_gelu " + std::to_string(rows) + "x" + std::to_string(cols) + (gelu ? " gelu" : "");
      const std::vector<float> y = random_values(rows * cols, 2.0), bias = random_values(cols);
      std::vector<float> want(y.size());
      for (int64_t i = 0; i < rows * cols; ++i) want[i] = y[i] + bias[i % cols];
      if (gelu) model::gelu_erf(want.data(), rows * cols);
      auto dy = to_device(y), dbias = to_device(bias);
      msa::cuda::DeviceBuffer out_bf16(y.size() * 2);
      out_bf16.fill_bytes(0xff);
      model::gpu::bias_gelu(dy.as<float>(), rows, cols, dbias.as<float>(), gelu, out_bf16.as<uint16_t>(), true, nullptr);
      expect_values(to_host<float>(dy, rows * cols), want, cols, 1e-6, 1e-6, what + " f32");
      expect_values(bf16_values(to_host<uint16_t>(out_bf16, rows * cols)), want, cols, kBf16Rounding, 1e-6,
                    what + " bf16");
    }
}

// Bias + RoPE from a per-token angle table into padded heads: head dims 20 (18 rotated, 2
// passed) and 80 (78 + 2), rotary 0 (v), pads of 0 and up to 64 / 128; the pad is zeros.
TEST(CudaVisionKernels, HeadRopeWithAnglesMatchesTheCpu) {
  MSA_REQUIRE_CUDA();
  struct Case {
    int64_t tokens, heads, dim, rotary, dst_dim;
  };
  for (const Case& c : {Case{1, 1, 20, 18, 20}, Case{5, 2, 20, 18, 64}, Case{33, 3, 80, 78, 80}, Case{7, 16, 80, 78, 128},
                        Case{6, 2, 80, 0, 80}, Case{4, 3, 20, 0, 64}}) {
    const std::string what = "head_norm_rope " + std::to_string(c.tokens) + " tokens x " + std::to_string(c.heads) +
                             " heads, dim " + std::to_string(c.dim) + " rotary " + std::to_string(c.rotary) +
                             " -> " + std::to_string(c.dst_dim);
    const int64_t width = c.heads * c.dim, stride = width + 3;  // rows of a wider GEMM output
    const std::vector<float> src = random_values(c.tokens * stride), bias = random_values(width);
    const int64_t half = c.rotary / 2;
    std::vector<float> angles = random_values(std::max<int64_t>(c.tokens * half, 1), 20.0);
    std::vector<float> want(static_cast<size_t>(c.tokens * width));
    for (int64_t t = 0; t < c.tokens; ++t)
      for (int64_t i = 0; i < width; ++i) want[t * width + i] = src[t * stride + i] + bias[i];
    model::apply_rope_angles(want.data(), c.tokens, c.heads, c.dim, angles.data(), half);
    auto dsrc = to_device(src), dbias = to_device(bias), dangles = to_device(angles);
    msa::cuda::DeviceBuffer dst(static_cast<size_t>(c.tokens * c.heads * c.dst_dim) * 2);
    dst.fill_bytes(0xff);
    model::gpu::HeadTransform job;
    job.src = dsrc.as<float>();
    job.src_stride = stride;
    job.tokens = c.tokens;
    job.heads = c.heads;
    job.dim = c.dim;
    job.bias = dbias.as<float>();
    job.rotary_dim = c.rotary;
    job.angles = dangles.as<float>();
    job.dst = dst.as<uint16_t>();
    job.dst_dim = c.dst_dim;
    model::gpu::head_norm_rope(job, nullptr);
    const std::vector<float> got = bf16_values(to_host<uint16_t>(dst, c.tokens * c.heads * c.dst_dim));
    std::vector<float> unpadded, pad;
    for (int64_t row = 0; row < c.tokens * c.heads; ++row) {
      unpadded.insert(unpadded.end(), got.begin() + row * c.dst_dim, got.begin() + row * c.dst_dim + c.dim);
      pad.insert(pad.end(), got.begin() + row * c.dst_dim + c.dim, got.begin() + (row + 1) * c.dst_dim);
    }
    expect_values(unpadded, want, c.dim, kBf16Rounding, 1e-5, what);
    expect_values(pad, std::vector<float>(pad.size(), 0.0f), std::max<int64_t>(c.dst_dim - c.dim, 1), 0, 0,
                  what + " pad");
  }
}

// ---- the tower ----

// (a) tiny-vl's tower (head dim 20: padded to the kernel's 64; 18 rotated channels, 2
// passed through): an image, a video of 10 temporal patches (segments of 4, 4 and 2), and a
// 2x2-patch image (a segment of 4 patches, one merge window).
TEST(CudaVision, TinyTowerMatchesTheCpu) {
  MSA_REQUIRE_CUDA();
  const ModelConfig config = text_with_vision(*model_config_preset("tiny-vl").vision);
  const Model cpu = Model::load(checkpoint("tiny", config));
  const std::vector<VisionGrid> grids = {{.t = 1, .h = 8, .w = 12}, {.t = 10, .h = 4, .w = 6}, {.t = 1, .h = 2, .w = 2}};
  int64_t patches = 0;
  for (const VisionGrid& g : grids) patches += g.patches();
  const Tensor pixels = testing::random_normal({patches, config.vision->patch_values()});
  compare_tower(cpu, pixels, grids, "tiny-vl");
}

// (b) M3's ViT widths (1280, 16 heads of 80, MLP 5120, projector 6144) with 2 layers on a
// 448 x 448 image (32 x 32 patches, one segment of 1024).
TEST(CudaVision, M3WidthsOn448Image) {
  MSA_REQUIRE_CUDA();
  VisionConfig vision;  // M3's values
  vision.num_layers = 2;
  const ModelConfig config = text_with_vision(vision);
  const Model cpu = Model::load(checkpoint("m3", config));
  const std::vector<VisionGrid> grids = {{.t = 1, .h = 32, .w = 32}};
  const Tensor pixels = testing::random_normal({grids[0].patches(), vision.patch_values()});
  compare_tower(cpu, pixels, grids, "m3 widths");
}

// Model::encode_vision of a Device::cuda model runs the CUDA tower; bad input gets the CPU
// path's errors.
TEST(CudaVision, CudaModelEncodesOnTheDevice) {
  MSA_REQUIRE_CUDA();
  const ModelConfig config = text_with_vision(*model_config_preset("tiny-vl").vision);
  const std::string dir = checkpoint("tiny", config);
  const Model cpu = Model::load(dir, Device::cpu);
  const Model gpu = Model::load(dir, Device::cuda);
  const std::vector<VisionGrid> grids = {{.t = 6, .h = 4, .w = 4}, {.t = 1, .h = 6, .w = 4}};
  const int64_t patches = grids[0].patches() + grids[1].patches();
  const Tensor pixels = testing::random_normal({patches, config.vision->patch_values()}, 1.0, DType::bf16);
  const std::vector<Tensor> want = cpu.encode_vision(pixels, grids);
  const std::vector<Tensor> got = gpu.encode_vision(pixels, grids);
  ASSERT_EQ(got.size(), 2u);
  for (size_t i = 0; i < got.size(); ++i) expect_close(got[i], want[i], "Model::encode_vision grid " + std::to_string(i));

  const Tensor short_pixels = testing::random_normal({patches - 4, config.vision->patch_values()});
  const std::string cpu_error = error_of([&] { cpu.encode_vision(short_pixels, grids); });
  EXPECT_NE(cpu_error, "(no error)");
  EXPECT_EQ(error_of([&] { gpu.encode_vision(short_pixels, grids); }), cpu_error);
  const std::vector<VisionGrid> odd = {{.t = 1, .h = 3, .w = 4}};
  EXPECT_EQ(error_of([&] { gpu.encode_vision(pixels, odd); }), error_of([&] { cpu.encode_vision(pixels, odd); }));
}

// `msa run --image` on cuda: the same first generated token as on the CPU (a near tie could
// flip it; the random model's top two logits after this prompt are not near: a failure
// here means the image rows differ).
TEST(CudaVision, RunWithAnImageOnCuda) {
  MSA_REQUIRE_CUDA();
  const ModelConfig config = text_with_vision(*model_config_preset("tiny-vl").vision);
  const std::string dir = checkpoint("tiny", config);
  const auto first_token = [&](const char* device) {
    const fs::path out = fresh_dir(std::string("cuda_vision_run_") + device);
    const testing::CliResult r =
        run_cli("run --model " + shell_quote(dir) + " --image " + shell_quote(MSA_TEST_IMAGE) +
                    " --prompt " + shell_quote("What is in the picture?") + " --max-tokens 1 --device " + device,
                out, /*merge_stderr=*/false);
    EXPECT_EQ(r.exit_code, 0) << device << ": " << r.out << r.err;
    std::printf("msa run --device %s: %s", device, r.out.c_str());
    std::istringstream line(r.out);
    int token = -1;
    line >> token;
    return token;
  };
  const int cpu = first_token("cpu"), gpu = first_token("cuda");
  EXPECT_GE(cpu, 0);
  EXPECT_EQ(gpu, cpu);
}

}  // namespace
}  // namespace msa
