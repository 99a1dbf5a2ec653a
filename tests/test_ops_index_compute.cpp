// MsaParams::index_compute on the CPU (Impl::reference in f64, Impl::cpu's kernels in f32):
// fp8 compute ranks blocks by the fp8-dequantized qi rows and keys
// (msa/quantized_index_keys.h), the LSE stays exact. Checked here:
// - inputs whose every qi row and key is exactly e4m3 with scale 1 (each row's amax is 448):
//   quantization is the identity, so fp8 rows and LSE equal the exact ones bit for bit;
// - normal random inputs: the rows differ somewhere (the opt-in changes something), and
//   fp8 compute equals exact compute run on the quantize-dequantized inputs;
// - a paged float cache and the same cache quantized to fp8 select the same rows;
// - fp4 caches and unknown names are clear errors.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "index_scan_cases.h"

namespace msa::testing {
namespace {

CaseShape fp8_shape() { return make_shape(2, 1, 16, 32, 16, 4, 1, 0); }

// Long enough that ranking decides (k = 4 of up to 20 blocks), several sequences.
std::vector<Seq> ranking_sequences() {
  return {{.q_len = 40, .k_len = 320}, {.q_len = 1, .k_len = 17}, {.q_len = 90, .k_len = 200},
          {.q_len = 64, .k_len = 64}};
}

// A random e4m3 value that is an integer of magnitude <= 60 (codes up to 0x67, exponent
// field <= 12): every product of two is an integer, and so is every partial sum of a dot
// product (below 2^24 for Di <= 128 even with the +-448 elements), so f32 (Impl::cpu) and
// f64 (Impl::reference) accumulate scores exactly and rank alike. With fractional codes the
// products span 2^-18..2^18 and f32 sums round: near-ties flipped (seed 9060374442458825912).
float random_e4m3_integer() {
  for (;;) {
    const float value = e4m3_to_float(static_cast<uint8_t>(uniform_int(0, 0x67)));
    if (value == std::floor(value)) return uniform_int(0, 1) ? -value : value;
  }
}

// Every row of `x` ([..., Di]) replaced by random e4m3 integers with one element +-448 (amax
// 448: the fp8 recipe's scale is exactly 1 and every code reproduces its value).
void make_e4m3_exact(Tensor& x) {
  const int64_t dim = x.size(x.dim() - 1), rows = x.numel() / dim;
  float* data = x.data<float>();
  for (int64_t r = 0; r < rows; ++r) {
    // Equal block maxima tie-break alike in both computes.
    for (int64_t d = 0; d < dim; ++d) data[r * dim + d] = random_e4m3_integer();
    data[r * dim + uniform_int(0, dim - 1)] = uniform_int(0, 1) ? 448.0f : -448.0f;
  }
}

class IndexComputeFp8 : public ::testing::TestWithParam<Impl> {};

TEST_P(IndexComputeFp8, ExactlyRepresentableInputsGiveTheExactResult) {
  MSA_RESEED_AND_TRACE();
  VarlenCase c = make_varlen_case(fp8_shape(), ranking_sequences());
  make_e4m3_exact(c.qi);
  make_e4m3_exact(c.ki);
  const IndexerOutput exact = indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k,
                                      with_compute(c.params(), IndexCompute::exact), Impl::reference);
  const IndexerOutput fp8 = indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k,
                                    with_compute(c.params(), IndexCompute::fp8), GetParam());
  EXPECT_TRUE(bitwise_equal(fp8.topk, exact.topk)) << "fp8 rows differ from exact rows";
  // The LSE scores the inputs as given over the same rows: exact compute's LSE of the same
  // implementation, bit for bit (|scores| reach ~1e4 here: f32 and f64 LSEs differ by ~1e-3).
  const IndexerOutput exact_here = indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k,
                                           with_compute(c.params(), IndexCompute::exact), GetParam());
  EXPECT_TRUE(bitwise_equal(fp8.lse, exact_here.lse)) << "fp8 lse differs from exact compute's";
}

TEST_P(IndexComputeFp8, RandomInputsRankByTheQuantizedValues) {
  MSA_RESEED_AND_TRACE();
  const VarlenCase c = make_varlen_case(fp8_shape(), ranking_sequences());
  const MsaParams fp8_params = with_compute(c.params(), IndexCompute::fp8);
  const IndexerOutput fp8 = indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, fp8_params, GetParam());
  const IndexerOutput exact = indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), Impl::reference);
  // Quantizing moves some selections (with 2-3 bits of mantissa, most long rows).
  EXPECT_FALSE(bitwise_equal(fp8.topk, exact.topk)) << "fp8 compute selected exactly the exact rows";
  // The rows are those of exact compute over the quantize-dequantized inputs, in the same
  // implementation (f32 and f64 may break a near-tie differently).
  const DType rounded = GetParam() == Impl::cpu ? DType::f32 : DType::f64;
  const IndexerOutput on_rounded =
      indexer(fp8_round_trip(c.qi, rounded), fp8_round_trip(c.ki, rounded), c.cu_seqlens_q,
              c.cu_seqlens_k, c.params(), GetParam());
  EXPECT_TRUE(bitwise_equal(fp8.topk, on_rounded.topk)) << "fp8 rows are not the rows of the rounded inputs";
  // The LSE is exact over the fp8-selected blocks.
  const DoubleInputs in(c);
  const Tensor lse = expected_index_lse(c, in, fp8.topk, 1.0 / std::sqrt(32.0), 1.0);
  expect_close(fp8.lse, lse, 1e-5, 1e-5, "lse");
}

INSTANTIATE_TEST_SUITE_P(Impls, IndexComputeFp8, ::testing::Values(Impl::reference, Impl::cpu),
                         impl_test_name);

TEST(IndexComputeFp8Paged, FloatCacheAndFp8CacheSelectAlike) {
  MSA_RESEED_AND_TRACE();
  const VarlenCase c = make_varlen_case(fp8_shape(), ranking_sequences());
  const PagedRequests paged = page_varlen_case(c);
  const MsaParams fp8_params = with_compute(c.params(), IndexCompute::fp8);
  PagedKvCache quantized = paged.cache;
  const QuantizedIndexKeys keys = quantize_index_keys_fp8(paged.cache.index_key_cache);
  quantized.index_key_cache = keys.codes;
  quantized.index_key_scale = keys.scale;
  const IndexerOutput from_float = paged_indexer(c.qi, paged.cache, paged.cu_seqlens_q, fp8_params, Impl::cpu);
  const IndexerOutput from_fp8 = paged_indexer(c.qi, quantized, paged.cu_seqlens_q, fp8_params, Impl::cpu);
  EXPECT_TRUE(bitwise_equal(from_float.topk, from_fp8.topk));
  // And the paged form equals the varlen one.
  const IndexerOutput varlen = indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, fp8_params, Impl::cpu);
  EXPECT_TRUE(bitwise_equal(from_float.topk, varlen.topk));
}

TEST(IndexComputeFp8Errors, Fp4CacheAndBadValuesAreClearErrors) {
  MSA_RESEED_AND_TRACE();
  const VarlenCase c = make_varlen_case(fp8_shape(), {{.q_len = 5, .k_len = 100}});
  const PagedRequests paged = page_varlen_case(c);
  PagedKvCache fp4 = paged.cache;
  const QuantizedIndexKeys keys = quantize_index_keys_fp4(paged.cache.index_key_cache);
  fp4.index_key_cache = keys.codes;
  fp4.index_key_scale = keys.scale;
  const std::string fp4_message = error_of([&] {
    paged_indexer(c.qi, fp4, paged.cu_seqlens_q, with_compute(c.params(), IndexCompute::fp8),
                  Impl::reference);
  });
  EXPECT_NE(fp4_message.find("index_compute"), std::string::npos) << fp4_message;
  MsaParams bad = c.params();
  bad.index_compute = static_cast<IndexCompute>(7);
  const std::string bad_message = error_of([&] { validate_params(bad); });
  EXPECT_NE(bad_message.find("index_compute"), std::string::npos) << bad_message;
  EXPECT_EQ(index_compute_from_name("fp8"), IndexCompute::fp8);
  EXPECT_EQ(index_compute_name(IndexCompute::exact), "exact");
  const std::string name_message = error_of([] { index_compute_from_name("int8"); });
  EXPECT_NE(name_message.find("int8"), std::string::npos) << name_message;
}

}  // namespace
}  // namespace msa::testing
