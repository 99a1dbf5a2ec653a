// Quantized index keys on the CPU (msa/quantized_index_keys.h): the e2m1 grid, the fp8 and
// fp4 quantization rules (scale choice, round to nearest even checked against a brute-force
// nearest-grid search, nibble order), dequantization, paged_indexer on fp8 / fp4 caches
// against the same op on the dequantized keys, and argument errors.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <iostream>
#include <limits>

#include "quantized_cases.h"

namespace msa::testing {
namespace {

constexpr double kTieTolerance = 1e-4;  // f32 vs f64 block maxima (as test_ops_forward.cpp)
constexpr double kMaxDifferingRowFraction = 0.01;
constexpr double kLseTolerance = 1e-5, kLseAbsTolerance = 1e-4;

std::vector<double> e4m3_grid() {  // magnitudes of the codes 0x00 .. 0x7e
  std::vector<double> grid;
  for (int code = 0; code <= 0x7e; ++code) grid.push_back(e4m3_to_float(static_cast<uint8_t>(code)));
  return grid;
}
std::vector<double> e2m1_grid() {
  std::vector<double> grid;
  for (int code = 0; code < 8; ++code) grid.push_back(e2m1_to_float(static_cast<uint8_t>(code)));
  return grid;
}

// Rows [rows, dim] of normal values at magnitudes 2^-12 .. 2^8, plus an all-zero row, a row
// with one non-zero value and a row of tiny values.
Tensor varied_keys(int64_t rows, int64_t dim) {
  Tensor keys = random_normal({rows, dim});
  float* x = keys.data<float>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t d = 0; d < dim; ++d) x[r * dim + d] *= std::ldexp(1.0f, static_cast<int>(r % 21) - 12);
  for (int64_t d = 0; d < dim; ++d) {
    x[0 * dim + d] = 0.0f;
    x[1 * dim + d] = d == 3 ? -2.5f : 0.0f;
    x[2 * dim + d] *= 1e-30f;
  }
  return keys;
}

uint8_t code_at(const Tensor& t, int64_t i) { return static_cast<const uint8_t*>(t.raw())[i]; }

// The codes and scales of `q` have these shapes and dtypes, and read back as `format`.
void expect_layout(const QuantizedIndexKeys& q, const Shape& codes_shape, DType codes_dtype,
                   const Shape& scale_shape, DType scale_dtype, IndexKeyFormat format) {
  ASSERT_EQ(q.codes.shape(), codes_shape);
  ASSERT_EQ(q.codes.dtype(), codes_dtype);
  ASSERT_EQ(q.scale.shape(), scale_shape);
  ASSERT_EQ(q.scale.dtype(), scale_dtype);
  EXPECT_EQ(index_key_format_of(q.codes, q.scale), format);
}

TEST(E2m1, CodesRoundTripAndTiesGoToTheEvenCode) {
  for (int code = 0; code < 16; ++code)
    EXPECT_EQ(float_to_e2m1(e2m1_to_float(static_cast<uint8_t>(code))), code) << code;
  EXPECT_EQ(e2m1_to_float(0x7), 6.0f);
  EXPECT_EQ(e2m1_to_float(0xf), -6.0f);
  EXPECT_EQ(e2m1_to_float(0x1), 0.5f);
  // Ties: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4.
  const std::pair<float, int> ties[] = {{0.25f, 0}, {0.75f, 2}, {1.25f, 2}, {1.75f, 4},
                                        {2.5f, 4},  {3.5f, 6},  {5.0f, 6}};
  for (const auto& [value, code] : ties) {
    EXPECT_EQ(float_to_e2m1(value), code) << value;
    EXPECT_EQ(float_to_e2m1(-value), code | 0x8) << -value;
  }
  EXPECT_EQ(float_to_e2m1(0.26f), 1);
  EXPECT_EQ(float_to_e2m1(1.3f), 3);
  EXPECT_EQ(float_to_e2m1(5.01f), 7);
  EXPECT_EQ(float_to_e2m1(1e9f), 7);       // saturating
  EXPECT_EQ(float_to_e2m1(-0.1f), 0x8);    // -0 keeps its sign
  const std::vector<double> grid = e2m1_grid();
  for (float v = 0.0f; v < 8.0f; v += 1.0f / 64)
    EXPECT_EQ(float_to_e2m1(v), nearest_even(grid, v)) << v;
}

TEST(QuantizeFp8, ScaleIsAmaxOver448AndCodesRoundToNearestEven) {
  MSA_RESEED_AND_TRACE();
  const int64_t rows = 50, dim = 40;
  const Tensor keys = varied_keys(rows, dim);
  const QuantizedIndexKeys q = quantize_index_keys_fp8(keys);
  ASSERT_NO_FATAL_FAILURE(
      expect_layout(q, {rows, dim}, DType::e4m3, {rows}, DType::f32, IndexKeyFormat::fp8));
  const std::vector<double> grid = e4m3_grid();
  const float* x = keys.data<float>();
  const Tensor deq64 = dequantize_index_keys(q.codes, q.scale, DType::f64);
  const Tensor deq32 = dequantize_index_keys(q.codes, q.scale);
  for (int64_t r = 0; r < rows; ++r) {
    SCOPED_TRACE("row " + std::to_string(r));
    float amax = 0;
    for (int64_t d = 0; d < dim; ++d) amax = std::max(amax, std::fabs(x[r * dim + d]));
    const float scale = q.scale.data<float>()[r];
    ASSERT_EQ(scale, amax / 448.0f);
    int largest = 0;
    for (int64_t d = 0; d < dim; ++d) {
      const uint8_t code = code_at(q.codes, r * dim + d);
      if (scale == 0) {
        ASSERT_EQ(code, 0);
        continue;
      }
      const float v = x[r * dim + d] / scale;
      ASSERT_EQ(code & 0x7f, nearest_even(grid, v)) << "element " << d << " = " << v;
      ASSERT_EQ(code >> 7, std::signbit(v) ? 1 : 0);
      largest = std::max(largest, code & 0x7f);
      ASSERT_EQ(deq64.data<double>()[r * dim + d], double{e4m3_to_float(code)} * double{scale});
      ASSERT_EQ(deq32.data<float>()[r * dim + d],
                static_cast<float>(double{e4m3_to_float(code)} * double{scale}));
    }
    if (amax > 0) EXPECT_EQ(largest, 0x7e) << "the largest key maps to 448";
  }
}

TEST(QuantizeFp4, ScaleIsTheSmallestE4m3AtLeastAmaxOver6AndCodesRoundToNearestEven) {
  MSA_RESEED_AND_TRACE();
  const int64_t rows = 50, dim = 64, groups = dim / 16;
  Tensor keys = varied_keys(rows, dim);
  keys.data<float>()[5 * dim + 17] = 20000.0f;  // amax / 6 > 448: the scale saturates
  const QuantizedIndexKeys q = quantize_index_keys_fp4(keys);
  ASSERT_NO_FATAL_FAILURE(
      expect_layout(q, {rows, dim / 2}, DType::u8, {rows, groups}, DType::e4m3, IndexKeyFormat::fp4));
  const std::vector<double> grid = e2m1_grid();
  const float* x = keys.data<float>();
  const Tensor deq64 = dequantize_index_keys(q.codes, q.scale, DType::f64);
  const Tensor deq32 = dequantize_index_keys(q.codes, q.scale);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      SCOPED_TRACE("row " + std::to_string(r) + " group " + std::to_string(g));
      float amax = 0;
      for (int64_t i = 0; i < 16; ++i) amax = std::max(amax, std::fabs(x[r * dim + g * 16 + i]));
      const uint8_t scale_code = code_at(q.scale, r * groups + g);
      const float wanted = amax / 6.0f, scale = e4m3_to_float(scale_code);
      if (wanted == 0) {
        ASSERT_EQ(scale_code, 0);
      } else if (wanted > 448.0f) {
        ASSERT_EQ(scale_code, 0x7e);
      } else {
        ASSERT_LT(scale_code, 0x80) << "positive";
        ASSERT_GE(scale, wanted);
        if (scale_code > 1) ASSERT_LT(e4m3_to_float(scale_code - 1), wanted) << "smallest";
      }
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t d = g * 16 + i;
        const uint8_t byte = code_at(q.codes, r * (dim / 2) + d / 2);
        const uint8_t code = d % 2 ? byte >> 4 : byte & 0xf;  // low nibble = even channel
        double value = 0;
        if (scale_code != 0) {
          const float v = x[r * dim + d] / scale;
          if (wanted <= 448.0f) ASSERT_LE(std::fabs(v), 6.0f) << "no code saturates";
          ASSERT_EQ(code & 0x7, nearest_even(grid, v)) << "channel " << d << " = " << v;
          ASSERT_EQ(code >> 3, std::signbit(v) ? 1 : 0);
          value = double{e2m1_to_float(code)} * double{scale};
        } else {
          ASSERT_EQ(code, 0);
        }
        ASSERT_EQ(deq64.data<double>()[r * dim + d], value);
        ASSERT_EQ(deq32.data<float>()[r * dim + d], static_cast<float>(value)) << "exact in f32";
      }
    }
}

TEST(QuantizeFp4, NibbleOrderIsLowNibbleFirst) {
  // One group: channel values 0.5, -1, 6, 0, ... with amax 6 -> scale 1 (e4m3 0x38).
  std::vector<float> values(16, 0.0f);
  values[0] = 0.5f;
  values[1] = -1.0f;
  values[2] = 6.0f;
  values[15] = -3.0f;
  const QuantizedIndexKeys q = quantize_index_keys_fp4(Tensor::from_vector(values, {16}));
  ASSERT_EQ(q.scale.shape(), (Shape{1}));
  EXPECT_EQ(code_at(q.scale, 0), 0x38);                       // 1.0
  EXPECT_EQ(code_at(q.codes, 0), 0x1 | (0xa << 4));           // 0.5 low, -1 high
  EXPECT_EQ(code_at(q.codes, 1), 0x7);                        // 6 low, +0 high
  EXPECT_EQ(code_at(q.codes, 7), 0x0 | (0xd << 4));           // +0 low, -3 high
}

TEST(QuantizeIndexKeys, AcceptsAnyFloatDtypeAndLeadingShape) {
  MSA_RESEED_AND_TRACE();
  const Tensor keys = random_normal({3, 4, 32});
  for (IndexKeyFormat format : {IndexKeyFormat::fp8, IndexKeyFormat::fp4}) {
    SCOPED_TRACE(format_name(format));
    const QuantizedIndexKeys f32 = quantize_index_keys(keys, format);
    const QuantizedIndexKeys bf16 = quantize_index_keys(keys.to(DType::bf16).to(DType::f32), format);
    const QuantizedIndexKeys from_bf16 = quantize_index_keys(keys.to(DType::bf16), format);
    EXPECT_TRUE(bitwise_equal(bf16.codes, from_bf16.codes));
    EXPECT_TRUE(bitwise_equal(bf16.scale, from_bf16.scale));
    EXPECT_EQ(f32.codes.dim(), 3);
    EXPECT_EQ(dequantize_index_keys(f32.codes, f32.scale).shape(), keys.shape());
    // Dequantized keys are close: relative error per element <= 2^-4 (fp8) of the row /
    // group scale's grid step.
    const Tensor deq = dequantize_index_keys(f32.codes, f32.scale);
    EXPECT_LT(relative_error(deq, keys), format == IndexKeyFormat::fp8 ? 0.05 : 0.2);
  }
}

TEST(QuantizeIndexKeys, RejectsBadKeys) {
  Tensor keys = random_normal({4, 32});
  keys.set(37, std::numeric_limits<double>::quiet_NaN());
  expect_error([&] { quantize_index_keys_fp8(keys); }, "finite");
  expect_error([&] { quantize_index_keys_fp4(keys); }, "finite");
  expect_error([&] { quantize_index_keys_fp4(random_normal({4, 24})); }, "multiple of 16");
  expect_error([&] { quantize_index_keys_fp8(Tensor::zeros({4, 8}, DType::i32)); }, "argument 'keys'");
  expect_error([&] { quantize_index_keys(random_normal({4, 16}), IndexKeyFormat::plain); },
               "argument 'format'");
  const QuantizedIndexKeys q = quantize_index_keys_fp4(random_normal({4, 32}));
  expect_error([&] { dequantize_index_keys(q.codes, Tensor::zeros({4, 3}, DType::e4m3)); },
               "argument 'index_key_scale'");
  expect_error([&] { dequantize_index_keys(q.codes, Tensor::zeros({4, 2}, DType::f32)); },
               "argument 'index_key_scale'");
  expect_error([&] { dequantize_index_keys(q.codes, Tensor()); }, "argument 'index_key_scale'");
  expect_error([&] { dequantize_index_keys(Tensor::zeros({4, 16}, DType::f32), q.scale); },
               "argument 'index_key_cache'");
}

// ---- paged_indexer on fp8 / fp4 caches ----

struct QuantizedCase {
  CaseShape shape;
  IndexKeyFormat format;
  bool decode = false;  // Q = 1..16 requests instead of edge lengths
};

void PrintTo(const QuantizedCase& qc, std::ostream* out) {
  *out << format_name(qc.format) << "_" << qc.shape.describe() << (qc.decode ? "_decode" : "");
}

std::vector<QuantizedCase> quantized_cases() {
  std::vector<QuantizedCase> cases;
  // make_shape(Hkv, G, D, Di, B, topk, local, init); Di a multiple of 16 (fp4 groups).
  const CaseShape shapes[] = {
      make_shape(1, 1, 16, 16, 4, 2, 1, 0),    make_shape(2, 2, 16, 32, 4, 4, 1, 1),
      make_shape(4, 4, 16, 64, 8, 4, 2, 0),    make_shape(1, 8, 16, 128, 8, 8, 2, 1),
      make_shape(4, 16, 16, 128, 64, 4, 1, 0),
  };
  for (IndexKeyFormat format : {IndexKeyFormat::fp8, IndexKeyFormat::fp4})
    for (const CaseShape& shape : shapes)
      for (bool decode : {false, true}) cases.push_back({shape, format, decode});
  return cases;
}

std::vector<Seq> case_sequences(const QuantizedCase& qc) {
  const int64_t B = qc.shape.params.block_size, kb = B * qc.shape.params.topk;
  if (!qc.decode) return mixed_sequences(edge_lengths(B, qc.shape.params.topk));
  std::vector<Seq> seqs = {{.q_len = 1, .k_len = kb + 3 * B + 1}, {.q_len = 16, .k_len = kb + 2 * B - 1},
                           {.q_len = 2, .k_len = 2},              {.q_len = 8, .k_len = 5 * kb + 17},
                           {.q_len = 16, .k_len = 16},            {.q_len = 3, .k_len = kb + B / 2 + 7},
                           {.q_len = 1, .k_len = B},              {.q_len = 1, .k_len = kb}};
  for (Seq& s : seqs) s.k_len = std::max(s.k_len, s.q_len);  // small B * k
  return seqs;
}

class QuantizedPagedIndexer : public ::testing::TestWithParam<QuantizedCase> {};

// Impl::cpu dequantizes block by block exactly as dequantize_index_keys does, so it equals
// the op on the dequantized f32 cache bit for bit; the reference equals the op on the f64
// dequantized cache bit for bit.
TEST_P(QuantizedPagedIndexer, EqualsTheOpOnTheDequantizedKeys) {
  MSA_RESEED_AND_TRACE();
  const QuantizedCase& param = GetParam();
  const QuantizedPagedCase qc =
      make_quantized_paged_case(make_varlen_case(param.shape, case_sequences(param)), param.format);
  const MsaParams& p = qc.c.params();
  const Tensor& cu = qc.paged.cu_seqlens_q;
  const IndexerOutput cpu = paged_indexer(qc.c.qi, qc.paged.cache, cu, p, Impl::cpu, true);
  const IndexerOutput cpu_plain = paged_indexer(qc.c.qi, qc.dequantized, cu, p, Impl::cpu, true);
  EXPECT_TRUE(bitwise_equal(cpu.topk, cpu_plain.topk));
  EXPECT_TRUE(bitwise_equal(cpu.lse, cpu_plain.lse));

  PagedKvCache exact = qc.dequantized;
  exact.index_key_cache = dequantize_index_keys(qc.paged.cache.index_key_cache,
                                                qc.paged.cache.index_key_scale, DType::f64);
  const IndexerOutput ref = paged_indexer(qc.c.qi, qc.paged.cache, cu, p, Impl::reference, true);
  const IndexerOutput ref_plain = paged_indexer(qc.c.qi, exact, cu, p, Impl::reference, true);
  EXPECT_TRUE(bitwise_equal(ref.topk, ref_plain.topk));
  EXPECT_TRUE(bitwise_equal(ref.lse, ref_plain.lse));
}

TEST_P(QuantizedPagedIndexer, CpuMatchesTheReference) {
  MSA_RESEED_AND_TRACE();
  const QuantizedCase& param = GetParam();
  const QuantizedPagedCase qc =
      make_quantized_paged_case(make_varlen_case(param.shape, case_sequences(param)), param.format);
  const DoubleInputs in(qc.c);
  const MsaParams& p = qc.c.params();
  const auto run = [&](Impl impl) {
    return paged_indexer(qc.c.qi, qc.paged.cache, qc.paged.cu_seqlens_q, p, impl, true);
  };
  const IndexerOutput got = run(Impl::cpu), want = run(Impl::reference);
  const double differing = expect_same_selection(got.topk, want.topk, qc.c, in, kTieTolerance);
  std::cout << "[ selection ] " << format_name(param.format) << " " << param.shape.describe()
            << ": " << differing * 100 << "% of rows differ from the reference\n";
  EXPECT_LE(differing, kMaxDifferingRowFraction);
  const Tensor expected = expected_lse_for_rows(qc.c, in, got.topk, want.topk, want.lse);
  expect_close(got.lse, expected, kLseTolerance, kLseAbsTolerance, "indexer lse");
}

std::string case_name(const ::testing::TestParamInfo<QuantizedCase>& info) {
  return format_name(info.param.format) + "_" + info.param.shape.describe() +
         (info.param.decode ? "_decode" : "");
}
INSTANTIATE_TEST_SUITE_P(Cases, QuantizedPagedIndexer, ::testing::ValuesIn(quantized_cases()),
                         case_name);

// ---- argument errors ----

class QuantizedCacheErrors : public ::testing::TestWithParam<Impl> {
 protected:
  // A valid fp8 or fp4 case: Di = 16, B = 2.
  QuantizedPagedCase make(IndexKeyFormat format) const {
    return make_quantized_paged_case(
        make_varlen_case(make_shape(2, 2, 8, 16, 2, 3, 1, 0),
                         {{.q_len = 3, .k_len = 6}, {.q_len = 5, .k_len = 9}, {.q_len = 2, .k_len = 2}}),
        format);
  }
  void expect_rejected(const QuantizedPagedCase& qc, const PagedKvCache& cache,
                       const std::string& argument) const {
    SCOPED_TRACE("bad argument " + argument);
    expect_error(
        [&] { paged_indexer(qc.c.qi, cache, qc.paged.cu_seqlens_q, qc.c.params(), GetParam()); },
        "argument '" + argument);
  }
};

TEST_P(QuantizedCacheErrors, ValidCachesPass) {
  if (GetParam() == Impl::cuda) GTEST_SKIP() << "Di 16 is below the CUDA indexer's 64";
  for (IndexKeyFormat format : {IndexKeyFormat::fp8, IndexKeyFormat::fp4}) {
    const QuantizedPagedCase qc = make(format);
    EXPECT_NO_THROW(paged_indexer(qc.c.qi, qc.paged.cache, qc.paged.cu_seqlens_q, qc.c.params(),
                                  GetParam()));
  }
}

TEST_P(QuantizedCacheErrors, BadScalesAndCodesAreRejected) {
  const QuantizedPagedCase fp8 = make(IndexKeyFormat::fp8), fp4 = make(IndexKeyFormat::fp4);
  const int64_t pages = fp8.paged.cache.index_key_cache.size(0), B = 2, Di = 16;
  PagedKvCache cache = fp8.paged.cache;
  cache.index_key_scale = Tensor();
  expect_rejected(fp8, cache, "index_key_scale");  // e4m3 keys without a scale
  cache = fp8.dequantized;
  cache.index_key_scale = fp8.paged.cache.index_key_scale;
  expect_rejected(fp8, cache, "index_key_scale");  // float keys with a scale
  cache = fp8.paged.cache;
  cache.index_key_scale = Tensor::zeros({pages, B}, DType::f64);
  expect_rejected(fp8, cache, "index_key_scale");  // dtype
  cache.index_key_scale = Tensor::zeros({pages, B, 1}, DType::f32);
  expect_rejected(fp8, cache, "index_key_scale");  // shape
  cache.index_key_scale = Tensor::zeros({pages + 1, B}, DType::f32);
  expect_rejected(fp8, cache, "index_key_scale");  // pages
  cache = fp8.paged.cache;
  cache.index_key_cache = Tensor::zeros({pages, B, Di + 1}, DType::e4m3);
  expect_rejected(fp8, cache, "index_key_cache");

  cache = fp4.paged.cache;
  cache.index_key_scale = Tensor::zeros({pages, B, Di / 16}, DType::f32);
  expect_rejected(fp4, cache, "index_key_scale");  // dtype
  cache.index_key_scale = Tensor::zeros({pages, B, Di / 16 + 1}, DType::e4m3);
  expect_rejected(fp4, cache, "index_key_scale");  // shape
  cache = fp4.paged.cache;
  cache.index_key_cache = Tensor::zeros({pages, B, Di}, DType::u8);  // Di, not Di / 2
  expect_rejected(fp4, cache, "index_key_cache");
  cache = fp4.paged.cache;
  cache.index_key_cache = Tensor::zeros({pages, B, Di / 2}, DType::i32);
  expect_rejected(fp4, cache, "index_key_cache");  // codes dtype with a scale

  // fp4 needs Di % 16 == 0.
  const VarlenCase c8 = make_varlen_case(make_shape(2, 2, 8, 8, 2, 3, 1, 0),
                                         {{.q_len = 3, .k_len = 6}, {.q_len = 2, .k_len = 2}});
  QuantizedPagedCase odd;
  odd.c = c8;
  odd.paged = page_varlen_case(c8);
  const int64_t pages8 = odd.paged.cache.index_key_cache.size(0);
  odd.paged.cache.index_key_cache = Tensor::zeros({pages8, B, 4}, DType::u8);
  odd.paged.cache.index_key_scale = Tensor::zeros({pages8, B, 1}, DType::e4m3);
  expect_rejected(odd, odd.paged.cache, "qi");
}

INSTANTIATE_TEST_SUITE_P(Impls, QuantizedCacheErrors,
                         ::testing::Values(Impl::reference, Impl::cpu, Impl::cuda),
                         impl_test_name);

}  // namespace
}  // namespace msa::testing
