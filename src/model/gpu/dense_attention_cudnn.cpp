// The CUDA text model's dense attention on cuDNN's SDPA (see dense_attention_cudnn.h).
#include "dense_attention_cudnn.h"

#include <algorithm>
#include <limits>
#include <vector>

#include "cuda/common/workspace_layout.h"
#include "msa/error.h"
#ifdef MSA_WITH_CUDNN
#include "cudnn/cudnn_sdpa.h"
#endif

namespace msa::model::gpu {

namespace {

int64_t next_power_of_two(int64_t n) {
  int64_t p = 1;
  while (p < n) p *= 2;
  return p;
}

// A size a plan bakes in, rounded up to a power of two (at least 1): few plans per process.
int64_t plan_bucket(int64_t n) { return next_power_of_two(std::max<int64_t>(n, 1)); }

}  // namespace

bool cudnn_dense_fits(int64_t total_q, int64_t q_row_elements) {
  return total_q * q_row_elements <= std::numeric_limits<int32_t>::max();
}

CudnnDenseGeometry cudnn_dense_geometry(int64_t requests, int64_t max_q_len, int64_t max_pages) {
  return {.batch = plan_bucket(requests), .max_q_len = plan_bucket(max_q_len), .table_stride = plan_bucket(max_pages)};
}

CudnnDenseMetadataLayout cudnn_dense_metadata_layout(const CudnnDenseGeometry& g) {
  msa::cuda::WorkspaceCursor a;
  CudnnDenseMetadataLayout l;
  l.seq_len_q = a.take_elements<int32_t>(g.batch);
  l.seq_len_kv = a.take_elements<int32_t>(g.batch);
  l.q_offsets = a.take_elements<int32_t>(g.batch + 1);
  l.page_table = a.take_elements<int32_t>(g.batch * g.table_stride);
  l.bytes = a.total();
  return l;
}

void stage_cudnn_dense_metadata(const CudnnDenseGeometry& g, std::span<const int32_t> cu_seqlens_q,
                                std::span<const int32_t> seq_lens, const int32_t* page_table,
                                int64_t max_pages, int64_t q_row_elements, char* dst) {
  const int64_t requests = static_cast<int64_t>(seq_lens.size());
  MSA_CHECK_ARG(requests <= g.batch && static_cast<int64_t>(cu_seqlens_q.size()) == requests + 1,
                "cudnn dense metadata requests", detail::concat("at most ", g.batch, " with ", requests + 1, " offsets"),
                detail::concat(requests, " with ", cu_seqlens_q.size(), " offsets"));
  MSA_CHECK_ARG(max_pages <= g.table_stride, "cudnn dense metadata max_pages",
                detail::concat("at most ", g.table_stride), max_pages);
  const CudnnDenseMetadataLayout l = cudnn_dense_metadata_layout(g);
  auto* seq_len_q = reinterpret_cast<int32_t*>(dst + l.seq_len_q);
  auto* seq_len_kv = reinterpret_cast<int32_t*>(dst + l.seq_len_kv);
  auto* q_offsets = reinterpret_cast<int32_t*>(dst + l.q_offsets);
  auto* table = reinterpret_cast<int32_t*>(dst + l.page_table);
  const int64_t total_q = cu_seqlens_q[requests];
  for (int64_t b = 0; b < g.batch; ++b) {
    const bool real = b < requests;
    seq_len_q[b] = real ? cu_seqlens_q[b + 1] - cu_seqlens_q[b] : 0;  // padding: no queries, no keys
    seq_len_kv[b] = real ? seq_lens[b] : 0;
    q_offsets[b] = static_cast<int32_t>((real ? cu_seqlens_q[b] : total_q) * q_row_elements);
    int32_t* row = table + b * g.table_stride;
    std::fill(row, row + g.table_stride, 0);  // page 0: a valid page, never read past seq_len_kv
    if (real) std::copy_n(page_table + b * max_pages, max_pages, row);
  }
  q_offsets[g.batch] = static_cast<int32_t>(total_q * q_row_elements);
}

bool cudnn_gathered_fits(int64_t total_q, int64_t q_row_elements, int64_t total_k, int64_t kv_row_elements) {
  return cudnn_dense_fits(total_q, q_row_elements) &&
         total_k * kv_row_elements <= std::numeric_limits<int32_t>::max();
}

CudnnGatheredGeometry cudnn_gathered_geometry(int64_t requests, int64_t max_q_len, int64_t max_k_len) {
  return {.batch = plan_bucket(requests), .max_q_len = plan_bucket(max_q_len), .max_k_len = plan_bucket(max_k_len)};
}

CudnnGatheredMetadataLayout cudnn_gathered_metadata_layout(const CudnnGatheredGeometry& g) {
  msa::cuda::WorkspaceCursor a;
  CudnnGatheredMetadataLayout l;
  l.seq_len_q = a.take_elements<int32_t>(g.batch);
  l.seq_len_kv = a.take_elements<int32_t>(g.batch);
  l.q_offsets = a.take_elements<int32_t>(g.batch + 1);
  l.k_offsets = a.take_elements<int32_t>(g.batch + 1);
  l.k_rows = a.take_elements<int32_t>(g.batch + 1);
  l.bytes = a.total();
  return l;
}

void stage_cudnn_gathered_metadata(const CudnnGatheredGeometry& g, std::span<const int32_t> cu_seqlens_q,
                                   std::span<const int32_t> seq_lens, int64_t q_row_elements,
                                   int64_t kv_row_elements, char* dst) {
  const int64_t requests = static_cast<int64_t>(seq_lens.size());
  MSA_CHECK_ARG(requests <= g.batch && static_cast<int64_t>(cu_seqlens_q.size()) == requests + 1,
                "cudnn gathered metadata requests",
                detail::concat("at most ", g.batch, " with ", requests + 1, " offsets"),
                detail::concat(requests, " with ", cu_seqlens_q.size(), " offsets"));
  int64_t total_k = 0;
  for (int64_t b = 0; b < requests; ++b) {
    const int64_t q_len = cu_seqlens_q[b + 1] - cu_seqlens_q[b], k_len = seq_lens[b];
    MSA_CHECK_ARG(q_len >= 0 && q_len <= g.max_q_len && q_len <= k_len && k_len <= g.max_k_len,
                  "cudnn gathered metadata request " + std::to_string(b),
                  detail::concat("0 <= q_len <= k_len, q_len <= ", g.max_q_len, ", k_len <= ", g.max_k_len),
                  detail::concat("q_len ", q_len, ", k_len ", k_len));
    total_k += k_len;
  }
  const int64_t total_q = cu_seqlens_q[requests];
  MSA_CHECK_ARG(cudnn_gathered_fits(total_q, q_row_elements, total_k, kv_row_elements),
                "cudnn gathered metadata step", "int32 element offsets",
                detail::concat(total_q, " query rows of ", q_row_elements, ", ", total_k, " key rows of ",
                               kv_row_elements));
  const CudnnGatheredMetadataLayout l = cudnn_gathered_metadata_layout(g);
  auto* seq_len_q = reinterpret_cast<int32_t*>(dst + l.seq_len_q);
  auto* seq_len_kv = reinterpret_cast<int32_t*>(dst + l.seq_len_kv);
  auto* q_offsets = reinterpret_cast<int32_t*>(dst + l.q_offsets);
  auto* k_offsets = reinterpret_cast<int32_t*>(dst + l.k_offsets);
  auto* k_rows = reinterpret_cast<int32_t*>(dst + l.k_rows);
  int64_t k_row = 0;
  for (int64_t b = 0; b < g.batch; ++b) {
    const bool real = b < requests;
    seq_len_q[b] = real ? cu_seqlens_q[b + 1] - cu_seqlens_q[b] : 0;  // padding: no queries, no keys
    seq_len_kv[b] = real ? seq_lens[b] : 0;
    q_offsets[b] = static_cast<int32_t>((real ? cu_seqlens_q[b] : total_q) * q_row_elements);
    k_offsets[b] = static_cast<int32_t>(k_row * kv_row_elements);
    k_rows[b] = static_cast<int32_t>(k_row);
    k_row += seq_len_kv[b];
  }
  q_offsets[g.batch] = static_cast<int32_t>(total_q * q_row_elements);
  k_offsets[g.batch] = static_cast<int32_t>(total_k * kv_row_elements);
  k_rows[g.batch] = static_cast<int32_t>(total_k);
}

#ifdef MSA_WITH_CUDNN

struct CudnnDenseAttention::Plans {
  std::vector<std::unique_ptr<msa::cuda::CudnnSdpa>> built;

  static msa::cuda::CudnnSdpaShape shape_of(const CudnnGatheredCall& call) {
    const CudnnGatheredGeometry& g = call.geometry;
    return {.batch = g.batch,
            .q_heads = call.q_heads,
            .kv_heads = call.kv_heads,
            .head_dim = call.head_dim,
            .q_len = g.max_q_len,
            .k_len = g.max_k_len,
            .scale = call.scale,
            .causal = true,
            .with_stats = false,
            .ragged_q = true,
            .ragged_kv = true,
            .external_workspace = true};
  }
  static msa::cuda::CudnnSdpaShape shape_of(const CudnnDenseCall& call) {
    const CudnnDenseGeometry& g = call.geometry;
    return {.batch = g.batch,
            .q_heads = call.q_heads,
            .kv_heads = call.kv_heads,
            .head_dim = call.head_dim,
            .q_len = g.max_q_len,
            .k_len = g.table_stride * call.block_size,
            .scale = call.scale,
            .causal = true,
            .with_stats = false,
            .block_size = call.block_size,
            .pages = call.pages,
            .table_stride = g.table_stride,
            .ragged_q = true,
            .external_workspace = true};
  }
  msa::cuda::CudnnSdpa* find(const msa::cuda::CudnnSdpaShape& shape) {
    for (const auto& plan : built)
      if (plan->shape() == shape) return plan.get();
    return nullptr;
  }
  msa::cuda::CudnnSdpa& find_or_build(const msa::cuda::CudnnSdpaShape& shape) {
    if (msa::cuda::CudnnSdpa* plan = find(shape)) return *plan;
    built.push_back(std::make_unique<msa::cuda::CudnnSdpa>(shape));
    return *built.back();
  }
  msa::cuda::CudnnSdpa& prepared(const msa::cuda::CudnnSdpaShape& shape) {
    msa::cuda::CudnnSdpa* plan = find(shape);
    if (!plan) MSA_FAIL("cudnn dense attention: run() before prepare() for this shape");
    return *plan;
  }
};

CudnnDenseAttention::CudnnDenseAttention() : plans_(std::make_unique<Plans>()) {}
CudnnDenseAttention::~CudnnDenseAttention() = default;

size_t CudnnDenseAttention::prepare(const CudnnDenseCall& call) {
  return plans_->find_or_build(Plans::shape_of(call)).workspace_bytes();
}

size_t CudnnDenseAttention::prepare(const CudnnGatheredCall& call) {
  return plans_->find_or_build(Plans::shape_of(call)).workspace_bytes();
}

// The arguments both engines share: Q / O in the ragged layout with their offsets, the
// per-request lengths of the padding mask, K / V, the workspace.
template <class Call, class Layout>
msa::cuda::CudnnSdpaArgs ragged_args(const Call& call, const Layout& l, const void* k, const void* v,
                                     void* workspace) {
  msa::cuda::CudnnSdpaArgs args;
  args.q = call.q;
  args.k = k;
  args.v = v;
  args.o = call.o;
  args.seq_len_q = reinterpret_cast<const int32_t*>(call.metadata + l.seq_len_q);
  args.seq_len_kv = reinterpret_cast<const int32_t*>(call.metadata + l.seq_len_kv);
  args.q_offsets = reinterpret_cast<const int32_t*>(call.metadata + l.q_offsets);
  args.workspace = workspace;
  return args;
}

void CudnnDenseAttention::run(const CudnnGatheredCall& call, void* workspace, void* stream) {
  const CudnnGatheredMetadataLayout l = cudnn_gathered_metadata_layout(call.geometry);
  msa::cuda::CudnnSdpaArgs args = ragged_args(call, l, call.k, call.v, workspace);
  args.k_offsets = reinterpret_cast<const int32_t*>(call.metadata + l.k_offsets);
  plans_->prepared(Plans::shape_of(call)).run(args, stream);
}

void CudnnDenseAttention::run(const CudnnDenseCall& call, void* workspace, void* stream) {
  const CudnnDenseMetadataLayout l = cudnn_dense_metadata_layout(call.geometry);
  msa::cuda::CudnnSdpaArgs args = ragged_args(call, l, call.k_cache, call.v_cache, workspace);
  args.page_table = reinterpret_cast<const int32_t*>(call.metadata + l.page_table);
  plans_->prepared(Plans::shape_of(call)).run(args, stream);
}

int64_t CudnnDenseAttention::plans() const { return static_cast<int64_t>(plans_->built.size()); }

#else  // a CUDA build without cuDNN: the engine cannot be chosen (Model refuses it first)

struct CudnnDenseAttention::Plans {};

CudnnDenseAttention::CudnnDenseAttention() : plans_(std::make_unique<Plans>()) {}
CudnnDenseAttention::~CudnnDenseAttention() = default;

size_t CudnnDenseAttention::prepare(const CudnnDenseCall&) {
  throw Error("dense attention engine cudnn: this build of msa has no cuDNN");
}

size_t CudnnDenseAttention::prepare(const CudnnGatheredCall&) {
  throw Error("dense attention engine cudnn-gathered: this build of msa has no cuDNN");
}

void CudnnDenseAttention::run(const CudnnDenseCall&, void*, void*) {
  throw Error("dense attention engine cudnn: this build of msa has no cuDNN");
}

void CudnnDenseAttention::run(const CudnnGatheredCall&, void*, void*) {
  throw Error("dense attention engine cudnn-gathered: this build of msa has no cuDNN");
}

int64_t CudnnDenseAttention::plans() const { return 0; }

#endif

}  // namespace msa::model::gpu
