// fp8 K/V caches on the GPU (msa/quantized_kv_cache.h, docs/msa.md §6.6): the append kernel
// (msa::cuda::append_kv_fp8) against the host op's bytes; the decode attention kernels reading
// e4m3 codes and scales (sparse and dense, with and without the key split, Q 1..16, G 1..16,
// D 64 / 128, B 64 / 128, both scale layouts, 128K contexts, batch 64) against Impl::cpu on
// the SAME fp8 cache (unused cache slots poisoned with NaN codes and scales), with the bf16
// tolerances of gpu_checks.h; the fp8 kernels with unit scales equal to the bf16 kernels on
// the same values (bitwise where they widen into a bf16 tile, within a tight bound where they
// build f16 fragments from the codes); query rows beyond f16's range and near zero; repeat runs
// bitwise equal. Prefill over the same caches (the bf16 copy of fp8_kv_widen.h) against
// Impl::cpu in every sparse order, and bitwise equal to the bf16 kernels on exact values.
// (DecodePlan graph replay over fp8 caches: test_cuda_graph.cpp.) Skipped (not failed) where
// no CUDA device is present; ctest label "gpu".
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <iostream>
#include <sstream>

#include "fp8_kv_cases.h"
#include "gpu_checks.h"

namespace msa::testing {
namespace {

// ---- the append kernel ----

TEST(GpuFp8KvAppend, KernelWritesTheHostOpsBytes) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  for (KvScaleLayout layout : kKvScaleLayouts)
    for (DType input : {DType::bf16, DType::f32})
      for (const auto& [H, D] : {std::pair<int64_t, int64_t>{4, 128}, {2, 64}, {3, 40}}) {
        const std::string what = layout_name(layout) + ", " + std::string(dtype_name(input)) + " input, Hkv " +
                                 std::to_string(H) + ", D " + std::to_string(D);
        SCOPED_TRACE(what);
        const int64_t pages = 40, B = 64, tokens = 2001;
        const PagedKvCache before = garbage_cache(pages, H, B, D, true, layout);
        // Magnitudes 2^-20 .. 2^12 across tokens, all-zero tokens, values far beyond the
        // per-tensor scale's range (they saturate).
        Tensor k = random_normal({tokens, H, D}), v = random_normal({tokens, H, D}, 3.0);
        for (Tensor* t : {&k, &v}) {
          float* x = t->data<float>();
          for (int64_t i = 0; i < t->numel(); ++i) {
            const int64_t token = i / (H * D);
            x[i] = token % 97 == 0 ? 0.0f : x[i] * std::ldexp(1.0f, static_cast<int>(token % 33) - 20);
          }
          x[5 * H * D + 1] = 30000.0f;
          *t = t->to(input);
        }
        const Tensor slots = random_slots(tokens, pages * B);
        PagedKvCache cpu = clone_cache(before), gpu = clone_cache(before);
        append_kv_cache(cpu, k, v, slots, Impl::cpu);
        append_kv_cache(gpu, k, v, slots, Impl::cuda);
        EXPECT_EQ(first_difference(gpu.k_cache, cpu.k_cache), -1) << what << ": k codes, first differing byte";
        EXPECT_EQ(first_difference(gpu.v_cache, cpu.v_cache), -1) << what << ": v codes, first differing byte";
        EXPECT_EQ(first_difference(gpu.k_scale, cpu.k_scale), -1) << what << ": k scales, first differing byte";
        EXPECT_EQ(first_difference(gpu.v_scale, cpu.v_scale), -1) << what << ": v scales, first differing byte";
        EXPECT_FALSE(bitwise_equal(cpu.k_cache, before.k_cache)) << "the append wrote nothing";
      }
}

TEST(GpuFp8KvAppend, FloatCachesAreRefused) {
  MSA_REQUIRE_CUDA();
  PagedKvCache cache = garbage_cache(2, 2, 8, 64, false, KvScaleLayout::per_token_head, DType::bf16);
  expect_error([&] {
    append_kv_cache(cache, random_normal({3, 2, 64}), random_normal({3, 2, 64}),
                    Tensor::from_vector(std::vector<int64_t>{0, 1, 2}, {3}), Impl::cuda);
  }, "writes fp8 caches");
}

// ---- decode attention over fp8 caches ----

// make_shape(Hkv, G, D, Di, B, topk, local, init): G 1, 2, 3, 4, 8, 16; D 64 and 128; B 64
// and 128; topk 4 .. 32.
std::vector<CaseShape> decode_shapes() {
  return {make_shape(4, 16, 128, 128, 128, 16, 1, 0),  // MiniMax-M3
          make_shape(2, 4, 64, 64, 64, 4, 1, 1),     make_shape(1, 8, 64, 128, 64, 8, 2, 1),
          make_shape(4, 2, 64, 64, 128, 32, 1, 1),   make_shape(2, 1, 128, 64, 64, 4, 1, 0),
          make_shape(2, 3, 128, 64, 128, 4, 1, 0)};
}

// Which decode kernel a batch takes (attention_decode.cu): the key split when one warp tile
// holds a CTA's rows, QC x G <= 16 with QC = min(max Q, 64 / G).
std::string kernel_variant(const CaseShape& shape, const std::vector<Seq>& seqs) {
  int64_t max_q = 1;
  for (const Seq& s : seqs) max_q = std::max(max_q, s.q_len);
  const int64_t rows = std::min<int64_t>(max_q, 64 / shape.group) * shape.group;
  return rows <= 16 ? "key split" : "rows per warp";
}

// Request sets per shape: Q 1..16 mixed (the rows-per-warp kernel unless G = 1), Q = 1 only and
// Q <= 4 (the key-split kernel for G <= 16 and G <= 4).
std::vector<std::pair<std::string, std::vector<Seq>>> request_sets(const CaseShape& shape) {
  const int64_t B = shape.params.block_size, kb = B * shape.params.topk;
  return {{"Q 1..16", decode_requests(shape)},
          {"Q 1", {{.q_len = 1, .k_len = kb + 3 * B + 1}, {.q_len = 1, .k_len = 1}, {.q_len = 1, .k_len = B - 1},
                   {.q_len = 1, .k_len = B + 1}, {.q_len = 1, .k_len = kb}, {.q_len = 1, .k_len = 7 * kb + 5}}},
          {"Q <= 4", {{.q_len = 4, .k_len = kb + 2 * B - 1}, {.q_len = 2, .k_len = 2}, {.q_len = 3, .k_len = kb + 1},
                      {.q_len = 1, .k_len = B}, {.q_len = 4, .k_len = 5 * kb + 17}}}};
}

// Which values the CPU reference reads: the fp8 cache itself (the decode kernels apply the
// scales in f32), or the cache dequantized and rounded to bf16 (what prefill's bf16 copy holds,
// fp8_kv_widen.h).
enum class Fp8Reference { codes, bf16_copy };

// On the fp8 cache of `fc` (unused slots poisoned): CUDA sparse attention over the CPU
// indexer's rows (some emptied), dense attention and MSA (over CUDA's own rows, judged by the
// CPU's sparse attention on them) against Impl::cpu on `reference`; repeat runs bitwise equal.
// With bf16_copy, also how far the sparse O moved from the exact fp8 values (relative L2, printed
// and bounded by 1e-2).
void expect_fp8_matches_cpu(Fp8KvCase fc, const std::string& what, Fp8Reference reference = Fp8Reference::codes) {
  poison_unused_fp8_slots(fc.paged.cache);
  const VarlenCase& c = fc.c;
  const MsaParams& p = c.params();
  const PagedKvCache& cache = fc.paged.cache;
  PagedKvCache ref = cache;
  if (reference == Fp8Reference::bf16_copy) {  // f32 products rounded once to bf16, as the copy
    ref = dequantized_kv_cache(cache);
    ref.k_cache = ref.k_cache.to(DType::bf16);
    ref.v_cache = ref.v_cache.to(DType::bf16);
  }
  const Tensor& cu = fc.paged.cu_seqlens_q;
  Tensor topk = paged_indexer(c.qi, cache, cu, p, Impl::cpu).topk;
  empty_every_nth_row(topk, 13);
  const AttentionOutput sparse = paged_sparse_attention(c.q, cache, topk, cu, p, Impl::cuda);
  expect_dense_close(sparse, paged_sparse_attention(c.q, ref, topk, cu, p, Impl::cpu), c, what + " sparse");
  if (reference == Fp8Reference::bf16_copy) {
    const double moved = relative_error(sparse.o, paged_sparse_attention(c.q, cache, topk, cu, p, Impl::cpu).o);
    std::cout << "[ fp8 kv ] " << what << ": sparse O vs the exact fp8 values, relative L2 " << moved << "\n";
    EXPECT_LT(moved, 1e-2) << what;
  }
  const AttentionOutput sparse_again = paged_sparse_attention(c.q, cache, topk, cu, p, Impl::cuda);
  EXPECT_TRUE(bitwise_equal(sparse.o, sparse_again.o)) << what << " sparse: o differs between runs";
  EXPECT_TRUE(bitwise_equal(sparse.lse, sparse_again.lse)) << what << " sparse: lse differs between runs";
  const AttentionOutput dense = paged_dense_attention(c.q, cache, cu, p, Impl::cuda);
  expect_dense_close(dense, paged_dense_attention(c.q, ref, cu, p, Impl::cpu), c, what + " dense");
  const MsaOutput msa = paged_msa_attention(c.q, c.qi, cache, cu, p, Impl::cuda);
  const AttentionOutput want = msa.topk.defined() ? paged_sparse_attention(c.q, ref, msa.topk, cu, p, Impl::cpu)
                                                  : paged_dense_attention(c.q, ref, cu, p, Impl::cpu);
  expect_dense_close(msa.attention, want, c, what + " msa");
}

class GpuFp8KvDecode : public ::testing::TestWithParam<CaseShape> {};

TEST_P(GpuFp8KvDecode, MatchesCpuOnTheSameCache) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  for (const auto& [name, seqs] : request_sets(GetParam()))
    for (KvScaleLayout layout : kKvScaleLayouts) {
      const std::string what = name + " (" + kernel_variant(GetParam(), seqs) + "), " + layout_name(layout);
      SCOPED_TRACE(what);
      std::cout << "[ fp8 kv ] " << GetParam().describe() << ": " << what << "\n";
      expect_fp8_matches_cpu(make_fp8_kv_case(gpu_case(GetParam(), seqs), layout), what);
    }
}

INSTANTIATE_TEST_SUITE_P(Shapes, GpuFp8KvDecode, ::testing::ValuesIn(decode_shapes()), shape_name);

// 64 requests, mostly Q = 1, some up to 16, from one key to ~9 selections' worth of blocks.
TEST(GpuFp8KvDecodeBatch, Batch64MixedLengthsMatchesCpu) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  for (const CaseShape& shape : {make_shape(4, 16, 128, 128, 128, 16, 1, 0), make_shape(2, 4, 64, 64, 64, 4, 1, 1)})
    for (KvScaleLayout layout : kKvScaleLayouts) {
      SCOPED_TRACE(shape.describe() + " " + layout_name(layout));
      expect_fp8_matches_cpu(make_fp8_kv_case(gpu_case(shape, mixed_decode_batch64(shape)), layout),
                                    "batch 64, " + layout_name(layout));
    }
}

// 128K contexts, M3's shape: batch 1 at Q = 1 (the key split, the most splits) and a batch
// with a 16-query request (rows per warp); dense mode splits 2048 units of the context.
TEST(GpuFp8KvDecodeLong, LongContextMatchesCpu) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  const CaseShape shape = make_shape(4, 16, 128, 128, 128, 16, 1, 0);
  const int64_t n = 131072;
  for (KvScaleLayout layout : kKvScaleLayouts) {
    SCOPED_TRACE(layout_name(layout));
    expect_fp8_matches_cpu(make_fp8_kv_case(gpu_case(shape, {{.q_len = 1, .k_len = n}}), layout),
                                  "128K Q 1, " + layout_name(layout));
    expect_fp8_matches_cpu(
        make_fp8_kv_case(gpu_case(shape, {{.q_len = 16, .k_len = n - 77}, {.q_len = 1, .k_len = 1},
                                          {.q_len = 3, .k_len = 70001}}),
                         layout),
        "128K mixed, " + layout_name(layout));
  }
}

// On codes whose values a bf16 cache holds exactly (every e4m3 value is a bf16 value) and
// scales of 1, sparse and dense, in both layouts:
//  - rows per warp (the unit widened into a bf16 tile): the bf16 kernels' arithmetic, bitwise
//    their outputs;
//  - key split (MMA fragments built from the codes, attention_decode_fp8.cuh path 1): P V is
//    the bf16 arithmetic, but Q K^T runs in f16 on each query row times a power of two, in a
//    permuted order of the 16 products of each MMA step. The products are exact and the power
//    of two is undone exactly, so the scores differ from the bf16 kernel's only if the tensor
//    cores round the f32 sum of 16 exact products differently for f16 and bf16 inputs or for
//    another order (not documented either way): then by an f32 ulp, which may move a
//    probability across a bf16 rounding boundary (2^-9 relative on one term of P V). Bounds:
//    O within 1e-3 relative (L2), lse within 1e-4, 100x below the CPU tolerances
//    (gpu_checks.h); whether they came out bitwise equal is printed.
TEST(GpuFp8KvDecodeExact, UnitScalesEqualTheBf16Kernels) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  for (const CaseShape& shape : {make_shape(4, 16, 128, 128, 128, 16, 1, 0), make_shape(2, 4, 64, 64, 64, 4, 1, 1)})
    for (const auto& [name, seqs] : request_sets(shape))
      for (KvScaleLayout layout : kKvScaleLayouts) {
        const std::string what = shape.describe() + " " + name + " (" + kernel_variant(shape, seqs) + "), " +
                                 layout_name(layout);
        SCOPED_TRACE(what);
        const Fp8KvCase fc = make_fp8_kv_case(gpu_case(shape, seqs), layout);
        PagedKvCache unit = fc.paged.cache;
        for (Tensor* scale : {&unit.k_scale, &unit.v_scale}) {
          *scale = scale->clone();
          for (float& s : scale->span<float>()) s = 1.0f;
        }
        PagedKvCache bf16 = dequantized_kv_cache(unit);  // the codes' values, exact in bf16
        bf16.k_cache = bf16.k_cache.to(DType::bf16);
        bf16.v_cache = bf16.v_cache.to(DType::bf16);
        const MsaParams& p = fc.c.params();
        const Tensor& cu = fc.paged.cu_seqlens_q;
        const Tensor topk = paged_indexer(fc.c.qi, unit, cu, p, Impl::cpu).topk;
        const bool fragments = kernel_variant(shape, seqs) == "key split";
        const auto expect_equal = [&](const AttentionOutput& fp8, const AttentionOutput& bf16_out,
                                      const std::string& mode) {
          const bool bitwise = bitwise_equal(fp8.o, bf16_out.o) && bitwise_equal(fp8.lse, bf16_out.lse);
          if (!fragments) {
            EXPECT_TRUE(bitwise) << what << " " << mode << ": o / lse differ from the bf16 kernel's";
            return;
          }
          std::cout << "[ fp8 kv ] " << what << " " << mode << ": "
                    << (bitwise ? "bitwise equal" : "not bitwise equal") << " to the bf16 kernel\n";
          EXPECT_LT(relative_error(fp8.o, bf16_out.o), 1e-3) << what << " " << mode << " o";
          EXPECT_LT(max_abs_diff(fp8.lse, bf16_out.lse), 1e-4) << what << " " << mode << " lse";
        };
        expect_equal(paged_sparse_attention(fc.c.q, unit, topk, cu, p, Impl::cuda),
                     paged_sparse_attention(fc.c.q, bf16, topk, cu, p, Impl::cuda), "sparse");
        expect_equal(paged_dense_attention(fc.c.q, unit, cu, p, Impl::cuda),
                     paged_dense_attention(fc.c.q, bf16, cu, p, Impl::cuda), "dense");
      }
}

// The key-split kernel feeds Q to f16 MMAs, each row times a power of two that brings its
// largest magnitude into [2^14, 2^15): rows far beyond f16's range (65504) and far below it
// must give the CPU's results. K is scaled by 2^-16 (codes unchanged, scales 2^-16 smaller) so
// that query heads scaled by 2^16 / 2^20 (|q| up to ~2^22) keep finite, CPU-comparable scores;
// heads scaled by 1 and 2^-20 give near-uniform rows, and zero query rows sit in the same warp
// tile (rows of all four kinds share each MMA).
TEST(GpuFp8KvDecodeFragments, QueryRowsBeyondTheF16Range) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  for (const CaseShape& shape : {make_shape(4, 16, 128, 128, 128, 16, 1, 0), make_shape(2, 4, 64, 64, 64, 4, 1, 1)}) {
    const auto [name, seqs] = request_sets(shape)[shape.group == 16 ? 1 : 2];  // Q 1 / Q <= 4: key split
    ASSERT_EQ(kernel_variant(shape, seqs), "key split");
    for (KvScaleLayout layout : kKvScaleLayouts) {
      const std::string what = shape.describe() + " " + name + ", " + layout_name(layout);
      SCOPED_TRACE(what);
      VarlenCase c = gpu_case(shape, seqs);
      for (float& x : c.k.span<float>()) x = std::ldexp(x, -16);
      const int64_t heads = c.q.size(1), D = c.q.size(2);
      float* q = c.q.data<float>();
      for (int64_t i = 0; i < c.q.numel(); ++i) {
        const int64_t row = i / (heads * D), head = (i / D) % heads;
        const int kind = static_cast<int>(head % 4);
        q[i] = kind == 0 ? std::ldexp(q[i], 16)
               : kind == 1 ? std::ldexp(q[i], 20)
               : kind == 2 ? q[i]
                           : (row % 2 == 0 ? 0.0f : std::ldexp(q[i], -20));
      }
      expect_fp8_matches_cpu(make_fp8_kv_case(c, layout), what);
    }
  }
}

// How far fp8 K/V move the GPU's outputs from the bf16 cache of the original values (the
// CPU's bounds: test_fp8_kv_cache.cpp, Fp8KvMovement), M3's shape at 32K, random keys and
// keys planted along the last query: printed and bounded.
TEST(GpuFp8KvMovement, AgainstTheBf16Cache) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  const CaseShape shape = make_shape(4, 16, 128, 128, 128, 16, 1, 0);
  const std::vector<Seq> seqs = {{.q_len = 1, .k_len = 32768}, {.q_len = 4, .k_len = 9000}};
  for (bool planted : {false, true})
    for (KvScaleLayout layout : kKvScaleLayouts) {
      VarlenCase c = gpu_case(shape, seqs);
      if (planted) {
        plant_aligned_keys(c, 3);
        c.k = bf16_rounded(c.k);
      }
      const Fp8KvCase fc = make_fp8_kv_case(c, layout);
      const MsaParams& p = fc.c.params();
      const Tensor& cu = fc.paged.cu_seqlens_q;
      const MsaOutput fp8 = paged_msa_attention(fc.c.q, fc.c.qi, fc.paged.cache, cu, p, Impl::cuda);
      const MsaOutput bf16 = paged_msa_attention(fc.c.q, fc.c.qi, fc.float_cache, cu, p, Impl::cuda);
      const double o_error = relative_error(fp8.attention.o, bf16.attention.o);
      const double lse_error = max_abs_diff(fp8.attention.lse, bf16.attention.lse);
      std::cout << "[ fp8 kv ] " << (planted ? "3 planted keys" : "random keys") << ", " << layout_name(layout)
                << ": o relative error " << o_error << ", lse max |diff| " << lse_error << " (vs bf16 K/V)\n";
      EXPECT_LT(o_error, planted ? 0.07 : 0.08);
      EXPECT_LT(lse_error, planted ? 0.75 : 0.04);
    }
}

// ---- prefill over fp8 caches (the bf16 copy, fp8_kv_widen.h) ----

// Prefill requests (q_len > 16 in one request at least, so the decode path is not taken):
// lengths 1, B - 1, B + 1, kB + 1, several sequences, chunks over a cached prefix.
std::vector<Seq> prefill_requests(const CaseShape& shape) {
  const int64_t B = shape.params.block_size, kb = B * shape.params.topk;
  return {{.q_len = 40, .k_len = kb + 3 * B + 1}, {.q_len = 1, .k_len = 1},       {.q_len = 17, .k_len = B - 1},
          {.q_len = 130, .k_len = 130},           {.q_len = B + 1, .k_len = 4 * kb + 17},
          {.q_len = 3, .k_len = B + 1}};
}

// Sparse (the CPU indexer's rows), dense and MSA over the fp8 cache (unused slots poisoned), in
// every sparse order the shape takes, against Impl::cpu on what the bf16 copy holds (the cache
// dequantized and rounded to bf16), with the bf16 tolerances of gpu_checks.h; repeat runs bitwise
// equal. Against the exact fp8 semantics (Impl::cpu on the fp8 cache, f32 values) the copy's
// rounding (2^-9 of each value) moved the LSE by up to 0.006 on the H200, beyond the bf16 tests'
// 0.002 (which is why the reference is the rounded cache); O's move is printed and bounded by a
// relative L2 of 1e-2.
TEST(GpuFp8KvPrefill, MatchesCpuOnTheSameCache) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  for (const CaseShape& base : {make_shape(4, 16, 128, 128, 128, 16, 1, 0), make_shape(2, 4, 64, 64, 64, 4, 1, 1),
                                make_shape(2, 8, 128, 64, 128, 8, 1, 1), make_shape(2, 3, 128, 64, 64, 4, 1, 0)})
    for (KvScaleLayout layout : kKvScaleLayouts)
      for (cuda::SparseOrder order :
           {cuda::SparseOrder::automatic, cuda::SparseOrder::kv_major, cuda::SparseOrder::query_major}) {
        const bool query_major_fits = base.head_dim == 128 && base.params.block_size == 128 &&
                                      (base.group == 4 || base.group == 8 || base.group == 16);
        if (order == cuda::SparseOrder::query_major && !query_major_fits) continue;
        CaseShape shape = base;
        shape.params.cuda.sparse_order = order;
        const std::string what = shape.describe() + ", " + layout_name(layout) + ", order " +
                                 cuda::sparse_order_name(order);
        SCOPED_TRACE(what);
        expect_fp8_matches_cpu(make_fp8_kv_case(gpu_case(shape, prefill_requests(shape)), layout), what,
                               Fp8Reference::bf16_copy);
      }
}

// On codes whose values a bf16 cache holds exactly and scales of 1 the copy is exact, so
// prefill over the fp8 cache equals the bf16 kernels on the bf16 cache of the same values,
// bitwise (sparse and dense).
TEST(GpuFp8KvPrefill, UnitScalesEqualTheBf16Kernels) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  const CaseShape shape = make_shape(4, 16, 128, 128, 128, 16, 1, 0);
  Fp8KvCase fc = make_fp8_kv_case(gpu_case(shape, prefill_requests(shape)), KvScaleLayout::per_token_head);
  PagedKvCache& cache = fc.paged.cache;
  for (Tensor* scale : {&cache.k_scale, &cache.v_scale}) {
    float* x = scale->data<float>();
    for (int64_t i = 0; i < scale->numel(); ++i) x[i] = 1.0f;
  }
  PagedKvCache bf16 = cache;
  bf16.k_cache = cache.k_cache.to(DType::f32).to(DType::bf16);  // e4m3 values are bf16 values
  bf16.v_cache = cache.v_cache.to(DType::f32).to(DType::bf16);
  bf16.k_scale = bf16.v_scale = Tensor{};
  const MsaParams& p = fc.c.params();
  const Tensor& cu = fc.paged.cu_seqlens_q;
  const Tensor topk = paged_indexer(fc.c.qi, cache, cu, p, Impl::cpu).topk;
  const AttentionOutput s8 = paged_sparse_attention(fc.c.q, cache, topk, cu, p, Impl::cuda);
  const AttentionOutput s16 = paged_sparse_attention(fc.c.q, bf16, topk, cu, p, Impl::cuda);
  EXPECT_TRUE(bitwise_equal(s8.o, s16.o)) << "sparse o";
  EXPECT_TRUE(bitwise_equal(s8.lse, s16.lse)) << "sparse lse";
  const AttentionOutput d8 = paged_dense_attention(fc.c.q, cache, cu, p, Impl::cuda);
  const AttentionOutput d16 = paged_dense_attention(fc.c.q, bf16, cu, p, Impl::cuda);
  EXPECT_TRUE(bitwise_equal(d8.o, d16.o)) << "dense o";
  EXPECT_TRUE(bitwise_equal(d8.lse, d16.lse)) << "dense lse";
}

}  // namespace
}  // namespace msa::testing
