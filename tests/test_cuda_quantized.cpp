// fp8 / fp4 index-key caches on the GPU (msa/quantized_index_keys.h): the device quantizer
// against the CPU quantizer (same bytes), and the CUDA decode indexer reading the codes
// directly against the CPU indexer on the same cache (both score the dequantized keys):
// Q = 1..16, batches of different lengths around B and k*B, long contexts, poisoned outputs
// (the glue fills topk with 0x7f before the kernels run), repeatability; and the clear
// errors for what the CUDA path does not do (prefill, the selected LSE). Skipped (not
// failed) where no CUDA device is present; ctest label "gpu".
#include <gtest/gtest.h>

#include <functional>
#include <iostream>

#include "cuda/common/device_buffer.h"
#include "msa/cuda/quantize.h"
#include "gpu_checks.h"
#include "quantized_cases.h"

namespace msa::testing {
namespace {

constexpr IndexKeyFormat kFormats[] = {IndexKeyFormat::fp8, IndexKeyFormat::fp4};

// Selection with gpu_checks.h's tolerances, as for bf16 keys: the GPU scores dequantized keys
// exactly (f16 operands, f32 accumulation; fp8 applies the f32 token scale to the f32 score),
// the CPU in f32 in another order (~1e-6 relative), so only blocks that close to the k-th
// best may swap.
void expect_rows_close(const Tensor& got, const Tensor& want, const QuantizedPagedCase& qc,
                       const std::string& what) {
  expect_selection_close(got, want, qc.c, DoubleInputs(qc.c), what);
}

// Decode requests (Q = 1..16) at lengths around B and k * B, and a few longer ones.
std::vector<Seq> decode_sequences(const CaseShape& shape) {
  const int64_t B = shape.params.block_size, kb = B * shape.params.topk;
  return {{.q_len = 1, .k_len = kb + 3 * B + 1}, {.q_len = 16, .k_len = kb + 2 * B - 1},
          {.q_len = 2, .k_len = 2},              {.q_len = 8, .k_len = 5 * kb + 17},
          {.q_len = 16, .k_len = 16},            {.q_len = 3, .k_len = kb + B / 2 + 7},
          {.q_len = 1, .k_len = B - 1},          {.q_len = 1, .k_len = B},
          {.q_len = 1, .k_len = B + 1},          {.q_len = 4, .k_len = kb - 1},
          {.q_len = 5, .k_len = kb},             {.q_len = 7, .k_len = kb + 1},
          {.q_len = 12, .k_len = 2 * kb + B},    {.q_len = 1, .k_len = 9 * kb + 3},
          {.q_len = 16, .k_len = 3 * kb + 2 * B + 5}};
}

std::vector<CaseShape> decode_shapes() {
  // make_shape(Hkv, G, D, Di, B, topk, local, init)
  return {make_shape(4, 16, 128, 128, 128, 16, 1, 0),  // MiniMax-M3
          make_shape(2, 4, 64, 64, 64, 4, 1, 1), make_shape(1, 8, 64, 128, 64, 8, 2, 1),
          make_shape(4, 2, 64, 64, 128, 32, 1, 1)};
}

// ---- device quantizer ----

Tensor download_as(const cuda::DeviceBuffer& buffer, const Shape& shape, DType dtype) {
  Tensor out = Tensor::zeros(shape, dtype);
  buffer.download(out.raw(), out.nbytes());
  return out;
}

TEST(GpuQuantize, DeviceQuantizerWritesTheCpuBytes) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  for (int64_t dim : {int64_t{16}, int64_t{64}, int64_t{128}}) {
    const int64_t tokens = 3001;
    Tensor keys = random_normal({tokens, dim});
    float* x = keys.data<float>();
    for (int64_t t = 0; t < tokens; ++t)  // magnitudes 2^-20 .. 2^12, zero rows, huge values
      for (int64_t d = 0; d < dim; ++d)
        x[t * dim + d] = t % 97 == 0 ? 0.0f : x[t * dim + d] * std::ldexp(1.0f, int(t % 33) - 20);
    x[5 * dim + 1] = 30000.0f;
    keys = keys.to(DType::bf16);
    cuda::DeviceBuffer d_keys(keys.nbytes());
    d_keys.upload(keys.raw(), keys.nbytes());
    for (IndexKeyFormat format : kFormats) {
      SCOPED_TRACE(format_name(format) + " dim " + std::to_string(dim));
      const QuantizedIndexKeys want = quantize_index_keys(keys, format);
      cuda::DeviceBuffer codes(want.codes.nbytes()), scales(want.scale.nbytes());
      codes.fill_bytes(0xa5);
      scales.fill_bytes(0xa5);
      cuda::quantize_index_keys(static_cast<const uint16_t*>(d_keys.get()), tokens, dim,
                                format == IndexKeyFormat::fp8 ? cuda::KeyFormat::fp8
                                                              : cuda::KeyFormat::fp4,
                                codes.as<uint8_t>(), scales.as<uint8_t>(), nullptr);
      cuda::synchronize();
      const Tensor got_codes = download_as(codes, want.codes.shape(), want.codes.dtype());
      const Tensor got_scale = download_as(scales, want.scale.shape(), want.scale.dtype());
      EXPECT_EQ(first_difference(got_codes, want.codes), -1) << "codes: first differing byte";
      EXPECT_EQ(first_difference(got_scale, want.scale), -1) << "scales: first differing byte";
    }
  }
}

// ---- the decode indexer on fp8 / fp4 caches ----

// The indexer's rows on qc's quantized paged cache.
Tensor decode_rows(const QuantizedPagedCase& qc, Impl impl) {
  return paged_indexer(qc.c.qi, qc.paged.cache, qc.paged.cu_seqlens_q, qc.c.params(), impl).topk;
}

// The CUDA rows against the CPU's on an fp8 and an fp4 cache of fresh (shape, seqs) cases.
void expect_decode_rows_match_cpu(const CaseShape& shape, const std::vector<Seq>& seqs,
                                  const std::string& what) {
  for (IndexKeyFormat format : kFormats) {
    SCOPED_TRACE(format_name(format));
    const QuantizedPagedCase qc = make_quantized_paged_case(gpu_case(shape, seqs), format);
    expect_rows_close(decode_rows(qc, Impl::cuda), decode_rows(qc, Impl::cpu), qc,
                      format_name(format) + " " + what);
  }
}

TEST(GpuQuantizedDecode, MatchesCpuOnTheSameCache) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  for (const CaseShape& shape : decode_shapes())
    for (IndexKeyFormat format : kFormats) {
      SCOPED_TRACE(format_name(format) + " " + shape.describe());
      const QuantizedPagedCase qc =
          make_quantized_paged_case(gpu_case(shape, decode_sequences(shape)), format);
      const Tensor gpu = decode_rows(qc, Impl::cuda);
      expect_rows_close(gpu, decode_rows(qc, Impl::cpu), qc, format_name(format));
      EXPECT_TRUE(bitwise_equal(gpu, decode_rows(qc, Impl::cuda))) << "repeated runs differ";
    }
}

// Requests that each get one chunk (264 requests: at least 2 CTAs per SM of rows alone),
// two of them long (101 and 77 blocks, Q = 1 and 16): their CTAs run through the shared
// memory rings many times (the stage ring of 5 / 8 blocks, the page-id ring of 32),
// at B = 128 (two m-tiles per warp) and B = 64 (one).
TEST(GpuQuantizedDecode, LongChunksWrapTheRings) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  for (const CaseShape& shape : {make_shape(4, 1, 64, 128, 128, 16, 1, 0),
                                 make_shape(2, 1, 64, 64, 64, 8, 1, 1)}) {
    SCOPED_TRACE(shape.describe());
    const int64_t B = shape.params.block_size;
    std::vector<Seq> seqs;
    for (int64_t i = 0; i < 262; ++i) seqs.push_back({.q_len = 1, .k_len = 1 + (i * 37) % (3 * B)});
    seqs.push_back({.q_len = 1, .k_len = 100 * B + 5});
    seqs.push_back({.q_len = 16, .k_len = 77 * B - 3});
    expect_decode_rows_match_cpu(shape, seqs, "long chunks");
  }
}

// 64 requests, mostly Q = 1, some Q up to 16, from one key to ~9 selections' worth of
// blocks (as test_cuda_ops.cpp's Batch64MixedLengthsMatchesCpu), M3's shape.
TEST(GpuQuantizedDecode, Batch64MixedLengthsMatchesCpu) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  const CaseShape shape = make_shape(4, 16, 128, 128, 128, 16, 1, 0);
  expect_decode_rows_match_cpu(shape, mixed_decode_batch64(shape), "batch 64");
}

// One 128K-token request, Q = 1 and Q = 16: 1024 blocks split over many CTAs.
TEST(GpuQuantizedDecode, LongContextMatchesCpu) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  expect_decode_rows_match_cpu(make_shape(4, 16, 128, 128, 128, 16, 1, 0),
                               {{.q_len = 1, .k_len = 131072}, {.q_len = 16, .k_len = 131072 - 77}},
                               "128K");
}

// Fraction of (head, row) selection rows whose valid block sets differ.
double changed_fraction(const Tensor& rows, const Tensor& reference) {
  int64_t changed = 0;
  const int64_t heads = rows.size(0), total = rows.size(1);
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t r = 0; r < total; ++r)
      changed += valid_ids(selection_row(rows, h, r)) != valid_ids(selection_row(reference, h, r));
  return static_cast<double>(changed) / static_cast<double>(heads * total);
}

// Index keys of blocks 3, 10, 17, ... (`count` of them per sequence) times 4 (exact in any
// float format): those blocks' maxima stand far above every other block's, a margin no
// quantization error crosses.
std::vector<int32_t> plant_blocks(VarlenCase& c, int count) {
  std::vector<int32_t> planted;
  for (int j = 0; j < count; ++j) planted.push_back(3 + 7 * j);
  Tensor keys = c.ki.to(DType::f32);
  const int64_t B = c.params().block_size, Di = keys.size(1);
  float* data = keys.data<float>();
  for (size_t b = 0; b < c.seqs.size(); ++b) {
    EXPECT_LT((planted.back() + 2) * B, c.seqs[b].k_len - c.seqs[b].q_len) << "planted blocks past the queries";
    for (int32_t block : planted)
      for (int64_t i = (c.k_start[b] + block * B) * Di; i < (c.k_start[b] + (block + 1) * B) * Di; ++i)
        data[i] *= 4.0f;
  }
  c.ki = keys.to(c.ki.dtype());
  return planted;
}

// The selections on quantized keys against those on the original bf16 keys. On random
// keys the 16th and 17th block maxima are near ties that quantization moves: reported, not
// asserted. With 15 blocks planted far above the rest, every row must select them (and its
// local block) in every format.
TEST(GpuQuantizedDecode, SelectionsAgainstBf16Keys) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  const CaseShape shape = make_shape(4, 16, 128, 128, 128, 16, 1, 0);
  const std::vector<Seq> seqs = {{.q_len = 4, .k_len = 65536}, {.q_len = 1, .k_len = 20000}};
  VarlenCase c = gpu_case(shape, seqs);
  for (bool planted_case : {false, true}) {
    SCOPED_TRACE(planted_case ? "planted blocks" : "random keys");
    std::vector<int32_t> planted;
    if (planted_case) planted = plant_blocks(c, 15);
    const PagedRequests plain = page_varlen_case(c);
    const Tensor bf16_rows =
        paged_indexer(c.qi, plain.cache, plain.cu_seqlens_q, c.params(), Impl::cuda).topk;
    if (planted_case) {  // the planting worked: every bf16 row holds the planted blocks
      for (int64_t h = 0; h < bf16_rows.size(0); ++h)
        for (int64_t r = 0; r < bf16_rows.size(1); ++r) {
          const std::set<int32_t> ids = valid_ids(selection_row(bf16_rows, h, r));
          for (int32_t block : planted) EXPECT_EQ(ids.count(block), 1u) << "head " << h << " row " << r << " block " << block;
        }
    }
    for (IndexKeyFormat format : kFormats) {
      const double fraction = changed_fraction(decode_rows(make_quantized_paged_case(c, format), Impl::cuda), bf16_rows);
      std::cout << "[ selection ] " << (planted_case ? "planted blocks, " : "random keys, ")
                << format_name(format) << " vs bf16 keys: " << fraction * 100
                << "% of rows select a different set\n";
      if (planted_case) EXPECT_EQ(fraction, 0.0) << format_name(format);
    }
  }
}

// ---- what the CUDA path rejects, and the path it allows ----

TEST(GpuQuantizedErrors, PrefillAndSelectedLseAreRejectedClearly) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  const CaseShape shape = make_shape(2, 4, 64, 64, 64, 4, 1, 0);
  const int64_t kb = 64 * 4;
  for (IndexKeyFormat format : kFormats) {
    SCOPED_TRACE(format_name(format));
    const QuantizedPagedCase prefill =
        make_quantized_paged_case(gpu_case(shape, {{.q_len = 40, .k_len = 3 * kb}}), format);
    expect_error(
        [&] {
          paged_indexer(prefill.c.qi, prefill.paged.cache, prefill.paged.cu_seqlens_q,
                        prefill.c.params(), Impl::cuda);
        },
        "supported for decode (q_len <= 16) only");
    const QuantizedPagedCase decode =
        make_quantized_paged_case(gpu_case(shape, {{.q_len = 2, .k_len = 3 * kb}}), format);
    expect_error(
        [&] {
          paged_indexer(decode.c.qi, decode.paged.cache, decode.paged.cu_seqlens_q,
                        decode.c.params(), Impl::cuda, /*want_lse=*/true);
        },
        "argument 'lse_out'");
    // topk == local blocks: nothing is ranked, no key is read; prefill is then fine.
    MsaParams only_local = prefill.c.params();
    only_local.topk = 1;
    const auto rows = [&](Impl impl) {
      return paged_indexer(prefill.c.qi, prefill.paged.cache, prefill.paged.cu_seqlens_q,
                           only_local, impl)
          .topk;
    };
    EXPECT_TRUE(bitwise_equal(rows(Impl::cuda), rows(Impl::cpu)));
  }
}

}  // namespace
}  // namespace msa::testing
