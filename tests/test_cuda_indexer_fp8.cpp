// The CUDA fp8 index scan (MsaParams::index_compute fp8: producer_tile_scan_kernel<true>, Di = B = 128)
// against the CPU with fp8 compute: selection rows compared as sets, differing blocks only as
// near-ties of the fp8 block maxima (the quantize-dequantized inputs); the selected LSE, which
// stays exact, against an in-test f64 recomputation over the GPU's rows; repeated runs bitwise
// identical. Split tiles (few tiles), fused tiles (many), index heads 4 (M3), 1 and 3, init +
// 2 local blocks, topk 32 (the largest list pitch); a 32K context; paged bf16 and fp8 caches,
// for prefills and for decode-sized batches (fp8 compute runs the tile scan for every q_len);
// bad input. Skipped without a CUDA device; ctest label "gpu".
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <string>
#include <vector>

#include "gpu_checks.h"
#include "index_scan_cases.h"

namespace msa::testing {
namespace {

// fp8 block maxima: the kernel accumulates e4m3 products on the tensor cores (Hopper's fp8
// MMA accumulator keeps fewer bits than f32: an fp8 block-max prototype measured up to 6.6e-4
// relative error on block maxima against f64; bench/results/history.md) and rounds
// k_scale * acc and q_scale * max to f32. So blocks within 2e-3 (3x that) of the k-th best
// may swap, and more rows than with bf16 may show such a swap.
constexpr double kFp8TieTolerance = 2e-3;
constexpr double kFp8MaxDifferingRowFraction = 0.05;

MsaParams fp8(const MsaParams& params) { return with_compute(params, IndexCompute::fp8); }

// The case with qi and ki replaced by their fp8 round trips (f64): what fp8 compute ranks by.
DoubleInputs fp8_ranking_inputs(const VarlenCase& c) {
  VarlenCase rounded = c;
  rounded.qi = fp8_round_trip(c.qi);
  rounded.ki = fp8_round_trip(c.ki);
  return DoubleInputs(rounded);
}

// Rows `got` against `want` (both fp8 compute) as sets with the fp8 tie tolerance.
void expect_fp8_selection_close(const Tensor& got, const Tensor& want, const VarlenCase& c,
                                const std::string& what) {
  const double differing =
      expect_same_selection(got, want, c, fp8_ranking_inputs(c), kFp8TieTolerance);
  std::cout << "[ selection ] " << what << " " << c.shape.describe() << ": " << differing * 100
            << "% of rows differ from the cpu\n";
  EXPECT_LE(differing, kFp8MaxDifferingRowFraction) << what;
}

// The exact selected LSE of the GPU's own rows, recomputed in f64 on (at most ~4096 sampled)
// rows; prints the worst error and fails on the first few bad rows.
void expect_exact_lse_of_rows(const IndexerOutput& got, const VarlenCase& c,
                              const std::string& what) {
  ASSERT_TRUE(got.lse.defined()) << what;
  const DoubleInputs in(c);
  const int64_t heads = got.topk.size(0), rows = got.topk.size(1);
  const int64_t step = std::max<int64_t>(1, heads * rows / 4096);
  const double index_scale = 1.0 / std::sqrt(static_cast<double>(c.shape.index_dim));
  double worst = 0;
  int failures = 0;
  for (int64_t flat = 0; flat < heads * rows && failures < 5; flat += step) {
    const int64_t h = flat / rows, row = flat % rows;
    const double want = selected_index_lse(c, in, selection_row(got.topk, h, row), row, h,
                                           index_scale, c.params().temperature);
    const double value = got.lse.get(flat);
    const double error = std::isinf(want) && value == want ? 0.0 : std::fabs(value - want);
    worst = std::max(worst, std::isnan(error) ? INFINITY : error);
    if (!(error <= kLseAbsolute + kLseRelative * std::fabs(want))) {
      ADD_FAILURE() << what << ": lse of head " << h << " row " << row << " is " << value
                    << ", want " << want << " (exact scores over the GPU's row "
                    << row_string(selection_row(got.topk, h, row)) << ")";
      ++failures;
    }
  }
  std::cout << "[ lse ] " << what << ": max abs error " << worst << " over every " << step
            << "th row\n";
}

// CUDA (twice) vs `cpu`, the CPU's fp8-compute rows of the same case.
// max_chunk_queries > 0: the ranking in passes of at most that many queries.
void expect_cuda_fp8_matches(const VarlenCase& c, const IndexerOutput& cpu, const std::string& what,
                             int64_t max_chunk_queries = 0) {
  MsaParams params = fp8(c.params());
  params.cuda.max_chunk_queries = max_chunk_queries;
  const IndexerOutput first = indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, params, Impl::cuda);
  const IndexerOutput second = indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, params, Impl::cuda);
  expect_fp8_selection_close(first.topk, cpu.topk, c, what);
  expect_exact_lse_of_rows(first, c, what);
  EXPECT_TRUE(bitwise_equal(first.topk, second.topk)) << what << ": repeated runs differ (rows)";
  EXPECT_TRUE(bitwise_equal(first.lse, second.lse)) << what << ": repeated runs differ (lse)";
}

// The CPU reference with fp8 compute (f64 plain loops: small cases).
void expect_matches_fp8_reference(const VarlenCase& c, const std::string& what) {
  const IndexerOutput cpu = indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, fp8(c.params()), Impl::reference);
  expect_cuda_fp8_matches(c, cpu, what);
}

// Large cases: the f64 reference would take minutes, so the optimised CPU indexer with exact
// compute on the fp8 round trips of qi and ki (as f32: each dequantized value rounded once,
// ~6e-8 relative, far inside the fp8 tie tolerance) gives the expected rows.
// Each entry of max_chunk_queries runs the CUDA indexer once more against the same rows.
void expect_matches_cpu_on_rounded_inputs(const VarlenCase& c, const std::string& what,
                                          const std::vector<int64_t>& max_chunk_queries = {0}) {
  const IndexerOutput cpu =
      indexer(fp8_round_trip(c.qi, DType::f32), fp8_round_trip(c.ki, DType::f32),
              c.cu_seqlens_q, c.cu_seqlens_k, c.params(), Impl::cpu);
  for (int64_t chunk : max_chunk_queries)
    expect_cuda_fp8_matches(c, cpu, chunk > 0 ? what + " in passes of " + std::to_string(chunk) : what, chunk);
}

// A case's keys paged as a cache of bf16 values (what both quantizers then see).
PagedRequests bf16_paged(const VarlenCase& c) {
  PagedRequests paged = page_varlen_case(c);
  paged.cache.index_key_cache = bf16_rounded(paged.cache.index_key_cache);
  return paged;
}

// The same cache as an fp8 index-key cache (codes + scales quantized on the host).
PagedKvCache fp8_cache_of(const PagedKvCache& cache) {
  PagedKvCache fp8_cache = cache;
  const QuantizedIndexKeys keys = quantize_index_keys_fp8(cache.index_key_cache);
  fp8_cache.index_key_cache = keys.codes;
  fp8_cache.index_key_scale = keys.scale;
  return fp8_cache;
}

// CUDA on the bf16 cache (quantized on the device) and on its fp8 copy (read as stored),
// each twice, against the rows `want`. Both hold the same codes (the device quantizer's bytes
// equal the host's), so their rows are equal too.
void expect_paged_caches_match(const VarlenCase& c, const PagedRequests& paged, const Tensor& want,
                               const std::string& what) {
  const MsaParams p = fp8(c.params());
  const PagedKvCache fp8_cache = fp8_cache_of(paged.cache);
  Tensor rows[2];
  for (const bool quantized : {false, true}) {
    const PagedKvCache& cache = quantized ? fp8_cache : paged.cache;
    const std::string label = what + (quantized ? ", paged fp8 cache" : ", paged bf16 cache");
    rows[quantized] = paged_indexer(c.qi, cache, paged.cu_seqlens_q, p, Impl::cuda).topk;
    const Tensor again = paged_indexer(c.qi, cache, paged.cu_seqlens_q, p, Impl::cuda).topk;
    expect_fp8_selection_close(rows[quantized], want, c, label);
    EXPECT_TRUE(bitwise_equal(rows[quantized], again)) << label << ": repeated runs differ";
  }
  EXPECT_TRUE(bitwise_equal(rows[0], rows[1])) << what << ": the two caches' rows differ";
}

class GpuIndexerFp8 : public ::testing::TestWithParam<CaseShape> {};

// Edge lengths (1, B-1, B, B+1, kB-1, kB, kB+1, kB + 5.5 B), whole and suffix prefills: few
// tiles, so the split mode runs (chunks of blocks, ragged chain tails).
TEST_P(GpuIndexerFp8, EdgeLengthsSplitTilesMatchReference) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  const MsaParams& p = GetParam().params;
  expect_matches_fp8_reference(gpu_case(GetParam(), mixed_sequences(edge_lengths(p.block_size, p.topk))),
                               "edge lengths");
}

// The edge lengths plus 320 chunked prefills: the fused mode (lists in shared memory), whole
// chains and every tail length.
TEST_P(GpuIndexerFp8, ManySequencesFusedTilesMatchCpu) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  expect_matches_cpu_on_rounded_inputs(gpu_case(GetParam(), edge_and_many_prefills(GetParam().params)),
                                       "many sequences");
}

INSTANTIATE_TEST_SUITE_P(Shapes, GpuIndexerFp8,
                         ::testing::Values(index_shape(4, 1, 0),       // M3
                                           index_shape(1, 1, 0),       // 256 queries per tile
                                           index_shape(3, 1, 0),       // 85 queries = 255 rows
                                           index_shape(3, 2, 1),       // init + 2 local blocks
                                           index_shape(4, 1, 0, 32)),  // list pitch 31
                         shape_name);

// A 32K context in M3's shape: 20000 queries (one pass; and passes of 6000 queries, whose
// late ones take wave-fitted chunks: pass_chunks) and the last 300 queries alone (split tiles
// over 8-block chunks).
TEST(GpuIndexerFp8Long, Context32KMatchesCpu) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  const CaseShape shape = index_shape(4, 1, 0);
  expect_matches_cpu_on_rounded_inputs(gpu_case(shape, {{.q_len = 20000, .k_len = 32768}}), "32K",
                                       {0, 6000});
  expect_matches_cpu_on_rounded_inputs(gpu_case(shape, {{.q_len = 300, .k_len = 32768}}), "32K split");
}

// Paged keys (page-table reads by the producer warpgroup), bf16 and fp8 caches: edge lengths
// and a 3000-key prefill against the reference's rows.
TEST(GpuIndexerFp8Paged, Bf16AndFp8CachesMatchReference) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  const CaseShape shape = index_shape(4, 1, 0);
  std::vector<Seq> seqs = mixed_sequences(edge_lengths(128, 16));
  seqs.push_back({.q_len = 300, .k_len = 3000});
  const VarlenCase c = gpu_case(shape, seqs);
  const PagedRequests paged = bf16_paged(c);
  const Tensor want =
      paged_indexer(c.qi, paged.cache, paged.cu_seqlens_q, fp8(c.params()), Impl::reference).topk;
  expect_paged_caches_match(c, paged, want, "prefills");
}

// Decode-sized batches (every q_len <= 16) run the same tile scan with fp8 compute, from both
// caches. Expected: the optimised CPU, exact compute, on the fp8 round trips (f32) of qi and
// the cache (contexts up to 18K: the f64 reference would be slow).
TEST(GpuIndexerFp8Paged, DecodeSizedBatchMatchesCpu) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  const CaseShape shape = index_shape(4, 1, 0);
  const VarlenCase c = gpu_case(shape, mixed_decode_batch64(shape));
  const PagedRequests paged = bf16_paged(c);
  PagedKvCache rounded = paged.cache;
  rounded.index_key_cache = fp8_round_trip(paged.cache.index_key_cache, DType::f32);
  const Tensor want = paged_indexer(fp8_round_trip(c.qi, DType::f32), rounded, paged.cu_seqlens_q,
                                    c.params(), Impl::cpu).topk;
  expect_paged_caches_match(c, paged, want, "decode-sized batch");
}

TEST(GpuIndexerFp8Errors, UnsupportedShapesAndInputsAreClearErrors) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  const auto expect_error = [](const std::function<void()>& body, const std::string& argument,
                               const std::string& what) {
    const std::string message = error_of(body);
    EXPECT_NE(message.find(argument), std::string::npos) << what << ": " << message;
  };
  // Di 64 and B 64: the fp8 scan is Di = B = 128 only.
  const VarlenCase di64 = gpu_case(make_shape(4, 1, 64, 64, 128, 16, 1, 0), {{.q_len = 300, .k_len = 3000}});
  expect_error([&] { indexer(di64.qi, di64.ki, di64.cu_seqlens_q, di64.cu_seqlens_k, fp8(di64.params()), Impl::cuda); },
               "index_compute", "Di 64");
  const VarlenCase b64 = gpu_case(make_shape(4, 1, 64, 128, 64, 16, 1, 0), {{.q_len = 300, .k_len = 3000}});
  expect_error([&] { indexer(b64.qi, b64.ki, b64.cu_seqlens_q, b64.cu_seqlens_k, fp8(b64.params()), Impl::cuda); },
               "index_compute", "B 64");
  // An fp8 cache has no exact selected LSE on CUDA; an fp4 cache no fp8 compute.
  const VarlenCase c = gpu_case(index_shape(4, 1, 0), {{.q_len = 300, .k_len = 3000}});
  const PagedRequests paged = page_varlen_case(c);
  const PagedKvCache fp8_cache = fp8_cache_of(paged.cache);
  PagedKvCache fp4_cache = paged.cache;
  const QuantizedIndexKeys keys4 = quantize_index_keys_fp4(paged.cache.index_key_cache);
  fp4_cache.index_key_cache = keys4.codes;
  fp4_cache.index_key_scale = keys4.scale;
  expect_error([&] { paged_indexer(c.qi, fp8_cache, paged.cu_seqlens_q, fp8(c.params()), Impl::cuda, true); },
               "lse_out", "fp8 cache with lse");
  expect_error([&] { paged_indexer(c.qi, fp4_cache, paged.cu_seqlens_q, fp8(c.params()), Impl::cuda); },
               "index_compute", "fp4 cache");
}

}  // namespace
}  // namespace msa::testing
