// The decode-sized routed-expert GEMMs (src/model/gpu/moe_experts_small.cu) against f64 dot
// products of the same bf16 values, over row distributions with the edges: one row, one row per
// expert, every row in one expert (more rows than one pass holds), empty experts between
// used ones, the largest step it takes, and output widths that end inside a CTA's tile.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "cuda/common/device_buffer.h"
#include "model/gpu/kernels.h"
#include "msa/dtype.h"
#include "op_cases.h"
#include "test_util.h"

namespace msa {
namespace {

using cuda::DeviceBuffer;
using testing::rng;

#define MSA_REQUIRE_CUDA() \
  if (!impl_available(Impl::cuda)) GTEST_SKIP() << "no CUDA device"

std::vector<uint16_t> random_bf16(int64_t count) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<uint16_t> out(static_cast<size_t>(count));
  for (uint16_t& v : out) v = float_to_bf16(dist(rng()));
  return out;
}

// rows_per_expert[e] rows for expert e; checks y against the f64 product of every row.
void check_case(const std::vector<int32_t>& rows_per_expert, int64_t in, int64_t out, const std::string& what) {
  SCOPED_TRACE(what);
  const int64_t experts = static_cast<int64_t>(rows_per_expert.size());
  std::vector<int32_t> offsets(rows_per_expert.size() + 1, 0);
  std::partial_sum(rows_per_expert.begin(), rows_per_expert.end(), offsets.begin() + 1);
  const int64_t entries = offsets.back();
  ASSERT_TRUE(model::gpu::moe_experts_small_fits(entries, in, out));
  const std::vector<uint16_t> x = random_bf16(entries * in), w = random_bf16(experts * out * in);
  DeviceBuffer dx = DeviceBuffer::from(x), dw = DeviceBuffer::from(w), doff = DeviceBuffer::from(offsets);
  DeviceBuffer dy(static_cast<size_t>(entries * out) * sizeof(float));
  dy.fill_bytes(0xff);  // poison: NaN everywhere a row is not written
  model::gpu::moe_experts_small({.x = dx.as<uint16_t>(), .w = dw.as<uint16_t>(), .offsets = doff.as<int32_t>(),
                                 .entries = entries, .experts = experts, .in = in, .out = out,
                                 .y = dy.as<float>()},
                                nullptr);
  std::vector<float> y(static_cast<size_t>(entries * out));
  dy.download(y.data(), dy.bytes());
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
        const double got = y[n * out + j];
        // f32 sums of `in` (<= 512) products in another order: well inside in * 2^-24 of the
        // absolute sum; a wrong weight row or input row is off by O(1) of it.
        if (!(std::fabs(got - want) <= 2e-5 * magnitude + 1e-6)) {
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
  check_case({0, 0, 1, 0}, 64, 32, "one row");
  check_case({1, 1, 1, 1}, 256, 96, "one row per expert, out ends a tile");
  check_case({0, 20, 0}, 128, 40, "every row in one expert: 3 passes of <= 8 rows");
  check_case({3, 0, 0, 5, 8, 9, 0, 1}, 72, 33, "mixed, empty experts between");
  std::vector<int32_t> wide(32, 0);
  for (int64_t n = 0; n < model::gpu::kMaxSmallMoeEntries; ++n) ++wide[std::uniform_int_distribution<int>(0, 31)(rng())];
  check_case(wide, 512, 200, "the largest step it takes, random experts");
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

}  // namespace
}  // namespace msa
