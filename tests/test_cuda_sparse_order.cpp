// The sparse prefill's work orders (MsaParams::cuda.sparse_order: query_major, kv_major and
// the per-tile automatic choice; src/cuda/attention/attention_sparse_union.cuh) against the
// CPU, on selections of the CPU indexer (random inputs: neighbouring queries share few blocks,
// so automatic sends most tiles past the first 16 blocks to kv_major) and on coherent ones
// (every query of a 128-token block picks the same blocks, as trained indexers tend to:
// automatic sends them query-major), and on batches that mix both, varlen and paged (unused
// cache slots NaN), chunked, with a second run bitwise equal to the first. Pinning
// query_major where it cannot run is a clear error. Skipped without a CUDA device.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <string>

#include "gpu_checks.h"

namespace msa::testing {
namespace {

const cuda::SparseOrder kOrders[] = {cuda::SparseOrder::query_major, cuda::SparseOrder::automatic,
                                     cuda::SparseOrder::kv_major};

// Coherent selection rows for the sequences whose index `keep(b)` is false: per (sequence,
// group) one random order of the sequence's blocks; a query whose own block is L selects the
// first min(k, L + 1) - 1 blocks of that order below L, then L (the rows' structure: distinct
// ids, own block last, -1 suffix). Other sequences keep the rows of `topk`.
template <class Keep>
Tensor coherent_rows(const VarlenCase& c, Tensor topk, Keep keep) {
  const int64_t B = c.params().block_size, k = c.params().topk, total_q = c.total_q();
  int32_t* rows = topk.data<int32_t>();
  for (int64_t g = 0; g < c.shape.kv_heads; ++g) {
    int64_t row = 0;
    for (size_t b = 0; b < c.seqs.size(); ++b) {
      const Seq& s = c.seqs[b];
      std::vector<int32_t> order(static_cast<size_t>((s.k_len + B - 1) / B));
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), rng());
      for (int64_t i = 0; i < s.q_len; ++i, ++row) {
        if (keep(b)) continue;
        const int32_t own = static_cast<int32_t>(c.own_block(row));
        int32_t* out = rows + (g * total_q + row) * k;
        const int64_t valid = std::min<int64_t>(k, own + 1);
        int64_t n = 0;
        for (const int32_t id : order)
          if (id < own && n < valid - 1) out[n++] = id;
        out[n++] = own;
        for (; n < k; ++n) out[n] = -1;
      }
    }
  }
  return topk;
}

AttentionOutput sparse_on(const VarlenCase& c, const Tensor& topk, cuda::SparseOrder order, Impl impl,
                          int64_t max_chunk_queries = 0) {
  MsaParams p = c.params();
  p.cuda.sparse_order = order;
  p.cuda.max_chunk_queries = max_chunk_queries;
  return sparse_attention(c.q, c.k, c.v, topk, c.cu_seqlens_q, c.cu_seqlens_k, p, impl);
}

// Every order on `topk` against the CPU, twice (bitwise); and the paged layout once.
void expect_orders_match_cpu(const VarlenCase& c, const Tensor& topk, const std::string& what,
                             int64_t max_chunk_queries = 0) {
  const AttentionOutput cpu = sparse_on(c, topk, cuda::SparseOrder::automatic, Impl::cpu);
  PagedRequests paged = page_varlen_case(c);
  poison_unused_cache_slots(paged.cache);
  for (const cuda::SparseOrder order : kOrders) {
    const std::string label = what + ", " + cuda::sparse_order_name(order);
    SCOPED_TRACE(label);
    const AttentionOutput first = sparse_on(c, topk, order, Impl::cuda, max_chunk_queries),
                          second = sparse_on(c, topk, order, Impl::cuda, max_chunk_queries);
    expect_attention_close(first, cpu, label);
    EXPECT_TRUE(bitwise_equal(first.o, second.o)) << label << ": o differs between runs";
    EXPECT_TRUE(bitwise_equal(first.lse, second.lse)) << label << ": lse differs between runs";
    MsaParams p = c.params();
    p.cuda.sparse_order = order;
    expect_attention_close(paged_sparse_attention(c.q, paged.cache, topk, paged.cu_seqlens_q, p, Impl::cuda), cpu,
                           label + " (paged)");
  }
}

class GpuSparseOrder : public ::testing::TestWithParam<CaseShape> {};

// The edge lengths (1, B +- 1, kB +- 1, ...), whole prefills and suffixes over a cached
// prefix: the indexer's rows, coherent rows, and half of each.
TEST_P(GpuSparseOrder, EveryOrderMatchesCpu) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  const MsaParams& params = GetParam().params;
  std::vector<int64_t> lengths = edge_lengths(params.block_size, params.topk);
  lengths.push_back(3 * params.topk * params.block_size + 77);
  const VarlenCase c = gpu_case(GetParam(), mixed_sequences(lengths));
  const Tensor indexed = indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), Impl::cpu).topk;
  expect_orders_match_cpu(c, indexed, "indexer rows");
  expect_orders_match_cpu(c, coherent_rows(c, indexed, [](size_t) { return false; }), "coherent rows");
  expect_orders_match_cpu(c, coherent_rows(c, indexed, [](size_t b) { return b % 2 == 0; }), "mixed rows");
}

// The groups query_major serves (16, 8, 4), D = B = 128.
INSTANTIATE_TEST_SUITE_P(Shapes, GpuSparseOrder, ::testing::ValuesIn(whole_query_tile_shapes()), shape_name);

// Longer sequences in small query chunks (kv_major's chunk loop next to the query-major tiles
// of the same call), against the CPU.
TEST(GpuSparseOrderChunks, MixedRowsInChunksMatchCpu) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  const VarlenCase c = gpu_case(make_shape(4, 16, 128, 128, 128, 16, 1, 0),
                                {{.q_len = 2600, .k_len = 2600}, {.q_len = 1, .k_len = 1},
                                 {.q_len = 129, .k_len = 3500}, {.q_len = 700, .k_len = 4000}});
  const Tensor indexed = indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), Impl::cpu).topk;
  expect_orders_match_cpu(c, coherent_rows(c, indexed, [](size_t b) { return b == 2; }), "mixed rows, chunks of 500",
                          500);
}

// query_major pinned where it cannot run names the field; automatic runs kv_major there.
TEST(GpuSparseOrderRefusal, QueryMajorOutsideItsShapesIsAnError) {
  MSA_REQUIRE_CUDA();
  MSA_RESEED_AND_TRACE();
  for (const CaseShape& shape : {make_shape(1, 3, 128, 64, 128, 3, 1, 0), make_shape(2, 16, 64, 64, 64, 4, 1, 0)}) {
    SCOPED_TRACE(shape.describe());
    const VarlenCase c = gpu_case(shape, {{.q_len = 300, .k_len = 300}});
    const Tensor topk = indexer(c.qi, c.ki, c.cu_seqlens_q, c.cu_seqlens_k, c.params(), Impl::cpu).topk;
    const std::string message =
        error_of([&] { sparse_on(c, topk, cuda::SparseOrder::query_major, Impl::cuda); });
    EXPECT_NE(message.find("sparse_order"), std::string::npos) << message;
    expect_attention_close(sparse_on(c, topk, cuda::SparseOrder::automatic, Impl::cuda),
                           sparse_on(c, topk, cuda::SparseOrder::automatic, Impl::cpu), "automatic");
  }
}

}  // namespace
}  // namespace msa::testing
