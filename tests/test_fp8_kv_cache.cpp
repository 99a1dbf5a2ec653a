// fp8 K/V caches on the CPU (msa/quantized_kv_cache.h, PagedKvCache::k_scale / v_scale): the
// encoding (per token and head: the fp8 index-key rule per row; per tensor: round to nearest
// even against a brute-force nearest-grid search), dequantization, append_kv_cache (reference
// and cpu write the same bytes, the codes of the encoder, nothing else), attention over fp8
// caches (Impl::cpu against the f64 reference over the decode and prefill shape matrix, both
// scale layouts; each bitwise the op on the dequantized float cache), how far fp8 moves the
// outputs from the float cache (printed and bounded), and the errors for bad caches.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <iostream>
#include <limits>
#include <numeric>
#include <tuple>

#include "fp8_kv_cases.h"
#include "msa/quantized_index_keys.h"
#include "quantized_cases.h"

namespace msa::testing {
namespace {

// As test_ops_forward.cpp: Impl::cpu (f32) against the f64 reference over <= ~1000 keys.
constexpr double kF32Tolerance = 1e-5, kF32AbsTolerance = 1e-4;

uint8_t byte_at(const Tensor& t, int64_t i) { return static_cast<const uint8_t*>(t.raw())[i]; }

std::vector<double> e4m3_grid() {  // magnitudes of the codes 0x00 .. 0x7e
  std::vector<double> grid;
  for (int code = 0; code <= 0x7e; ++code) grid.push_back(e4m3_to_float(static_cast<uint8_t>(code)));
  return grid;
}

// Values [rows, heads, dim] at magnitudes 2^-12 .. 2^8 per row, an all-zero row and a row with
// one non-zero value.
Tensor varied_values(int64_t rows, int64_t heads, int64_t dim) {
  Tensor x = random_normal({rows, heads, dim});
  float* v = x.data<float>();
  for (int64_t r = 0; r < rows * heads; ++r)
    for (int64_t d = 0; d < dim; ++d) v[r * dim + d] *= std::ldexp(1.0f, static_cast<int>(r % 21) - 12);
  for (int64_t d = 0; d < dim; ++d) {
    v[d] = 0.0f;
    v[dim + d] = d == 3 ? -2.5f : 0.0f;
  }
  return x;
}

// ---- the encoding ----

TEST(QuantizeKvFp8, PerTokenHeadIsTheIndexKeyRuleOnEveryRow) {
  MSA_RESEED_AND_TRACE();
  const Tensor values = varied_values(23, 3, 40);
  const QuantizedKv kv = quantize_kv_fp8(values);
  ASSERT_EQ(kv.codes.shape(), values.shape());
  ASSERT_EQ(kv.codes.dtype(), DType::e4m3);
  ASSERT_EQ(kv.scale.shape(), (Shape{23, 3}));
  ASSERT_EQ(kv.scale.dtype(), DType::f32);
  const QuantizedIndexKeys rows = quantize_index_keys_fp8(values);  // the same rule, [23, 3] rows
  EXPECT_TRUE(bitwise_equal(kv.codes, rows.codes));
  EXPECT_TRUE(bitwise_equal(kv.scale, rows.scale));
  // Also checked against the grid directly: scale = amax / 448, nearest code, largest -> 448.
  const std::vector<double> grid = e4m3_grid();
  const float* x = values.data<float>();
  for (int64_t r = 0; r < 23 * 3; ++r) {
    float amax = 0;
    for (int64_t d = 0; d < 40; ++d) amax = std::max(amax, std::fabs(x[r * 40 + d]));
    const float scale = kv.scale.data<float>()[r];
    ASSERT_EQ(scale, amax / 448.0f) << "row " << r;
    for (int64_t d = 0; d < 40; ++d) {
      const uint8_t code = byte_at(kv.codes, r * 40 + d);
      if (scale == 0) {
        ASSERT_EQ(code, 0) << "row " << r;
        continue;
      }
      const float v = x[r * 40 + d] / scale;
      ASSERT_EQ(code & 0x7f, nearest_even(grid, v)) << "row " << r << " element " << d << " = " << v;
      ASSERT_EQ(code >> 7, std::signbit(v) ? 1 : 0);
    }
  }
}

TEST(QuantizeKvFp8, PerTensorCodesRoundToNearestEvenAndSaturate) {
  MSA_RESEED_AND_TRACE();
  Tensor values = random_normal({7, 2, 32}, 3.0);
  values.set(5, 1e6);    // beyond 448 * scale: saturates to 448
  values.set(6, -1e6);
  values.set(7, 1e-9);   // below the smallest subnormal: 0
  const float scale = 0.0123f;
  const QuantizedKv kv = quantize_kv_fp8(values, scale);
  ASSERT_EQ(kv.codes.shape(), values.shape());
  ASSERT_EQ(kv.scale.shape(), (Shape{1}));
  EXPECT_EQ(kv.scale.data<float>()[0], scale);
  const std::vector<double> grid = e4m3_grid();
  const float* x = values.data<float>();
  for (int64_t i = 0; i < values.numel(); ++i) {
    const float v = x[i] / scale;
    const uint8_t code = byte_at(kv.codes, i);
    ASSERT_EQ(code & 0x7f, nearest_even(grid, v)) << "element " << i << " = " << v;
    ASSERT_EQ(code >> 7, std::signbit(v) ? 1 : 0);
  }
  EXPECT_EQ(byte_at(kv.codes, 5), 0x7e);
  EXPECT_EQ(byte_at(kv.codes, 6), 0xfe);
  EXPECT_EQ(byte_at(kv.codes, 7) & 0x7f, 0);
}

TEST(DequantizeKv, IsCodeTimesScaleExactInF64AndRoundedOnceInF32) {
  MSA_RESEED_AND_TRACE();
  const Tensor values = varied_values(9, 2, 16);
  for (KvScaleLayout layout : kKvScaleLayouts) {
    SCOPED_TRACE(layout_name(layout));
    const QuantizedKv kv = quantize_kv_as(values, layout);
    const Tensor f64 = dequantize_kv(kv.codes, kv.scale, DType::f64);
    const Tensor f32 = dequantize_kv(kv.codes, kv.scale);
    ASSERT_EQ(f64.shape(), values.shape());
    for (int64_t i = 0; i < values.numel(); ++i) {
      const double s = kv.scale.data<float>()[layout == KvScaleLayout::per_tensor ? 0 : i / 16];
      const double want = double{e4m3_to_float(byte_at(kv.codes, i))} * s;
      ASSERT_EQ(f64.data<double>()[i], want) << i;
      ASSERT_EQ(f32.data<float>()[i], static_cast<float>(want)) << i;
    }
    // fp8 keeps 3 mantissa bits: each value within 2^-4 of itself (relative), away from
    // subnormals; norm-wise well below that.
    EXPECT_LT(relative_error(f32, values), 0.05);
  }
}

TEST(QuantizeKvFp8, RejectsBadValuesAndScales) {
  Tensor values = random_normal({4, 2, 8});
  for (float bad : {0.0f, -1.0f, std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN()})
    expect_error([&] { quantize_kv_fp8(values, bad); }, "argument 'scale'");
  values.set(11, std::numeric_limits<double>::infinity());
  expect_error([&] { quantize_kv_fp8(values); }, "finite");
  expect_error([&] { quantize_kv_fp8(Tensor::zeros({4, 8}, DType::i32)); }, "argument 'values'");
  const QuantizedKv kv = quantize_kv_fp8(random_normal({4, 2, 8}));
  expect_error([&] { dequantize_kv(kv.codes, Tensor::zeros({4, 3}, DType::f32)); }, "argument 'scale'");
  expect_error([&] { dequantize_kv(kv.codes, Tensor::zeros({4, 2}, DType::f64)); }, "argument 'scale'");
  expect_error([&] { dequantize_kv(kv.codes, Tensor()); }, "argument 'scale'");
  expect_error([&] { dequantize_kv(Tensor::zeros({4, 2, 8}, DType::f32), kv.scale); }, "argument 'codes'");
  EXPECT_EQ(kv_scale_layout_from_name("per_tensor"), KvScaleLayout::per_tensor);
  expect_error([&] { kv_scale_layout_from_name("per_row"); }, "per_token_head or per_tensor");
}

// ---- append_kv_cache ----

// Every row (page, head, row) of `after` against `before` and the new tokens: rows a token
// went to hold that token's codes (scales) from `want`; every other row is unchanged.
void expect_rows_written(const PagedKvCache& before, const PagedKvCache& after, const Tensor& slots,
                         const QuantizedKv& want_k, const QuantizedKv& want_v, bool per_tensor) {
  const int64_t pages = after.k_cache.size(0), H = after.k_cache.size(1), B = after.k_cache.size(2),
                D = after.k_cache.size(3);
  std::vector<int64_t> token_at(static_cast<size_t>(pages * B), -1);
  for (int64_t t = 0; t < slots.numel(); ++t)
    if (slots.get(t) >= 0) token_at[static_cast<size_t>(slots.get(t))] = t;
  for (const auto& [cache_before, cache_after, scale_before, scale_after, want] :
       {std::tuple{&before.k_cache, &after.k_cache, &before.k_scale, &after.k_scale, &want_k},
        std::tuple{&before.v_cache, &after.v_cache, &before.v_scale, &after.v_scale, &want_v}}) {
    for (int64_t page = 0; page < pages; ++page)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t row = 0; row < B; ++row) {
          const int64_t t = token_at[page * B + row], at = (page * H + h) * B + row;
          const uint8_t* got = static_cast<const uint8_t*>(cache_after->raw()) + at * D;
          const uint8_t* old = static_cast<const uint8_t*>(cache_before->raw()) + at * D;
          if (t < 0) {
            ASSERT_EQ(std::memcmp(got, old, D), 0) << "untouched row " << at << " changed";
            if (!per_tensor) ASSERT_EQ(scale_after->data<float>()[at], scale_before->data<float>()[at]);
            continue;
          }
          const uint8_t* expected = static_cast<const uint8_t*>(want->codes.raw()) + (t * H + h) * D;
          ASSERT_EQ(std::memcmp(got, expected, D), 0) << "token " << t << " head " << h;
          if (!per_tensor)
            ASSERT_EQ(scale_after->data<float>()[at], want->scale.data<float>()[t * H + h])
                << "token " << t << " head " << h;
        }
    if (per_tensor) EXPECT_TRUE(bitwise_equal(*scale_after, *scale_before)) << "per-tensor scale changed";
  }
}

TEST(AppendKvCache, Fp8RowsAreTheEncodersBytesAndNothingElseChanges) {
  MSA_RESEED_AND_TRACE();
  for (KvScaleLayout layout : kKvScaleLayouts)
    for (DType input : {DType::f32, DType::bf16, DType::f64})
      for (DType slot_type : {DType::i64, DType::i32}) {
        SCOPED_TRACE(layout_name(layout) + " input " + std::string(dtype_name(input)) + " slots " +
                     std::string(dtype_name(slot_type)));
        const PagedKvCache before = garbage_cache(6, 3, 8, 32, true, layout);
        const int64_t tokens = 37;
        const Tensor k = varied_values(tokens, 3, 32).to(input), v = random_normal({tokens, 3, 32}, 2.0, input);
        const Tensor slots = random_slots(tokens, 6 * 8, slot_type);
        PagedKvCache ref = clone_cache(before), cpu = clone_cache(before);
        append_kv_cache(ref, k, v, slots, Impl::reference);
        append_kv_cache(cpu, k, v, slots, Impl::cpu);
        for (const auto& [got, want] : {std::pair{&cpu.k_cache, &ref.k_cache}, {&cpu.v_cache, &ref.v_cache},
                                        {&cpu.k_scale, &ref.k_scale}, {&cpu.v_scale, &ref.v_scale}})
          EXPECT_TRUE(bitwise_equal(*got, *want)) << "cpu and reference wrote different bytes";
        // The encoder's bytes: quantize_index_keys_fp8 per (token, head) row, or the per-tensor rule.
        const bool per_tensor = layout == KvScaleLayout::per_tensor;
        const auto encoded = [&](const Tensor& x, const Tensor& scale) {
          if (per_tensor) return quantize_kv_fp8(x, scale.data<float>()[0]);
          const QuantizedIndexKeys rows = quantize_index_keys_fp8(x);
          return QuantizedKv{rows.codes, rows.scale};
        };
        ASSERT_NO_FATAL_FAILURE(expect_rows_written(before, ref, slots, encoded(k, before.k_scale),
                                                    encoded(v, before.v_scale), per_tensor));
      }
}

TEST(AppendKvCache, FloatCachesStoreTheRoundedValues) {
  MSA_RESEED_AND_TRACE();
  for (DType cache_type : {DType::f32, DType::bf16, DType::f16})
    for (DType input : {DType::f32, DType::f64}) {
      SCOPED_TRACE(std::string(dtype_name(cache_type)) + " cache, " + std::string(dtype_name(input)) + " input");
      const PagedKvCache before = garbage_cache(4, 3, 8, 32, false, KvScaleLayout::per_token_head, cache_type);
      const int64_t tokens = 19;
      const Tensor k = random_normal({tokens, 3, 32}, 1.0, input), v = random_normal({tokens, 3, 32}, 1.0, input);
      const Tensor slots = random_slots(tokens, 4 * 8);
      PagedKvCache ref = clone_cache(before), cpu = clone_cache(before);
      append_kv_cache(ref, k, v, slots, Impl::reference);
      append_kv_cache(cpu, k, v, slots, Impl::cpu);
      EXPECT_TRUE(bitwise_equal(cpu.k_cache, ref.k_cache));
      EXPECT_TRUE(bitwise_equal(cpu.v_cache, ref.v_cache));
      const Tensor k_rounded = k.to(cache_type), v_rounded = v.to(cache_type);
      const size_t row_bytes = 32 * dtype_size(cache_type);
      for (int64_t t = 0; t < tokens; ++t) {
        if (slots.get(t) < 0) continue;
        const int64_t page = static_cast<int64_t>(slots.get(t)) / 8, row = static_cast<int64_t>(slots.get(t)) % 8;
        for (int64_t h = 0; h < 3; ++h) {
          const size_t at = static_cast<size_t>(((page * 3 + h) * 8 + row)) * row_bytes,
                       from = static_cast<size_t>(t * 3 + h) * row_bytes;
          ASSERT_EQ(std::memcmp(static_cast<const char*>(ref.k_cache.raw()) + at,
                                static_cast<const char*>(k_rounded.raw()) + from, row_bytes), 0);
          ASSERT_EQ(std::memcmp(static_cast<const char*>(ref.v_cache.raw()) + at,
                                static_cast<const char*>(v_rounded.raw()) + from, row_bytes), 0);
        }
      }
    }
}

// Appending a context chunk by chunk gives the cache that quantizing the whole context gives
// (per token and head: each row's scale is its own), and attention over it the same outputs.
TEST(AppendKvCache, ChunkedAppendEqualsTheWholeCacheQuantized) {
  MSA_RESEED_AND_TRACE();
  const CaseShape shape = make_shape(2, 4, 32, 16, 8, 2, 1, 0);
  const VarlenCase c = make_varlen_case(shape, {{.q_len = 1, .k_len = 45}});
  const PagedRequests paged = page_varlen_case(c, 0, 0);
  const PagedKvCache whole = fp8_kv_cache(paged.cache, KvScaleLayout::per_token_head);
  PagedKvCache appended = clone_cache(whole);
  for (Tensor* t : {&appended.k_cache, &appended.v_cache}) std::memset(t->raw(), 0, t->nbytes());
  for (Tensor* t : {&appended.k_scale, &appended.v_scale}) std::memset(t->raw(), 0, t->nbytes());
  // The case's tokens in chunks of 1, 7 and the rest, through the page table.
  for (const auto& [begin, end] : {std::pair<int64_t, int64_t>{0, 1}, {1, 8}, {8, 45}}) {
    std::vector<int64_t> slots;
    for (int64_t t = begin; t < end; ++t)
      slots.push_back(int64_t{paged.cache.page_table.data<int32_t>()[t / 8]} * 8 + t % 8);
    const Tensor k = c.k.slice0(begin, end).clone(), v = c.v.slice0(begin, end).clone();
    append_kv_cache(appended, k, v, Tensor::from_vector(slots, {end - begin}), Impl::cpu);
  }
  const MsaParams& p = c.params();
  const AttentionOutput want = paged_dense_attention(c.q, whole, paged.cu_seqlens_q, p, Impl::cpu);
  const AttentionOutput got = paged_dense_attention(c.q, appended, paged.cu_seqlens_q, p, Impl::cpu);
  EXPECT_TRUE(bitwise_equal(got.o, want.o));
  EXPECT_TRUE(bitwise_equal(got.lse, want.lse));
}

class AppendKvCacheErrors : public ::testing::TestWithParam<Impl> {};

TEST_P(AppendKvCacheErrors, BadArgumentsAreRejectedAndNothingIsWritten) {
  MSA_RESEED_AND_TRACE();
  const PagedKvCache good = garbage_cache(2, 3, 8, 32, true, KvScaleLayout::per_token_head);
  const Tensor k = random_normal({3, 3, 32}), v = random_normal({3, 3, 32});
  const Tensor slots = Tensor::from_vector(std::vector<int64_t>{0, 9, 15}, {3});
  const auto rejected = [&](PagedKvCache cache, const Tensor& k_in, const Tensor& v_in, const Tensor& s,
                            const std::string& argument) {
    SCOPED_TRACE("bad " + argument);
    cache = clone_cache(cache);
    const PagedKvCache untouched = clone_cache(cache);
    expect_error([&] { append_kv_cache(cache, k_in, v_in, s, GetParam()); }, "argument '" + argument);
    for (const auto& [now, then] : {std::pair{&cache.k_cache, &untouched.k_cache}, {&cache.v_cache, &untouched.v_cache}})
      EXPECT_TRUE(bitwise_equal(*now, *then)) << "a refused append wrote";
  };
  rejected(good, k, v, Tensor::from_vector(std::vector<int64_t>{0, 16, 1}, {3}), "slot_mapping[1]");  // 2 pages x 8
  rejected(good, k, v, Tensor::from_vector(std::vector<int64_t>{4, -1, 4}, {3}), "slot_mapping");     // twice
  rejected(good, k, v, Tensor::from_vector(std::vector<float>{0, 1, 2}, {3}), "slot_mapping");        // dtype
  rejected(good, k, v, Tensor::from_vector(std::vector<int64_t>{0, 1}, {2}), "slot_mapping");         // count
  rejected(good, random_normal({3, 2, 32}), v, slots, "k");                                            // heads
  rejected(good, k, random_normal({3, 3, 16}), slots, "v");                                            // dim
  rejected(good, Tensor::zeros({3, 3, 32}, DType::i32), v, slots, "k");
  Tensor nan_v = v.clone();
  nan_v.set(3 * 3 * 32 - 1, std::numeric_limits<double>::quiet_NaN());  // the last value: after k was checked
  rejected(good, k, nan_v, slots, "v (fp8 K/V quantization)");
  PagedKvCache bad = good;
  bad.k_scale = Tensor();
  rejected(bad, k, v, slots, "k_scale");  // e4m3 codes without a scale
  bad = garbage_cache(2, 3, 8, 32, true, KvScaleLayout::per_tensor);
  bad.v_scale = Tensor::full({1}, DType::f32, 0.0);
  rejected(bad, k, v, slots, "v_scale[0]");  // the append divides by it
  bad = garbage_cache(2, 3, 8, 32, false, KvScaleLayout::per_token_head);
  bad.k_scale = good.k_scale;
  rejected(bad, k, v, slots, "k_scale");  // a scale with a float cache
}

INSTANTIATE_TEST_SUITE_P(Impls, AppendKvCacheErrors, ::testing::Values(Impl::reference, Impl::cpu),
                         impl_test_name);

// ---- attention over fp8 caches ----

struct Fp8AttentionCase {
  CaseShape shape;
  KvScaleLayout layout;
  bool decode = false;  // Q = 1..16 requests instead of edge-length prefills
};

void PrintTo(const Fp8AttentionCase& fc, std::ostream* out) {
  *out << layout_name(fc.layout) << "_" << fc.shape.describe() << (fc.decode ? "_decode" : "");
}

std::vector<Fp8AttentionCase> attention_cases() {
  // make_shape(Hkv, G, D, Di, B, topk, local, init): G 1..16, D 16..128, B 4..64.
  const CaseShape shapes[] = {
      make_shape(1, 1, 16, 16, 4, 2, 1, 0),    make_shape(2, 2, 64, 16, 4, 4, 1, 1),
      make_shape(4, 4, 16, 64, 8, 4, 2, 0),    make_shape(1, 8, 128, 16, 8, 8, 2, 1),
      make_shape(2, 16, 32, 16, 4, 8, 1, 0),   make_shape(2, 16, 128, 16, 64, 4, 1, 0),
      make_shape(3, 3, 64, 16, 16, 4, 1, 1),
  };
  std::vector<Fp8AttentionCase> cases;
  for (KvScaleLayout layout : kKvScaleLayouts)
    for (const CaseShape& shape : shapes)
      for (bool decode : {false, true}) cases.push_back({shape, layout, decode});
  return cases;
}

VarlenCase attention_case(const Fp8AttentionCase& fc) {
  const MsaParams& p = fc.shape.params;
  return make_varlen_case(fc.shape, fc.decode ? decode_requests(fc.shape)
                                              : mixed_sequences(edge_lengths(p.block_size, p.topk)));
}

class Fp8KvAttention : public ::testing::TestWithParam<Fp8AttentionCase> {};

// Impl::cpu against the reference on the same fp8 cache, every paged attention op.
TEST_P(Fp8KvAttention, CpuMatchesTheReference) {
  MSA_RESEED_AND_TRACE();
  const Fp8KvCase fc = make_fp8_kv_case(attention_case(GetParam()), GetParam().layout);
  const MsaParams& p = fc.c.params();
  const PagedKvCache& cache = fc.paged.cache;
  const Tensor& cu = fc.paged.cu_seqlens_q;
  Tensor topk = paged_indexer(fc.c.qi, cache, cu, p, Impl::reference).topk;
  empty_every_nth_row(topk, 11);  // rows that read nothing: o = 0, lse = -inf
  const auto check = [&](const AttentionOutput& got, const AttentionOutput& want, const std::string& what) {
    expect_close(got.o, want.o, kF32Tolerance, kF32AbsTolerance, what + ": o");
    expect_close(got.lse, want.lse, kF32Tolerance, kF32AbsTolerance, what + ": lse");
  };
  check(paged_sparse_attention(fc.c.q, cache, topk, cu, p, Impl::cpu),
        paged_sparse_attention(fc.c.q, cache, topk, cu, p, Impl::reference), "sparse");
  check(paged_dense_attention(fc.c.q, cache, cu, p, Impl::cpu),
        paged_dense_attention(fc.c.q, cache, cu, p, Impl::reference), "dense");
  const MsaOutput cpu = paged_msa_attention(fc.c.q, fc.c.qi, cache, cu, p, Impl::cpu);
  const MsaOutput ref = paged_msa_attention(fc.c.q, fc.c.qi, cache, cu, p, Impl::reference);
  ASSERT_EQ(cpu.topk.defined(), ref.topk.defined());
  if (cpu.topk.defined() && !bitwise_equal(cpu.topk, ref.topk)) {
    // near-ties may pick other blocks: judge cpu's attention on its own rows
    check(cpu.attention, paged_sparse_attention(fc.c.q, cache, cpu.topk, cu, p, Impl::reference), "msa");
  } else {
    check(cpu.attention, ref.attention, "msa");
  }
}

// Each Impl reads exactly the dequantized values: Impl::cpu equals the op on the f32
// dequantized cache bit for bit, the reference the op on the f64 one.
TEST_P(Fp8KvAttention, EqualsTheOpOnTheDequantizedCache) {
  MSA_RESEED_AND_TRACE();
  const Fp8KvCase fc = make_fp8_kv_case(attention_case(GetParam()), GetParam().layout);
  const MsaParams& p = fc.c.params();
  const Tensor& cu = fc.paged.cu_seqlens_q;
  const Tensor topk = paged_indexer(fc.c.qi, fc.paged.cache, cu, p, Impl::reference).topk;
  const PagedKvCache dequantized = dequantized_kv_cache(fc.paged.cache);
  const PagedKvCache exact = dequantized_kv_cache(fc.paged.cache, DType::f64);
  for (const auto& [impl, plain] : {std::pair{Impl::cpu, &dequantized}, {Impl::reference, &exact}}) {
    SCOPED_TRACE(impl_name(impl));
    const AttentionOutput sparse = paged_sparse_attention(fc.c.q, fc.paged.cache, topk, cu, p, impl);
    const AttentionOutput sparse_plain = paged_sparse_attention(fc.c.q, *plain, topk, cu, p, impl);
    EXPECT_TRUE(bitwise_equal(sparse.o, sparse_plain.o));
    EXPECT_TRUE(bitwise_equal(sparse.lse, sparse_plain.lse));
    const AttentionOutput dense = paged_dense_attention(fc.c.q, fc.paged.cache, cu, p, impl);
    const AttentionOutput dense_plain = paged_dense_attention(fc.c.q, *plain, cu, p, impl);
    EXPECT_TRUE(bitwise_equal(dense.o, dense_plain.o));
    EXPECT_TRUE(bitwise_equal(dense.lse, dense_plain.lse));
  }
}

std::string attention_case_name(const ::testing::TestParamInfo<Fp8AttentionCase>& info) {
  return layout_name(info.param.layout) + "_" + info.param.shape.describe() +
         (info.param.decode ? "_decode" : "");
}
INSTANTIATE_TEST_SUITE_P(Cases, Fp8KvAttention, ::testing::ValuesIn(attention_cases()), attention_case_name);

// ---- how far fp8 moves the outputs from the float cache ----

// Attention (Impl::cpu) over the fp8 cache against the same op over the original f32 cache:
// relative error of O (norm-wise) and the largest LSE difference, printed. e4m3 keeps 3
// mantissa bits: each value moves by up to 2^-4 of itself (rms ~2.4%), so O moves by a few
// percent (measured 3-4%). A logit moves by the q-weighted mean of its key's D rounding errors:
// ~0.4% of itself, since they average out over D / 3 effective terms. Random logits are O(1):
// the LSE moves by ~0.01-0.02. The planted keys' logits stand 12-20 above the rest, so the
// LSE of the rows that attend to them moves by up to ~0.3-0.4 (3-4 sigma of 0.4% of ~20 over
// 64 heads x 8 rows). The bounds are ~2x the measured values (seeded inputs): a wrong scale, a
// misplaced row or a dropped token moves them by far more.
struct MovementBound {
  double o_relative, lse_absolute;
};

void expect_movement(const std::string& what, const Fp8KvCase& fc, MovementBound bound) {
  const MsaParams& p = fc.c.params();
  const Tensor& cu = fc.paged.cu_seqlens_q;
  for (bool dense : {true, false}) {
    const auto run = [&](const PagedKvCache& cache) {
      if (dense) return paged_dense_attention(fc.c.q, cache, cu, p, Impl::cpu);
      return paged_msa_attention(fc.c.q, fc.c.qi, cache, cu, p, Impl::cpu).attention;
    };
    const AttentionOutput fp8 = run(fc.paged.cache), f32 = run(fc.float_cache);
    const double o_error = relative_error(fp8.o, f32.o), lse_error = max_abs_diff(fp8.lse, f32.lse);
    std::cout << "[ fp8 kv ] " << what << ", " << layout_name(fc.layout) << (dense ? ", dense" : ", msa")
              << ": o relative error " << o_error << ", lse max |diff| " << lse_error << "\n";
    EXPECT_LT(o_error, bound.o_relative) << what << (dense ? " dense" : " msa");
    EXPECT_LT(lse_error, bound.lse_absolute) << what << (dense ? " dense" : " msa");
  }
}

TEST(Fp8KvMovement, RandomAndPlantedInputsAgainstTheFloatCache) {
  MSA_RESEED_AND_TRACE();
  // M3's head shape (G 16, D 128), B 64, top-4: sparse beyond 256 keys.
  const CaseShape shape = make_shape(2, 16, 128, 64, 64, 4, 1, 0);
  const std::vector<Seq> requests = {{.q_len = 1, .k_len = 1500}, {.q_len = 4, .k_len = 700},
                                     {.q_len = 1, .k_len = 200}, {.q_len = 2, .k_len = 2000}};
  for (KvScaleLayout layout : kKvScaleLayouts) {
    const VarlenCase random_case = make_varlen_case(shape, requests);
    expect_movement("random", make_fp8_kv_case(random_case, layout), {0.08, 0.04});
    VarlenCase planted = make_varlen_case(shape, requests);
    plant_aligned_keys(planted, 3);
    expect_movement("3 planted keys per request", make_fp8_kv_case(planted, layout), {0.07, 0.75});
  }
}

// ---- argument errors of the attention ops ----

class Fp8KvCacheErrors : public ::testing::TestWithParam<Impl> {
 protected:
  Fp8KvCase make(KvScaleLayout layout) const {
    return make_fp8_kv_case(
        make_varlen_case(make_shape(2, 2, 8, 16, 2, 3, 1, 0),
                         {{.q_len = 3, .k_len = 6}, {.q_len = 5, .k_len = 9}, {.q_len = 2, .k_len = 2}}),
        layout);
  }
  void expect_rejected(const Fp8KvCase& fc, const PagedKvCache& cache, const std::string& argument) const {
    SCOPED_TRACE("bad argument " + argument);
    const MsaParams& p = fc.c.params();
    const Tensor& cu = fc.paged.cu_seqlens_q;
    expect_error([&] { paged_dense_attention(fc.c.q, cache, cu, p, GetParam()); }, "argument '" + argument);
    const Tensor topk = paged_indexer(fc.c.qi, fc.float_cache, cu, p, Impl::reference).topk;
    expect_error([&] { paged_sparse_attention(fc.c.q, cache, topk, cu, p, GetParam()); },
                 "argument '" + argument);
    expect_error([&] { paged_msa_attention(fc.c.q, fc.c.qi, cache, cu, p, GetParam()); },
                 "argument '" + argument);
  }
};

TEST_P(Fp8KvCacheErrors, ValidCachesPass) {
  if (!impl_available(GetParam())) GTEST_SKIP() << "no CUDA device";
  if (GetParam() == Impl::cuda) GTEST_SKIP() << "D 8 is below the CUDA kernels' 64";
  for (KvScaleLayout layout : kKvScaleLayouts) {
    const Fp8KvCase fc = make(layout);
    EXPECT_NO_THROW(paged_dense_attention(fc.c.q, fc.paged.cache, fc.paged.cu_seqlens_q, fc.c.params(),
                                          GetParam()));
  }
}

TEST_P(Fp8KvCacheErrors, BadScalesAndCodesAreRejected) {
  const Fp8KvCase fc = make(KvScaleLayout::per_token_head), pt = make(KvScaleLayout::per_tensor);
  const int64_t pages = fc.paged.cache.k_cache.size(0), H = 2, B = 2, D = 8;
  PagedKvCache cache = fc.paged.cache;
  cache.k_scale = Tensor();
  expect_rejected(fc, cache, "k_scale");  // fp8 K without a scale
  cache = fc.paged.cache;
  cache.v_scale = Tensor();
  expect_rejected(fc, cache, "v_scale");
  cache = fc.float_cache;
  cache.k_scale = fc.paged.cache.k_scale;
  expect_rejected(fc, cache, "k_scale");  // float K with a scale
  cache = fc.float_cache;
  cache.v_scale = pt.paged.cache.v_scale;
  expect_rejected(fc, cache, "v_scale");
  cache = fc.paged.cache;
  cache.k_scale = Tensor::zeros({pages, H, B}, DType::f64);
  expect_rejected(fc, cache, "k_scale");  // dtype
  cache.k_scale = Tensor::zeros({pages, H, B}, DType::bf16);
  expect_rejected(fc, cache, "k_scale");
  cache.k_scale = Tensor::zeros({pages, H}, DType::f32);
  expect_rejected(fc, cache, "k_scale");  // a layout that matches neither
  cache.k_scale = Tensor::zeros({pages + 1, H, B}, DType::f32);
  expect_rejected(fc, cache, "k_scale");
  cache.k_scale = Tensor::zeros({pages, H, B, 1}, DType::f32);
  expect_rejected(fc, cache, "k_scale");
  cache.k_scale = Tensor::zeros({2}, DType::f32);
  expect_rejected(fc, cache, "k_scale");
  cache = fc.paged.cache;
  cache.v_scale = Tensor::zeros({pages, H, B + 1}, DType::f32);
  expect_rejected(fc, cache, "v_scale");
  cache = fc.paged.cache;
  cache.v_cache = fc.float_cache.v_cache;  // fp8 K, float V
  expect_rejected(fc, cache, "v_cache");
  cache = fc.float_cache;
  cache.v_cache = fc.paged.cache.v_cache;  // float K, fp8 V
  cache.v_scale = fc.paged.cache.v_scale;
  expect_rejected(fc, cache, "v_cache");
  cache = fc.paged.cache;
  cache.k_cache = Tensor::zeros({pages, H, B, D}, DType::u8);  // codes of another dtype
  expect_rejected(fc, cache, "k_cache");
  cache = fc.paged.cache;
  cache.v_cache = Tensor::zeros({pages, H, B, D + 1}, DType::e4m3);
  expect_rejected(fc, cache, "v_cache");
}

INSTANTIATE_TEST_SUITE_P(Impls, Fp8KvCacheErrors,
                         ::testing::Values(Impl::reference, Impl::cpu, Impl::cuda), impl_test_name);

}  // namespace
}  // namespace msa::testing
