#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "msa/dtype.h"
#include "msa/tensor.h"

namespace msa {
namespace {

TEST(DType, Bf16RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
  EXPECT_EQ(float_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties to even (1 + 2^-6).
  EXPECT_EQ(float_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(bf16_to_float(float_to_bf16(-std::numeric_limits<float>::infinity())),
            -std::numeric_limits<float>::infinity());
}

TEST(DType, F16RoundTripAndRounding) {
  for (float value : {0.0f, 1.0f, -2.5f, 65504.0f, 6.103515625e-05f, 5.960464477539063e-08f})
    EXPECT_EQ(f16_to_float(float_to_f16(value)), value) << value;
  EXPECT_EQ(float_to_f16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // tie to even
  EXPECT_EQ(float_to_f16(1e6f), 0x7c00);                            // overflow to inf
  EXPECT_EQ(float_to_f16(-1e6f), 0xfc00);
}

TEST(DType, E4m3SaturatesAndRounds) {
  EXPECT_EQ(float_to_e4m3(448.0f), 0x7e);
  EXPECT_EQ(float_to_e4m3(1000.0f), 0x7e);
  EXPECT_EQ(float_to_e4m3(-std::numeric_limits<float>::infinity()), 0xfe);
  EXPECT_EQ(e4m3_to_float(0x7e), 448.0f);
  EXPECT_TRUE(std::isnan(e4m3_to_float(float_to_e4m3(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(e4m3_to_float(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(e4m3_to_float(0x08), std::ldexp(1.0f, -6));  // smallest normal
  EXPECT_EQ(float_to_e4m3(1.0625f), 0x38);                // tie 1 / 1.125 -> even (1.0)
  EXPECT_EQ(float_to_e4m3(1.1875f), 0x3a);                // tie 1.125 / 1.25 -> even (1.25)
  // Every code round-trips.
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7f) == 0x7f) continue;
    EXPECT_EQ(float_to_e4m3(e4m3_to_float(static_cast<uint8_t>(code))), code) << code;
  }
}

TEST(Tensor, ConversionsAndErrors) {
  Tensor t = Tensor::full({2, 3}, DType::f32, 1.5);
  Tensor b = t.to(DType::bf16);
  EXPECT_EQ(b.get(5), 1.5);
  EXPECT_THROW(t.data<int32_t>(), Error);
  EXPECT_THROW(t.reshape({4, 2}), Error);
  EXPECT_EQ(t.slice0(1, 2).numel(), 3);
}

}  // namespace
}  // namespace msa
