// The CUDA ops (Impl::cuda) against the optimised CPU ops on the same bf16-rounded inputs:
// the shape matrix of the foundation tests restricted to what the kernels support, paged
// caches, decode, long contexts, empty rows and run-to-run determinism. Skipped (not
// failed) where no CUDA device is present; ctest label "gpu".
#include <gtest/gtest.h>

#include <cstdlib>
#include <iostream>
#include <list>

#include "gpu_checks.h"

namespace msa::testing {
namespace {

std::vector<CaseShape> gpu_shapes() {
  // make_shape(Hkv, G, D, Di, B, topk, local, init)
  return {
      make_shape(4, 16, 128, 128, 128, 16, 1, 0),  // MiniMax-M3
      make_shape(1, 1, 64, 64, 64, 2, 1, 0),
      make_shape(2, 2, 128, 64, 64, 4, 1, 1),
      make_shape(4, 4, 64, 128, 128, 4, 2, 0),
      make_shape(1, 8, 128, 128, 64, 8, 2, 1),
      make_shape(2, 16, 64, 64, 128, 4, 1, 0),
      make_shape(4, 2, 128, 128, 64, 32, 1, 1),
      // D = B = 128 with groups that pack several queries (and part of one) per 64-row tile
      // of the wgmma sparse kernel.
      make_shape(2, 4, 128, 64, 128, 4, 1, 1),
      make_shape(1, 3, 128, 64, 128, 3, 1, 0),
  };
}

class GpuMatrix : public ::testing::TestWithParam<CaseShape> {
 protected:
  VarlenCase make() const {
    const MsaParams& p = GetParam().params;
    return gpu_case(GetParam(), mixed_sequences(edge_lengths(p.block_size, p.topk)));
  }
};

TEST_P(GpuMatrix, IndexerMatchesCpu) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  const VarlenCase c = make();
  const DoubleInputs in(c);
  const auto run = [&](Impl impl) {
    return indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), impl);
  };
  expect_indexer_close(run(Impl::cuda), run(Impl::cpu), c, in, "varlen");
}

TEST_P(GpuMatrix, SparseAndDenseAttentionMatchCpu) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  const VarlenCase c = make();
  const Tensor topk = indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), Impl::cpu).topk;
  const auto sparse = [&](Impl impl) {
    return sparse_attention(c.q, c.k, c.v, topk, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), impl);
  };
  const auto dense = [&](Impl impl) {
    return dense_attention(c.q, c.k, c.v, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), impl);
  };
  expect_attention_close(sparse(Impl::cuda), sparse(Impl::cpu), "sparse");
  expect_attention_close(dense(Impl::cuda), dense(Impl::cpu), "dense");
}

TEST_P(GpuMatrix, PagedOpsMatchCpu) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  const VarlenCase c = make();
  const DoubleInputs in(c);
  const PagedRequests paged = page_varlen_case(c);
  const MsaParams& p = c.params();
  const auto index = [&](Impl impl) {
    return paged_indexer(c.qi, paged.cache, paged.cu_seqlens_q, p, impl, /*want_lse=*/true);
  };
  const IndexerOutput cpu_rows = index(Impl::cpu);
  expect_indexer_close(index(Impl::cuda), cpu_rows, c, in, "paged");
  const auto sparse = [&](Impl impl) {
    return paged_sparse_attention(c.q, paged.cache, cpu_rows.topk, paged.cu_seqlens_q, p, impl);
  };
  const auto dense = [&](Impl impl) {
    return paged_dense_attention(c.q, paged.cache, paged.cu_seqlens_q, p, impl);
  };
  expect_attention_close(sparse(Impl::cuda), sparse(Impl::cpu), "paged sparse");
  expect_attention_close(dense(Impl::cuda), dense(Impl::cpu), "paged dense");
}

TEST_P(GpuMatrix, RepeatedRunsAreBitwiseIdentical) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  const VarlenCase c = make();
  const auto index = [&] {
    return indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), Impl::cuda);
  };
  const IndexerOutput first = index(), second = index();
  EXPECT_TRUE(bitwise_equal(first.topk, second.topk));
  EXPECT_TRUE(bitwise_equal(first.lse, second.lse));
  const auto sparse = [&] {
    return sparse_attention(c.q, c.k, c.v, first.topk, c.cu_seqlens_q, c.cu_seqlens_k, c.params(),
                            Impl::cuda);
  };
  const AttentionOutput a = sparse(), b = sparse();
  EXPECT_TRUE(bitwise_equal(a.o, b.o));
  EXPECT_TRUE(bitwise_equal(a.lse, b.lse));
}

INSTANTIATE_TEST_SUITE_P(Shapes, GpuMatrix, ::testing::ValuesIn(gpu_shapes()), shape_name);

// Decode / multi-token prediction: Q = 1..16 new tokens per request, mixed lengths.
TEST(GpuDecode, PagedDecodeMatchesCpu) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  for (const CaseShape& shape :
       {make_shape(4, 16, 128, 128, 128, 16, 1, 0), make_shape(2, 4, 64, 64, 64, 4, 1, 1)}) {
    SCOPED_TRACE(shape.describe());
    const int64_t B = shape.params.block_size, kb = B * shape.params.topk;
    const VarlenCase c = gpu_case(shape, {{.q_len = 1, .k_len = kb + 3 * B + 1},
                                          {.q_len = 16, .k_len = kb + 2 * B - 1},
                                          {.q_len = 2, .k_len = 2},
                                          {.q_len = 8, .k_len = 5 * kb + 17},
                                          {.q_len = 16, .k_len = 16},
                                          {.q_len = 3, .k_len = kb + B / 2 + 7}});
    const DoubleInputs in(c);
    const PagedRequests paged = page_varlen_case(c);
    const MsaParams& p = c.params();
    const IndexerOutput cpu_rows =
        paged_indexer(c.qi, paged.cache, paged.cu_seqlens_q, p, Impl::cpu, true);
    expect_indexer_close(paged_indexer(c.qi, paged.cache, paged.cu_seqlens_q, p, Impl::cuda, true),
                         cpu_rows, c, in, "decode");
    expect_attention_close(
        paged_sparse_attention(c.q, paged.cache, cpu_rows.topk, paged.cu_seqlens_q, p, Impl::cuda),
        paged_sparse_attention(c.q, paged.cache, cpu_rows.topk, paged.cu_seqlens_q, p, Impl::cpu),
        "decode sparse");
    expect_attention_close(paged_dense_attention(c.q, paged.cache, paged.cu_seqlens_q, p, Impl::cuda),
                           paged_dense_attention(c.q, paged.cache, paged.cu_seqlens_q, p, Impl::cpu),
                           "decode dense");
  }
}

// The bf16 decode index scan's compile-time variants (indexer_decode_bf16.cuh) on the
// shapes the other decode tests miss: Di 128 with B 64 (one m-tile per warp, half-block
// copies) and Di 64 with B 128, each through the contiguous (paged: token stride Di) and
// the strided (varlen: token stride Hi Di) copy. Q = 1, 2, 3, 6, 8, 16 with 4 index heads:
// 4 .. 64 rows, 1, 1, 2, 3, 4 n-tiles (and two row tiles), over several blocks per CTA.
TEST(GpuDecode, Bf16ScanVariantsMatchCpu) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  for (const CaseShape& shape :
       {make_shape(4, 2, 64, 128, 64, 8, 1, 1), make_shape(4, 2, 64, 64, 128, 4, 1, 0)}) {
    SCOPED_TRACE(shape.describe());
    const int64_t B = shape.params.block_size, kb = B * shape.params.topk;
    const VarlenCase c = gpu_case(shape, {{.q_len = 1, .k_len = 40 * kb + 3},
                                          {.q_len = 2, .k_len = 9 * kb + B / 2},
                                          {.q_len = 3, .k_len = 3 * kb + 1},
                                          {.q_len = 6, .k_len = 17 * kb + B - 1},
                                          {.q_len = 8, .k_len = kb + 2 * B},
                                          {.q_len = 16, .k_len = 5 * kb + 7}});
    const DoubleInputs in(c);
    const MsaParams& p = c.params();
    const IndexerOutput cpu_rows = indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, p, Impl::cpu);
    const IndexerOutput varlen = indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, p, Impl::cuda);
    expect_indexer_close(varlen, cpu_rows, c, in, "decode scan varlen");
    const PagedRequests paged = page_varlen_case(c);
    const IndexerOutput paged_rows =
        paged_indexer(c.qi, paged.cache, paged.cu_seqlens_q, p, Impl::cuda);
    expect_indexer_close(paged_rows, cpu_rows, c, in, "decode scan paged");
    EXPECT_TRUE(bitwise_equal(paged_rows.topk, varlen.topk));  // same scores, either copy
  }
}

// Long contexts in M3's shape: the last 64 queries of 32K- and 128K-token sequences.
TEST(GpuLongContext, LastChunkMatchesCpu) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  const CaseShape shape = make_shape(4, 16, 128, 128, 128, 16, 1, 0);
  for (int64_t context : {int64_t{32768}, int64_t{131072}}) {
    SCOPED_TRACE("context " + std::to_string(context));
    const VarlenCase c = gpu_case(shape, {{.q_len = 64, .k_len = context}});
    const DoubleInputs in(c);
    const MsaParams& p = c.params();
    const IndexerOutput cpu_rows = indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, p, Impl::cpu);
    expect_indexer_close(indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, p, Impl::cuda),
                         cpu_rows, c, in, "long");
    const auto sparse = [&](Impl impl) {
      return sparse_attention(c.q, c.k, c.v, cpu_rows.topk, c.cu_seqlens_q, c.cu_seqlens_k, p, impl);
    };
    expect_attention_close(sparse(Impl::cuda), sparse(Impl::cpu), "long sparse");
  }
}

TEST(GpuEmptyRows, AllMinusOneRowsGiveZeroAndNegInf) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  const VarlenCase c =
      gpu_case(make_shape(2, 4, 64, 64, 64, 4, 1, 1), mixed_sequences(edge_lengths(64, 4)));
  Tensor topk = indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), Impl::cpu).topk;
  empty_every_nth_row(topk, 5);
  const auto run = [&](Impl impl) {
    return sparse_attention(c.q, c.k, c.v, topk, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), impl);
  };
  expect_attention_close(run(Impl::cuda), run(Impl::cpu), "sparse with empty rows");
}

// Decode path (max_q_len <= 16), a batch of 64 requests of different lengths: mostly
// Q = 1, some multi-token (Q up to 16), from a single key up to ~9 selections' worth of
// blocks; paged, M3's shape. Selection vs the CPU and sparse attention on the CPU's rows,
// then bitwise-identical repeated runs.
TEST(GpuDecode, Batch64MixedLengthsMatchesCpu) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  const CaseShape shape = make_shape(4, 16, 128, 128, 128, 16, 1, 0);
  const VarlenCase c = gpu_case(shape, mixed_decode_batch64(shape));
  const DoubleInputs in(c);
  const PagedRequests paged = page_varlen_case(c);
  const MsaParams& p = c.params();
  const IndexerOutput cpu_rows = paged_indexer(c.qi, paged.cache, paged.cu_seqlens_q, p, Impl::cpu);
  const IndexerOutput gpu_rows = paged_indexer(c.qi, paged.cache, paged.cu_seqlens_q, p, Impl::cuda);
  expect_indexer_close(gpu_rows, cpu_rows, c, in, "decode batch 64");
  EXPECT_TRUE(bitwise_equal(
      gpu_rows.topk, paged_indexer(c.qi, paged.cache, paged.cu_seqlens_q, p, Impl::cuda).topk));
  const auto sparse = [&](Impl impl) {
    return paged_sparse_attention(c.q, paged.cache, cpu_rows.topk, paged.cu_seqlens_q, p, impl);
  };
  const AttentionOutput first = sparse(Impl::cuda);
  expect_attention_close(first, sparse(Impl::cpu), "decode batch 64 sparse");
  const AttentionOutput second = sparse(Impl::cuda);
  EXPECT_TRUE(bitwise_equal(first.o, second.o));
  EXPECT_TRUE(bitwise_equal(first.lse, second.lse));
}

// Q = 16 queries x G = 16 heads = 256 rows per (request, group): the decode kernel splits
// them into query chunks; long contexts make the 16 rows' selections differ (union up to
// 16 x 16 blocks). Also G = 8 with topk 32 (512 selection entries per chunk) and varlen.
TEST(GpuDecode, SixteenQueriesBySixteenHeadsMatchesCpu) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  for (const CaseShape& shape :
       {make_shape(4, 16, 128, 128, 128, 16, 1, 0), make_shape(2, 8, 64, 64, 64, 32, 2, 1)}) {
    SCOPED_TRACE(shape.describe());
    const int64_t B = shape.params.block_size, kb = B * shape.params.topk;
    const VarlenCase c = gpu_case(shape, {{.q_len = 16, .k_len = 6 * kb + 5},
                                          {.q_len = 16, .k_len = 16},
                                          {.q_len = 16, .k_len = kb + B + 3}});
    const DoubleInputs in(c);
    const MsaParams& p = c.params();
    const IndexerOutput cpu_rows = indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, p, Impl::cpu);
    expect_indexer_close(indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, p, Impl::cuda), cpu_rows,
                         c, in, "decode 16x16");
    const auto sparse = [&](Impl impl) {
      return sparse_attention(c.q, c.k, c.v, cpu_rows.topk, c.cu_seqlens_q, c.cu_seqlens_k, p, impl);
    };
    const AttentionOutput first = sparse(Impl::cuda);
    expect_attention_close(first, sparse(Impl::cpu), "decode 16x16 sparse");
    const AttentionOutput second = sparse(Impl::cuda);
    EXPECT_TRUE(bitwise_equal(first.o, second.o));
    EXPECT_TRUE(bitwise_equal(first.lse, second.lse));
    const PagedRequests paged = page_varlen_case(c);
    expect_attention_close(
        paged_sparse_attention(c.q, paged.cache, cpu_rows.topk, paged.cu_seqlens_q, p, Impl::cuda),
        paged_sparse_attention(c.q, paged.cache, cpu_rows.topk, paged.cu_seqlens_q, p, Impl::cpu),
        "decode 16x16 paged sparse");
  }
}

// One decode batch of Q = q queries per request (fewer for shorter contexts) at the edge
// lengths (1, B - 1, B, B + 1, kB - 1, kB, kB + 1, long), contiguous and paged, with full
// selections and with every 5th row emptied (all -1): sparse attention vs the CPU and
// bitwise-identical repeated runs.
void expect_decode_edges_match_cpu(const CaseShape& shape, int64_t q, const std::string& what) {
  const int64_t B = shape.params.block_size, k = shape.params.topk;
  std::vector<Seq> seqs;
  for (int64_t k_len : edge_lengths(B, k)) seqs.push_back({.q_len = std::min(q, k_len), .k_len = k_len});
  seqs.push_back({.q_len = q, .k_len = 40 * k * B + 3});
  const VarlenCase c = gpu_case(shape, seqs);
  const MsaParams& p = c.params();
  Tensor topk = indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, p, Impl::cpu).topk;
  for (bool empty_rows : {false, true}) {
    if (empty_rows) empty_every_nth_row(topk, 5);
    const auto sparse = [&](Impl impl) {
      return sparse_attention(c.q, c.k, c.v, topk, c.cu_seqlens_q, c.cu_seqlens_k, p, impl);
    };
    const AttentionOutput first = sparse(Impl::cuda);
    expect_attention_close(first, sparse(Impl::cpu), what + " sparse");
    const AttentionOutput second = sparse(Impl::cuda);
    EXPECT_TRUE(bitwise_equal(first.o, second.o));
    EXPECT_TRUE(bitwise_equal(first.lse, second.lse));
    const PagedRequests paged = page_varlen_case(c);
    expect_attention_close(paged_sparse_attention(c.q, paged.cache, topk, paged.cu_seqlens_q, p, Impl::cuda),
                           paged_sparse_attention(c.q, paged.cache, topk, paged.cu_seqlens_q, p, Impl::cpu),
                           what + " paged sparse");
  }
}

// The decode path's shape matrix: groups 16 / 4 / 3 / 1, D 128 / 64, B 128 / 64, topk 4-32.
std::vector<CaseShape> decode_group_shapes() {
  return {make_shape(4, 16, 128, 128, 128, 16, 1, 0), make_shape(2, 4, 64, 64, 64, 8, 1, 1),
          make_shape(2, 3, 128, 64, 64, 16, 2, 0), make_shape(3, 1, 64, 64, 128, 32, 1, 1)};
}

// Decode batches whose query chunk holds at most 32 selection entries (QC x topk <= 32: M3
// at Q <= 2) take the kernel's one-warp union (attention_decode.cuh, warp_union): every
// request of one Q (1, or 2), over decode_group_shapes.
TEST(GpuDecode, OneWarpUnionBatchesMatchCpu) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  for (const CaseShape& shape : decode_group_shapes()) {
    for (int64_t q : {int64_t{1}, int64_t{2}}) {
      if (q * shape.params.topk > 32) continue;  // the general union (covered above)
      SCOPED_TRACE(shape.describe() + " q " + std::to_string(q));
      expect_decode_edges_match_cpu(shape, q, "one-warp union");
    }
  }
}

// Decode batches with one 16-row warp tile per CTA (QC x G <= 16: M3 at Q = 1, G 4 at Q <= 4,
// G 3 at Q <= 5, G 1 at Q <= 16) take the kernel's key split (kSplitKeys: each warp a quarter
// of every unit's keys, the 4 warps' states merged): with the one-warp union and the general
// one, contexts whose last unit leaves some warps' key quarters fully masked, emptied rows.
TEST(GpuDecode, SingleRowTileKeySplitMatchesCpu) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  std::vector<CaseShape> shapes = decode_group_shapes();
  shapes.push_back(make_shape(1, 16, 64, 64, 64, 4, 1, 0));  // G 16 with D = B = 64
  for (const CaseShape& shape : shapes) {
    const int64_t G = shape.group;
    for (int64_t q : {int64_t{1}, int64_t{2}, int64_t{3}, int64_t{4}, int64_t{5}, int64_t{16}}) {
      if (q * G > 16) continue;  // several warp tiles per CTA: the general path (covered above)
      SCOPED_TRACE(shape.describe() + " q " + std::to_string(q));
      expect_decode_edges_match_cpu(shape, q, "key split");
    }
  }
}

// Both sparse tile engines for D = B = 128 (MsaParams::cuda.sparse pinned to wgmma, then to
// mma_sync), whichever is the default: M3's group and groups that split 64-row tiles across
// queries.
// sparse_attention of case c with selection topk on the GPU, with `engines` pinned.
AttentionOutput gpu_sparse_with(const VarlenCase& c, const Tensor& topk, const CudaEngines& engines) {
  MsaParams p = c.params();
  p.cuda = engines;
  return sparse_attention(c.q, c.k, c.v, topk, c.cu_seqlens_q, c.cu_seqlens_k, p, Impl::cuda);
}

class GpuSparseWgmma : public ::testing::TestWithParam<CaseShape> {};

TEST_P(GpuSparseWgmma, BothTileEnginesMatchCpu) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  const MsaParams& p = GetParam().params;
  const VarlenCase c = gpu_case(GetParam(), mixed_sequences(edge_lengths(p.block_size, p.topk)));
  const Tensor topk = indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), Impl::cpu).topk;
  const auto sparse = [&](Impl impl) {
    return sparse_attention(c.q, c.k, c.v, topk, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), impl);
  };
  const AttentionOutput cpu = sparse(Impl::cpu);
  for (const cuda::Engine engine : {cuda::Engine::wgmma, cuda::Engine::mma_sync}) {
    const std::string label = engine == cuda::Engine::wgmma ? "sparse (wgmma)" : "sparse (mma.sync)";
    SCOPED_TRACE(label);
    const AttentionOutput first = gpu_sparse_with(c, topk, {.sparse = engine}),
                          second = gpu_sparse_with(c, topk, {.sparse = engine});
    expect_attention_close(first, cpu, label);
    EXPECT_TRUE(bitwise_equal(first.o, second.o));
    EXPECT_TRUE(bitwise_equal(first.lse, second.lse));
  }
}

// The error message of a small sparse_attention call on the GPU (G 3, D = B = 128, the wgmma
// engine's shape) with `engines` pinned.
std::string sparse_error_with(const CudaEngines& engines) {
  const CaseShape shape = make_shape(1, 3, 128, 64, 128, 3, 1, 0);
  const VarlenCase c = gpu_case(shape, {{.q_len = 300, .k_len = 300}});
  const Tensor topk = indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), Impl::cpu).topk;
  return error_of([&] { gpu_sparse_with(c, topk, engines); });
}

// A negative softmax scale (the spec allows any): the forward ops against the CPU, prefill
// (varlen) and decode-sized batches, at M3's D = B = 128 (where the wgmma sparse kernel, which
// takes the max before scaling, must hand over to mma.sync) and a small shape; forcing the
// wgmma kernel with it is a clear error.
TEST(GpuNegativeScale, ForwardOpsMatchCpu) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  for (CaseShape shape : {make_shape(4, 16, 128, 128, 128, 16, 1, 0), make_shape(2, 4, 64, 64, 64, 4, 1, 1)}) {
    SCOPED_TRACE(shape.describe());
    shape.params.scale = -0.09;
    shape.params.index_scale = -0.1;
    const int64_t B = shape.params.block_size, k = shape.params.topk;
    for (const std::vector<Seq>& seqs :
         {mixed_sequences(edge_lengths(B, k)), std::vector<Seq>{{.q_len = 1, .k_len = k * B + 1},
                                                                {.q_len = 3, .k_len = 5 * B - 1}}}) {
      const VarlenCase c = gpu_case(shape, seqs);
      const DoubleInputs in(c);
      const auto index = [&](Impl impl) {
        return indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), impl);
      };
      const IndexerOutput cpu_rows = index(Impl::cpu);
      expect_indexer_close(index(Impl::cuda), cpu_rows, c, in, "negative scale");
      const auto sparse = [&](Impl impl) {
        return sparse_attention(c.q, c.k, c.v, cpu_rows.topk, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), impl);
      };
      const auto dense = [&](Impl impl) {
        return dense_attention(c.q, c.k, c.v, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), impl);
      };
      expect_attention_close(sparse(Impl::cuda), sparse(Impl::cpu), "sparse, negative scale");
      expect_attention_close(dense(Impl::cuda), dense(Impl::cpu), "dense, negative scale");
      if (shape.head_dim == 128 && B == 128 && c.seqs.size() > 2) {
        const std::string message =
            error_of([&] { gpu_sparse_with(c, cpu_rows.topk, {.sparse = cuda::Engine::wgmma}); });
        EXPECT_NE(message.find("scale"), std::string::npos) << message;
      }
    }
  }
}

// The whole-query tile shapes and G = 3 (a 64-row tile splits a query).
std::vector<CaseShape> sparse_wgmma_shapes() {
  std::vector<CaseShape> shapes = whole_query_tile_shapes();
  shapes.push_back(make_shape(1, 3, 128, 64, 128, 3, 1, 0));
  return shapes;
}
INSTANTIATE_TEST_SUITE_P(Shapes, GpuSparseWgmma, ::testing::ValuesIn(sparse_wgmma_shapes()), shape_name);

// The wgmma engine pipelines a warpgroup's 64-row tiles within an item (S of the next tile
// during this tile's softmax): items with 1, 2 and 3 tiles per warpgroup (0/1 = the two
// warpgroups' counts), odd and even, next to full ones. With q_len = k_len = L and L + 1 <= topk
// blocks every query selects every visible block, so block b has L - 128 b entries, split into
// items of 1024 / G queries: G = 16 (64 per item): tails L mod 64 = 1, 5, 9, 13, 17, 21 give
// 1/0, 1/1, 2/1, 2/2, 3/2, 3/3 tiles; G = 3 (341 per item): rows 3 (L - 128 b), e.g. L = 50
// -> 2/1, 70 -> 2/2, 100 -> 3/2, 250 -> blocks of 6/6 and 3/3 tiles.
TEST(GpuSparseWgmmaTiles, ItemsOfOneTwoAndThreeTilesPerWarpgroupMatchCpu) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  struct TileCase {
    CaseShape shape;
    std::vector<int64_t> lengths;
  };
  for (const TileCase& tc : {TileCase{make_shape(4, 16, 128, 128, 128, 16, 1, 0),
                                      {1, 5, 9, 13, 17, 21, 64 + 9, 128 + 17, 1024 + 21, 2047}},
                             TileCase{make_shape(1, 3, 128, 64, 128, 3, 1, 0),
                                      {21, 30, 50, 70, 100, 130, 170, 250, 383}}}) {
    SCOPED_TRACE(tc.shape.describe());
    std::vector<Seq> seqs = whole_prefills(tc.lengths);
    std::shuffle(seqs.begin(), seqs.end(), rng());
    const VarlenCase c = gpu_case(tc.shape, seqs);
    const Tensor topk = indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), Impl::cpu).topk;
    const auto sparse = [&](Impl impl) {
      return sparse_attention(c.q, c.k, c.v, topk, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), impl);
    };
    const AttentionOutput cpu = sparse(Impl::cpu);
    const CudaEngines wgmma{.sparse = cuda::Engine::wgmma};
    const AttentionOutput first = gpu_sparse_with(c, topk, wgmma), second = gpu_sparse_with(c, topk, wgmma);
    expect_attention_close(first, cpu, "sparse (wgmma), tile counts");
    EXPECT_TRUE(bitwise_equal(first.o, second.o));
    EXPECT_TRUE(bitwise_equal(first.lse, second.lse));
  }
}

// The wgmma engine on cases with many items per CTA (its barrier phases wrap many times; the
// CPU-checked cases above have about one) and short items (one tile for warpgroup 0, none for
// warpgroup 1), against the mma.sync engine (the CPU reference is slow at these sizes; both
// engines meet it above). Selections from the CUDA indexer: any valid selection will do.
TEST(GpuSparseWgmmaLong, ManyItemsPerCtaMatchTheMmaSyncEngine) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  struct LongCase {
    CaseShape shape;
    std::vector<Seq> seqs;
  };
  for (const LongCase& lc :
       {LongCase{make_shape(4, 16, 128, 128, 128, 16, 1, 0), {{.q_len = 8192, .k_len = 8192}}},
        LongCase{make_shape(4, 16, 128, 128, 128, 16, 1, 0),
                 {{.q_len = 3000, .k_len = 3000}, {.q_len = 1, .k_len = 1}, {.q_len = 129, .k_len = 1500},
                  {.q_len = 700, .k_len = 5000}, {.q_len = 2, .k_len = 130}}},
        LongCase{make_shape(1, 3, 128, 64, 128, 3, 1, 0), {{.q_len = 4096, .k_len = 4096}}}}) {
    SCOPED_TRACE(lc.shape.describe());
    const VarlenCase c = gpu_case(lc.shape, lc.seqs);
    const Tensor topk = indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), Impl::cuda).topk;
    const auto sparse = [&](cuda::Engine engine) { return gpu_sparse_with(c, topk, {.sparse = engine}); };
    const AttentionOutput mma_sync = sparse(cuda::Engine::mma_sync), first = sparse(cuda::Engine::wgmma),
                          second = sparse(cuda::Engine::wgmma);
    expect_attention_close(first, mma_sync, "sparse, wgmma vs mma.sync engine");
    EXPECT_TRUE(bitwise_equal(second.o, first.o));
    EXPECT_TRUE(bitwise_equal(second.lse, first.lse));
  }
}

// The wgmma engine's Q tiles by the bulk tensor copy engine (sparse_q_load tma, the default
// for G = 8 and 16) against its cp.async gathers: bitwise, since both put the same bytes
// in the swizzled slots (padding rows differ: TMA repeats the item's last query, the gather
// writes zeros; neither is stored). Items of 1-3 tiles per warpgroup with whole-query padding,
// varlen batches, many items per CTA; the CPU checks the G = 8 cases. Pinning tma where the
// copy engine cannot serve (G = 3) is a clear error.
TEST(GpuSparseTmaQ, MatchesTheCpAsyncGatherBitwise) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  struct TmaCase {
    CaseShape shape;
    std::vector<Seq> seqs;
    bool cpu;
  };
  for (const TmaCase& tc :
       {TmaCase{make_shape(4, 16, 128, 128, 128, 16, 1, 0), whole_prefills({1, 5, 9, 13, 17, 21, 1024 + 21, 2047}),
                false},
        TmaCase{make_shape(4, 16, 128, 128, 128, 16, 1, 0),
                {{.q_len = 3000, .k_len = 3000}, {.q_len = 1, .k_len = 1}, {.q_len = 129, .k_len = 1500},
                 {.q_len = 700, .k_len = 5000}},
                false},
        TmaCase{make_shape(2, 8, 128, 64, 128, 5, 1, 0), whole_prefills({1, 7, 9, 17, 33, 200, 641}), true},
        TmaCase{make_shape(2, 8, 128, 64, 128, 5, 1, 0), {{.q_len = 2500, .k_len = 2500}, {.q_len = 3, .k_len = 900}},
                false}}) {
    SCOPED_TRACE(tc.shape.describe());
    const VarlenCase c = gpu_case(tc.shape, tc.seqs);
    const Tensor topk = indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), Impl::cuda).topk;
    const auto sparse = [&](cuda::TileLoad load) {
      return gpu_sparse_with(c, topk, {.sparse = cuda::Engine::wgmma, .sparse_q_load = load});
    };
    const AttentionOutput gather = sparse(cuda::TileLoad::cp_async), tma = sparse(cuda::TileLoad::tma),
                          again = sparse(cuda::TileLoad::tma);
    EXPECT_TRUE(bitwise_equal(tma.o, gather.o));
    EXPECT_TRUE(bitwise_equal(tma.lse, gather.lse));
    EXPECT_TRUE(bitwise_equal(again.o, tma.o));
    if (tc.cpu) {
      const AttentionOutput cpu =
          sparse_attention(c.q, c.k, c.v, topk, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), Impl::cpu);
      expect_attention_close(tma, cpu, "sparse (wgmma, TMA Q)");
    }
  }
  const std::string message = sparse_error_with({.sparse_q_load = cuda::TileLoad::tma});  // G 3
  EXPECT_NE(message.find("sparse_q_load"), std::string::npos) << message;
}

}  // namespace
}  // namespace msa::testing
