// The routed-expert GEMMs of the CUDA MoE against f64 dot products of the same bf16 values:
// the decode-sized kernel (moe_experts_small.cu) and the grouped tensor-core kernel
// (moe_experts_grouped.cu), over row distributions with the edges: one row, one row per
// expert, every row in one expert, rows per expert around the grouped kernel's 32-row tile and
// its 16-row MMA, empty experts between used ones, dims that end inside a tile; outputs
// poisoned, the grouped kernel bitwise repeatable. The same in the quantized weight formats
// (MXFP8, NVFP4: codes and scales as the releases store them, widened in the kernels) against
// f64 products of the host-dequantized weights (model::dequantize_mxfp8 / dequantize_nvfp4),
// with the codes' extremes, both kernels bitwise repeatable; the launchers' refusals of
// formats, shapes and pointers. Then the model: a made three-layer model's
// logits with the grouped kernel against the per-expert cuBLASLt GEMMs at a step of more than
// 64 entries, and a decode graph captured at such a batch.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "cli_runner.h"
#include "cuda/common/device_buffer.h"
#include "model/gpu/cuda_model.h"
#include "model/gpu/expert_weights.h"
#include "model/gpu/kernels.h"
#include "model/mxfp8.h"
#include "model/nvfp4.h"
#include "msa/dtype.h"
#include "msa/model.h"
#include "msa/model_random.h"
#include "gpu_checks.h"
#include "op_cases.h"
#include "test_util.h"
#include "three_layer_model.h"

namespace msa {
namespace {

using cuda::DeviceBuffer;
using model::gpu::CudaModel;
using model::gpu::ExpertWeights;
using model::gpu::MoeKernel;
using testing::rng;

std::vector<uint16_t> random_bf16(int64_t count) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<uint16_t> out(static_cast<size_t>(count));
  for (uint16_t& v : out) v = float_to_bf16(dist(rng()));
  return out;
}

enum class Kernel { small, grouped };

// The experts' weights [experts, out, in] in one format, on the device, and the values the
// reference multiplies: value[r][i] = bf16_to_float(values[r * in + i]) * row_factor[r] over
// the experts' rows r (row_factor is NVFP4's global scale, which the kernels apply to the f32
// sum; 1 otherwise).
struct ExpertWeightsCase {
  std::vector<uint16_t> values;
  std::vector<double> row_factor;
  DeviceBuffer w, codes, scales, global_scale;
  model::gpu::QuantizedExpertWeights quantized;
};

// e4m3 codes other than NaN (0x7f, 0xff): a quarter from the extremes (+-448, the smallest and
// largest subnormals, the smallest normal, +-0), the rest uniform.
uint8_t random_e4m3_code() {
  static constexpr uint8_t kExtremes[] = {0x7e, 0xfe, 0x01, 0x81, 0x07, 0x87, 0x08, 0x00, 0x80};
  if (std::uniform_int_distribution<int>(0, 3)(rng()) == 0)
    return kExtremes[std::uniform_int_distribution<size_t>(0, std::size(kExtremes) - 1)(rng())];
  uint8_t code;
  do code = static_cast<uint8_t>(std::uniform_int_distribution<int>(0, 255)(rng()));
  while ((code & 0x7f) == 0x7f);
  return code;
}

ExpertWeightsCase make_expert_weights(ExpertWeights format, int64_t experts, int64_t out, int64_t in) {
  ExpertWeightsCase c;
  const int64_t rows = experts * out;
  c.row_factor.assign(static_cast<size_t>(rows), 1.0);
  c.quantized.format = format;
  if (format == ExpertWeights::bf16) {
    c.values = random_bf16(rows * in);
    c.w = DeviceBuffer::from(c.values);
    return c;
  }
  if (format == ExpertWeights::mxfp8) {
    // UE8M0 exponents 2^-20 .. 2^10, both ends present.
    std::vector<uint8_t> codes(static_cast<size_t>(rows * in)), exponents(static_cast<size_t>(rows * in / 32));
    for (uint8_t& code : codes) code = random_e4m3_code();
    for (uint8_t& u : exponents) u = static_cast<uint8_t>(std::uniform_int_distribution<int>(127 - 20, 127 + 10)(rng()));
    exponents.front() = 127 - 20;
    exponents.back() = 127 + 10;
    const Tensor values = model::dequantize_mxfp8(Tensor::wrap(codes.data(), {rows, in}, DType::e4m3, nullptr),
                                                  Tensor::wrap(exponents.data(), {rows, in / 32}, DType::u8, nullptr),
                                                  "experts");
    c.values.assign(static_cast<const uint16_t*>(values.raw()), static_cast<const uint16_t*>(values.raw()) + rows * in);
    c.codes = DeviceBuffer::from(codes);
    c.scales = DeviceBuffer::from(exponents);
    c.quantized.codes = c.codes.as<uint8_t>();
    c.quantized.scales = c.scales.as<uint8_t>();
    return c;
  }
  // NVFP4: every byte, so every e2m1 code (-0 included) in both nibbles; e4m3 block scales as
  // above (negative and zero ones too: the format allows them); a global scale per row of
  // 2^-10 .. 2^10 x [1, 2).
  std::vector<uint8_t> packed(static_cast<size_t>(rows * in / 2)), block_scales(static_cast<size_t>(rows * in / 16));
  for (uint8_t& byte : packed) byte = static_cast<uint8_t>(std::uniform_int_distribution<int>(0, 255)(rng()));
  for (uint8_t& code : block_scales) code = random_e4m3_code();
  std::vector<float> global(static_cast<size_t>(rows));
  for (float& g : global)
    g = std::ldexp(std::uniform_real_distribution<float>(1.0f, 2.0f)(rng()), std::uniform_int_distribution<int>(-10, 9)(rng()));
  // The exact products e2m1 x e4m3 (global scale 1: the kernels apply the real one to the sum).
  float one = 1.0f;
  const Tensor values = model::dequantize_nvfp4(Tensor::wrap(packed.data(), {rows, in / 2}, DType::u8, nullptr),
                                                Tensor::wrap(block_scales.data(), {rows, in / 16}, DType::e4m3, nullptr),
                                                Tensor::wrap(&one, {1}, DType::f32, nullptr), "experts");
  c.values.assign(static_cast<const uint16_t*>(values.raw()), static_cast<const uint16_t*>(values.raw()) + rows * in);
  for (int64_t r = 0; r < rows; ++r) c.row_factor[r] = global[r];
  c.codes = DeviceBuffer::from(packed);
  c.scales = DeviceBuffer::from(block_scales);
  c.global_scale = DeviceBuffer::from(global);
  c.quantized.codes = c.codes.as<uint8_t>();
  c.quantized.scales = c.scales.as<uint8_t>();
  c.quantized.global_scale = c.global_scale.as<float>();
  return c;
}

// `rows` rows routed to `experts` experts uniformly at random: rows per expert.
std::vector<int32_t> random_rows(int64_t rows, int64_t experts) {
  std::vector<int32_t> count(static_cast<size_t>(experts), 0);
  for (int64_t n = 0; n < rows; ++n) ++count[std::uniform_int_distribution<int64_t>(0, experts - 1)(rng())];
  return count;
}

// rows_per_expert[e] rows for expert e; checks y against the f64 product of every row. Each
// kernel also runs a second time into a freshly poisoned buffer: bitwise equal.
void check_case(Kernel kernel, const std::vector<int32_t>& rows_per_expert, int64_t in, int64_t out,
                const std::string& what, ExpertWeights format = ExpertWeights::bf16) {
  SCOPED_TRACE(what + " (" + model::gpu::expert_weights_name(format) + ")");
  const int64_t experts = static_cast<int64_t>(rows_per_expert.size());
  std::vector<int32_t> offsets(rows_per_expert.size() + 1, 0);
  std::partial_sum(rows_per_expert.begin(), rows_per_expert.end(), offsets.begin() + 1);
  const int64_t entries = offsets.back();
  if (kernel == Kernel::small) ASSERT_TRUE(model::gpu::moe_experts_small_fits(entries, in, out, format));
  else ASSERT_TRUE(model::gpu::moe_experts_grouped_fits(in, out, format));
  const std::vector<uint16_t> x = random_bf16(entries * in);
  const ExpertWeightsCase weights = make_expert_weights(format, experts, out, in);
  const std::vector<uint16_t>& w = weights.values;
  DeviceBuffer dx = DeviceBuffer::from(x), doff = DeviceBuffer::from(offsets);
  DeviceBuffer dy(static_cast<size_t>(entries * out) * sizeof(float));
  auto run = [&] {
    dy.fill_bytes(0xff);  // poison: NaN everywhere a row is not written
    if (kernel == Kernel::small)
      model::gpu::moe_experts_small({.x = dx.as<uint16_t>(), .w = weights.w.as<uint16_t>(),
                                     .offsets = doff.as<int32_t>(), .entries = entries, .experts = experts,
                                     .in = in, .out = out, .y = dy.as<float>(), .quantized = weights.quantized},
                                    nullptr);
    else
      model::gpu::moe_experts_grouped({.x = dx.as<uint16_t>(), .w = weights.w.as<uint16_t>(),
                                       .offsets = doff.as<int32_t>(), .entries = entries, .experts = experts,
                                       .in = in, .out = out, .y = dy.as<float>(), .quantized = weights.quantized},
                                      nullptr);
    std::vector<float> y(static_cast<size_t>(entries * out));
    dy.download(y.data(), dy.bytes());
    return y;
  };
  const std::vector<float> y = run();
  const std::vector<float> again = run();
  EXPECT_EQ(std::memcmp(y.data(), again.data(), y.size() * sizeof(float)), 0) << "two runs differ";
  // f32 sums of `in` products in another order than the f64 sum: the small kernel's fmaf
  // chains stay well inside in * 2^-24 of the absolute sum (in <= 512: 2e-5); the tensor
  // cores' f32 accumulation may truncate rather than round, so the grouped kernel gets 1e-4
  // (in <= 544). A wrong weight row, input row, expert, code or scale block is off by O(1) of
  // the absolute sum (the quantized cases' block scales span 2^30). NVFP4's global scale adds
  // one f32 rounding of the sum (2^-24 relative), inside both bars.
  const double bar = kernel == Kernel::small ? 2e-5 : 1e-4;
  // The bf16 cases' absolute slack of 1e-6 stays; the quantized cases get none (their smallest
  // blocks, 2^-29, would hide under it): an all-zero row must give exactly 0.
  const double slack = format == ExpertWeights::bf16 ? 1e-6 : 0.0;
  int64_t bad = 0;
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t n = offsets[e]; n < offsets[e + 1]; ++n)
      for (int64_t j = 0; j < out; ++j) {
        double want = 0, magnitude = 0;
        for (int64_t i = 0; i < in; ++i) {
          const double term = double{bf16_to_float(w[(e * out + j) * in + i])} * bf16_to_float(x[n * in + i]);
          want += term;
          magnitude += std::fabs(term);
        }
        const double factor = weights.row_factor[e * out + j];
        want *= factor;
        magnitude *= factor;
        const double got = y[n * out + j];
        if (!(std::fabs(got - want) <= bar * magnitude + slack)) {
          if (++bad <= 5)
            ADD_FAILURE() << "row " << n << " (expert " << e << "), output " << j << ": got " << got << ", want "
                          << want;
        }
      }
  EXPECT_EQ(bad, 0);
}

TEST(CudaMoeExpertsSmall, MatchesF64DotProducts) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  check_case(Kernel::small, {0, 0, 1, 0}, 64, 32, "one row");
  check_case(Kernel::small, {1, 1, 1, 1}, 256, 96, "one row per expert, out ends a tile");
  check_case(Kernel::small, {0, 20, 0}, 128, 40, "every row in one expert: 3 passes of <= 8 rows");
  check_case(Kernel::small, {3, 0, 0, 5, 8, 9, 0, 1}, 72, 33, "mixed, empty experts between");
  check_case(Kernel::small, random_rows(model::gpu::kMaxSmallMoeEntries, 32), 512, 200, "the largest step it takes, random experts");
  // Wide rows: each lane's chunks wrap the cp.async ring several times; 4640 gives the lanes
  // 18 or 19 chunks.
  check_case(Kernel::small, {1, 0, 2, 1}, 4640, 40, "wide rows, unequal chunks per lane");
}

// The quantized formats: in a multiple of the scale block (32 MXFP8, 16 NVFP4), a lane's
// chunk 16 weights; in = 48 / 96 gives fewer chunks than a warp's lanes, 272 an odd number of
// NVFP4 blocks.
TEST(CudaMoeExpertsSmall, QuantizedWeightsMatchF64DotProductsOfTheDequantizedWeights) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  for (const ExpertWeights format : {ExpertWeights::mxfp8, ExpertWeights::nvfp4}) {
    const bool nvfp4 = format == ExpertWeights::nvfp4;
    check_case(Kernel::small, {0, 0, 1, 0}, 64, 32, "one row", format);
    check_case(Kernel::small, {1, 1, 1, 1}, nvfp4 ? 272 : 288, 96, "one row per expert, out ends a tile", format);
    check_case(Kernel::small, {0, 20, 0}, 128, 40, "every row in one expert: 3 passes of <= 8 rows", format);
    check_case(Kernel::small, {3, 0, 0, 5, 8, 9, 0, 1}, nvfp4 ? 48 : 96, 33, "mixed, empty experts between", format);
    check_case(Kernel::small, random_rows(model::gpu::kMaxSmallMoeEntries, 32), 512, 200, "the largest step it takes, random experts", format);
    // Wide rows (the ring wraps; 4640 gives the lanes 9 or 10 chunks) whose block-scale rows
    // (145 MXFP8 / 290 NVFP4 bytes) start off 4-byte boundaries.
    check_case(Kernel::small, {1, 0, 2, 1}, 4640, 40, "wide rows, scale rows off word boundaries", format);
  }
}

TEST(CudaMoeExpertsSmall, RefusesShapesItDoesNotTake) {
  EXPECT_FALSE(model::gpu::moe_experts_small_fits(0, 64, 64));
  EXPECT_FALSE(model::gpu::moe_experts_small_fits(model::gpu::kMaxSmallMoeEntries + 1, 64, 64));
  EXPECT_FALSE(model::gpu::moe_experts_small_fits(4, 60, 64));  // in not a multiple of 8
  EXPECT_TRUE(model::gpu::moe_experts_small_fits(4, 6144, 6144));
  try {
    model::gpu::moe_experts_small({.entries = 4, .in = 60, .out = 8}, nullptr);
    ADD_FAILURE() << "expected msa::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("multiple of 8"), std::string::npos) << e.what();
  }
}

// Tiles of 32 rows x 128 outputs x 64 k, MMAs of 16 rows: rows per expert on both sides of
// 16, 32 and 64, dims on both sides of 64 and 128 (in a multiple of 8: its 16-byte chunks).
TEST(CudaMoeExpertsGrouped, MatchesF64DotProducts) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  check_case(Kernel::grouped, {0, 0, 1, 0}, 64, 32, "one row");
  check_case(Kernel::grouped, {1, 1, 1, 1}, 8, 1, "one row per expert, in 8 (one chunk), one output");
  check_case(Kernel::grouped, {0, 300, 0}, 136, 200, "every row in one expert; in, out end inside a tile");
  check_case(Kernel::grouped, {1, 0, 15, 16, 0, 0, 17, 31, 32, 33, 0, 63, 64, 65, 300, 0}, 520, 130,
             "1..300 rows per expert around the tile edges, empty experts between");
  check_case(Kernel::grouped, {64, 64}, 128, 256, "dims multiples of the tiles");
  check_case(Kernel::grouped, random_rows(1024, 128), 256, 384, "1024 rows over 128 experts, random routing");
}

// As the bf16 cases, with in a multiple of the scale block: one block (in = 32 / 16), in
// ending inside the 64-weight k-step (160, 544), an odd and an even number of k-steps (the
// kernel loads the scales two k-steps ahead).
TEST(CudaMoeExpertsGrouped, QuantizedWeightsMatchF64DotProductsOfTheDequantizedWeights) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  for (const ExpertWeights format : {ExpertWeights::mxfp8, ExpertWeights::nvfp4}) {
    const int64_t block = format == ExpertWeights::mxfp8 ? 32 : 16;
    check_case(Kernel::grouped, {0, 0, 1, 0}, 64, 32, "one row", format);
    check_case(Kernel::grouped, {1, 1, 1, 1}, block, 1, "one row per expert, in one scale block, one output", format);
    check_case(Kernel::grouped, {0, 300, 0}, 160, 200, "every row in one expert; in, out end inside a tile", format);
    check_case(Kernel::grouped, {1, 0, 15, 16, 0, 0, 17, 31, 32, 33, 0, 63, 64, 65, 300, 0}, 544, 130,
               "1..300 rows per expert around the tile edges, empty experts between", format);
    check_case(Kernel::grouped, {64, 64}, 128, 256, "dims multiples of the tiles", format);
    check_case(Kernel::grouped, random_rows(1024, 128), 256, 384, "1024 rows over 128 experts, random routing", format);
  }
}

// The launchers' refusals of quantized weights (before any device work, so fake addresses).
TEST(CudaMoeExperts, RefuseQuantizedWeightsThatDoNotFit) {
  using model::gpu::QuantizedExpertWeights;
  EXPECT_FALSE(model::gpu::moe_experts_small_fits(4, 48, 64, ExpertWeights::mxfp8));  // in % 32
  EXPECT_TRUE(model::gpu::moe_experts_small_fits(4, 48, 64, ExpertWeights::nvfp4));
  EXPECT_FALSE(model::gpu::moe_experts_small_fits(4, 40, 64, ExpertWeights::nvfp4));  // in % 16
  EXPECT_FALSE(model::gpu::moe_experts_grouped_fits(48, 64, ExpertWeights::mxfp8));
  EXPECT_TRUE(model::gpu::moe_experts_grouped_fits(6144, 6144, ExpertWeights::nvfp4));
  EXPECT_EQ(model::gpu::expert_weights_in_multiple(ExpertWeights::mxfp8), 32);
  const auto* codes = reinterpret_cast<const uint8_t*>(uintptr_t{0x10000});
  const auto* scales = reinterpret_cast<const uint8_t*>(uintptr_t{0x20000});
  const auto* global = reinterpret_cast<const float*>(uintptr_t{0x30000});
  const auto* bf16 = reinterpret_cast<const uint16_t*>(uintptr_t{0x40000});
  const QuantizedExpertWeights mxfp8{.format = ExpertWeights::mxfp8, .codes = codes, .scales = scales};
  const QuantizedExpertWeights nvfp4{.format = ExpertWeights::nvfp4, .codes = codes, .scales = scales,
                                     .global_scale = global};
  struct Refusal {
    int64_t in;
    const uint16_t* w;
    QuantizedExpertWeights quantized;
    std::string want;  // in the message
  };
  const std::vector<Refusal> refusals = {
      {48, nullptr, mxfp8, "multiple of 32"},
      {40, nullptr, nvfp4, "multiple of 16"},
      {64, bf16, mxfp8, "'w'"},
      {64, nullptr, {.format = ExpertWeights::mxfp8, .scales = scales}, "'quantized.codes'"},
      {64, nullptr, {.format = ExpertWeights::mxfp8, .codes = codes + 8, .scales = scales}, "16-byte aligned"},
      {64, nullptr, {.format = ExpertWeights::nvfp4, .codes = codes + 4, .scales = scales, .global_scale = global},
       "8-byte aligned"},
      {64, nullptr, {.format = ExpertWeights::mxfp8, .codes = codes}, "'quantized.scales'"},
      {64, nullptr, {.format = ExpertWeights::mxfp8, .codes = codes, .scales = scales, .global_scale = global},
       "'quantized.global_scale'"},
      {64, nullptr, {.format = ExpertWeights::nvfp4, .codes = codes, .scales = scales}, "'quantized.global_scale'"},
      {64, bf16, {.format = ExpertWeights::bf16, .codes = codes}, "'quantized'"},
      {64, nullptr, {.format = static_cast<ExpertWeights>(7), .codes = codes}, "'quantized.format'"},
  };
  for (const Refusal& r : refusals) {
    SCOPED_TRACE(r.want);
    const std::string small = testing::error_of([&] {
      model::gpu::moe_experts_small({.w = r.w, .entries = 4, .experts = 2, .in = r.in, .out = 8, .quantized = r.quantized},
                                    nullptr);
    });
    EXPECT_NE(small.find(r.want), std::string::npos) << small;
    const std::string grouped = testing::error_of([&] {
      model::gpu::moe_experts_grouped(
          {.w = r.w, .entries = 4, .experts = 2, .in = r.in, .out = 8, .quantized = r.quantized}, nullptr);
    });
    EXPECT_NE(grouped.find(r.want), std::string::npos) << grouped;
  }
}

TEST(CudaMoeExpertsGrouped, RefusesShapesItDoesNotTake) {
  EXPECT_TRUE(model::gpu::moe_experts_grouped_fits(6144, 6144));
  EXPECT_FALSE(model::gpu::moe_experts_grouped_fits(60, 64));  // in not a multiple of 8
  EXPECT_FALSE(model::gpu::moe_experts_grouped_fits(0, 64));
  EXPECT_FALSE(model::gpu::moe_experts_grouped_fits(64, 0));
  // The capacity: ceil(N / 32) + min(E, N) bounds the (expert, row tile) items of any routing.
  EXPECT_EQ(model::gpu::moe_grouped_work_items(1, 128), 2);
  EXPECT_EQ(model::gpu::moe_grouped_work_items(4096, 128), 128 + 128);
  EXPECT_EQ(model::gpu::moe_grouped_work_items(33, 2), 2 + 2);
  auto refusal = [](const model::gpu::MoeGroupedGemm& job) {
    try {
      model::gpu::moe_experts_grouped(job, nullptr);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(refusal({.entries = 4, .experts = 2, .in = 60, .out = 8}).find("'in'"), std::string::npos);
  EXPECT_NE(refusal({.entries = 4, .experts = 2, .in = 64, .out = 0}).find("'out'"), std::string::npos);
  EXPECT_NE(refusal({.entries = 4, .experts = 0, .in = 64, .out = 8}).find("'experts'"), std::string::npos);
  EXPECT_NE(refusal({.entries = -1, .experts = 2, .in = 64, .out = 8}).find("'entries'"), std::string::npos);
}

// ---- the model ----

// 8 experts, top 2 (as test_cuda_model's small64): 40 tokens or requests make 80 entries,
// beyond the small kernel's 64.
ModelConfig moe_model_config() {
  return testing::three_layer_model({.vocab_size = 512, .hidden_size = 256, .num_heads = 8, .num_kv_heads = 2,
                                     .head_dim = 64, .rotary_dim = 32, .dense_intermediate_size = 384,
                                     .moe_intermediate_size = 128, .shared_intermediate_size = 128,
                                     .num_experts = 8, .experts_per_token = 2, .index_heads = 2,
                                     .index_head_dim = 64, .block_size = 64, .topk_blocks = 4});
}

// Never destroyed (device memory and cuBLASLt must not be torn down from static destructors).
const Model& moe_host_model() {
  static const Model& model = *[] {
    const std::string dir = testing::fresh_dir("moe_kernels").string();
    write_random_checkpoint(moe_model_config(), dir, {.seed = 23, .dtype = DType::bf16});
    write_random_tokenizer(moe_model_config(), dir);
    return new Model(Model::load(dir, Device::cpu));
  }();
  return model;
}

// A fresh CUDA model of the made checkpoint, kept for the process (as moe_host_model).
CudaModel& cuda_model_with(MoeKernel kernel) {
  auto* owner = new std::shared_ptr<CudaModel>(
      model::gpu::make_cuda_model(moe_host_model().config(), moe_host_model().weights()));
  (*owner)->set_moe_kernel(kernel);
  return **owner;
}

bool all_finite(const Tensor& t) {
  for (float v : t.span<float>())
    if (!std::isfinite(v)) return false;
  return true;
}

// Per row within the CPU-vs-CUDA bar of test_cuda_model (2e-2, relative L2): the two kernels
// differ only in f32 summation order, so a row misses only where a near-tied expert choice
// of a later layer flips; at most one such row.
void expect_rows_close(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  EXPECT_TRUE(all_finite(got)) << what;
  int64_t misses = 0;
  for (int64_t r = 0; r < got.size(0); ++r) {
    const double error = testing::relative_error(got.slice0(r, r + 1).clone(), want.slice0(r, r + 1).clone());
    if (!(error < 2e-2)) {
      ++misses;
      std::printf("%s, row %lld: relative error %.3g\n", what.c_str(), static_cast<long long>(r), error);
    }
  }
  EXPECT_LE(misses, 1) << what;
}

TEST(CudaMoeKernels, AutomaticRuleAndForcedKernels) {
  MSA_REQUIRE_CUDA();
  CudaModel& model = cuda_model_with(MoeKernel::automatic);
  const model::gpu::MoeKernelRule rule;
  EXPECT_EQ(model.moe_kernel_for(4), MoeKernel::small);
  EXPECT_EQ(model.moe_kernel_for(rule.max_small_entries), MoeKernel::small);
  EXPECT_EQ(model.moe_kernel_for(rule.max_small_entries + 1), MoeKernel::grouped);
  EXPECT_EQ(model.moe_kernel_for(rule.max_grouped_entries), MoeKernel::grouped);
  EXPECT_EQ(model.moe_kernel_for(rule.max_grouped_entries + 1), MoeKernel::per_expert);
  model.set_moe_kernel(MoeKernel::automatic, {.max_small_entries = 0, .max_grouped_entries = 0});
  EXPECT_EQ(model.moe_kernel_for(4), MoeKernel::per_expert);
  model.set_moe_kernel(MoeKernel::grouped);
  EXPECT_EQ(model.moe_kernel_for(1), MoeKernel::grouped);
  EXPECT_EQ(model.moe_kernel_for(100000), MoeKernel::grouped);
  model.set_moe_kernel(MoeKernel::small);
  EXPECT_EQ(model.moe_kernel_for(64), MoeKernel::small);
  const std::string error = testing::error_of([&] { model.moe_kernel_for(65); });
  EXPECT_NE(error.find("MoE kernel small"), std::string::npos) << error;
  EXPECT_NE(testing::error_of([&] { model.set_moe_kernel(MoeKernel::automatic, {.max_small_entries = 65}); })
                .find("max_small_entries"),
            std::string::npos);
  EXPECT_EQ(model::gpu::parse_moe_kernel("per-expert", "--moe-kernel"), MoeKernel::per_expert);
  EXPECT_NE(testing::error_of([] { model::gpu::parse_moe_kernel("fast", "--moe-kernel"); }).find("--moe-kernel"),
            std::string::npos);
}

// A 48-token prefill (96 entries) and decode steps of 40 requests (80 entries; the graph's
// bucket of 64 slots runs 128) with the grouped kernel against the per-expert GEMMs; the
// grouped model's decode steps run as a captured graph, the per-expert model's eagerly.
TEST(CudaMoeKernels, GroupedMatchesPerExpertAndIsCapturedInDecodeGraphs) {
  MSA_REQUIRE_CUDA();
  const ModelConfig& c = moe_host_model().config();
  CudaModel& grouped = cuda_model_with(MoeKernel::grouped);
  CudaModel& per_expert = cuda_model_with(MoeKernel::per_expert);
  ASSERT_TRUE(grouped.decode_graphs());
  const int64_t prompt = 48, requests = 40, steps = 3;
  const int64_t pages = requests * ((prompt + steps + c.block_size - 1) / c.block_size) + 8;
  KvCache grouped_cache(c, pages, DType::bf16, Device::cuda), per_expert_cache(c, pages, DType::bf16, Device::cuda);
  std::vector<SequenceCache> grouped_seq(requests), per_expert_seq(requests);
  std::vector<std::vector<int32_t>> streams;
  for (int64_t r = 0; r < requests; ++r)
    streams.push_back(testing::some_tokens(prompt + steps, c.vocab_size, static_cast<int32_t>(r + 3)));

  for (int64_t r = 0; r < requests; ++r) {
    const std::span<const int32_t> tokens(streams[r].data(), static_cast<size_t>(prompt));
    const ForwardRequest a{.sequence = &grouped_seq[r], .tokens = tokens, .all_logits = true};
    const ForwardRequest b{.sequence = &per_expert_seq[r], .tokens = tokens, .all_logits = true};
    const Tensor got = grouped.forward({&a, 1}, grouped_cache);
    const Tensor want = per_expert.forward({&b, 1}, per_expert_cache);
    if (r == 0) expect_rows_close(got, want, "prefill of 48 tokens (96 entries)");
  }
  EXPECT_EQ(grouped.captured_decode_graphs(), 0) << "prefill steps run eagerly";
  for (int64_t step = 0; step < steps; ++step) {
    std::vector<ForwardRequest> a, b;
    for (int64_t r = 0; r < requests; ++r) {
      const std::span<const int32_t> token(streams[r].data() + prompt + step, 1);
      a.push_back({.sequence = &grouped_seq[r], .tokens = token});
      b.push_back({.sequence = &per_expert_seq[r], .tokens = token});
    }
    const Tensor got = grouped.forward(a, grouped_cache);
    const Tensor want = per_expert.forward(b, per_expert_cache);
    expect_rows_close(got, want, "decode step " + std::to_string(step) + " of 40 requests");
  }
  EXPECT_EQ(grouped.captured_decode_graphs(), 1) << "the 40-request bucket (80 entries) runs as a graph";
  EXPECT_EQ(per_expert.captured_decode_graphs(), 0) << "per-expert GEMMs need the host's offsets";
  EXPECT_GT(grouped.moe_kernel_calls().grouped, 0);
  EXPECT_EQ(grouped.moe_kernel_calls().per_expert + grouped.moe_kernel_calls().small, 0);
  EXPECT_EQ(per_expert.moe_kernel_calls().grouped + per_expert.moe_kernel_calls().small, 0);
}

}  // namespace
}  // namespace msa
