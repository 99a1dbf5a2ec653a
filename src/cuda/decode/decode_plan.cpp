// DecodePlan (msa/cuda/decode_plan.h): capacities -> launch params of msa_forward, workspace
// layout, host checks of a step, and the device geometry kernel in front of msa_forward.
#include "msa/cuda/decode_plan.h"

#include <cmath>
#include <string>

#include "cuda/common/sequence_geometry.h"
#include "cuda/launch.h"
#include "cuda/common/workspace_layout.h"
#include "msa/error.h"

namespace msa::cuda {

namespace {

constexpr int64_t kMaxDecodeQueries = 16;  // the decode kernels' bound (launch.h)

bool aligned(const void* pointer, size_t bytes) {
  return reinterpret_cast<uintptr_t>(pointer) % bytes == 0;
}

// `offset` bytes into `base`, or null for a null base (plan() sizes with no workspace).
template <class T>
T* at(void* base, size_t offset) {
  return base ? reinterpret_cast<T*>(static_cast<char*>(base) + offset) : nullptr;
}

// Workspace sizing and the path choice read no pointer, but the launchers check that the
// selection output is given: plan() describes its sizing step with this stand-in, which is
// never dereferenced.
alignas(16) int32_t sizing_topk_stand_in[4];

void require_pointer(const void* pointer, const char* name) {
  MSA_CHECK_ARG(pointer != nullptr, name, "a device pointer", "null");
}

void require_aligned16(const void* pointer, const char* name) {
  MSA_CHECK_ARG(aligned(pointer, 16), name, "16-byte aligned data", "a misaligned pointer");
}

}  // namespace

DecodePlan::DecodePlan(const DecodeCapacities& capacities, const DecodeDims& dims,
                       const MsaParams& params)
    : capacities_(capacities), dims_(dims), params_(params) {
  validate_params(params_);
  MSA_CHECK_ARG(params_.index_compute == IndexCompute::exact, "index_compute",
                "exact (the decode indexer has no fp8 compute; fp8 index-key caches cut its reads)",
                index_compute_name(params_.index_compute));
  DecodeCapacities& c = capacities_;
  MSA_CHECK_ARG(c.max_batch >= 1 && c.max_batch <= (int64_t{1} << 30), "max_batch",
                "1 .. 2^30 request slots", c.max_batch);
  MSA_CHECK_ARG(c.max_queries >= 1 && c.max_queries <= kMaxDecodeQueries, "max_queries",
                "1 .. 16 new tokens per request (the decode path)", c.max_queries);
  if (c.max_total_queries == 0) c.max_total_queries = c.max_batch * c.max_queries;
  MSA_CHECK_ARG(c.max_total_queries >= c.max_queries &&
                    c.max_total_queries <= c.max_batch * c.max_queries &&
                    c.max_total_queries <= INT32_MAX,
                "max_total_queries",
                "max_queries .. max_batch * max_queries = " + std::to_string(c.max_batch * c.max_queries) +
                    " (0 for the latter)",
                c.max_total_queries);
  MSA_CHECK_ARG(c.max_context >= 1 && c.max_context <= INT32_MAX, "max_context",
                "1 .. 2^31 - 1 tokens (seq_lens are int32)", c.max_context);
  MSA_CHECK_ARG(dims_.q_heads >= 1 && dims_.kv_heads >= 1 && dims_.head_dim >= 1 &&
                    dims_.index_dim >= 1,
                "dims", "positive head counts and dims",
                std::to_string(dims_.q_heads) + ", " + std::to_string(dims_.kv_heads) + ", " +
                    std::to_string(dims_.head_dim) + ", " + std::to_string(dims_.index_dim));
  if (params_.scale == 0) params_.scale = 1.0 / std::sqrt(static_cast<double>(dims_.head_dim));

  // Workspace: the step's geometry, then msa_forward's (each region 256-byte aligned).
  WorkspaceCursor ws;
  q_start_offset_ = ws.take(size_t(c.max_batch + 1) * sizeof(int64_t));
  k_len_offset_ = ws.take(size_t(c.max_batch) * sizeof(int64_t));
  seq_of_query_offset_ = ws.take(size_t(c.max_total_queries) * sizeof(int32_t));
  status_offset_ = ws.take(sizeof(GeometryStatus));
  forward_offset_ = ws.at;

  DecodeStep sizing;
  sizing.topk = sizing_topk_stand_in;
  const MsaForwardLaunch forward = forward_launch(sizing);
  // msa_forward's own rule, on the capacity: dense where every context <= topk * B.
  dense_ = msa_is_dense(forward.index);
  if (!dense_) {  // the sparse path must be the decode kernels' (capacity-safe) one
    MSA_CHECK_ARG(params_.topk > params_.local_blocks + params_.init_blocks, "topk",
                  "more than local_blocks + init_blocks = " +
                      std::to_string(params_.local_blocks + params_.init_blocks) +
                      " for a sparse decode plan (max_context > topk * block_size)",
                  params_.topk);
    MSA_CHECK_ARG(indexer_uses_decode_path(forward.index), "max_total_queries x max_context",
                  "block maxima within the decode indexer's workspace cap",
                  std::to_string(c.max_total_queries) + " x " + std::to_string(c.max_context));
    MSA_CHECK_ARG(attention_uses_decode_path(forward.attention), "topk",
                  "a selection size the sparse decode attention takes", params_.topk);
  }
  workspace_bytes_ = forward_offset_ + msa_forward_workspace_bytes(forward);
}

MsaForwardLaunch DecodePlan::forward_launch(const DecodeStep& step) const {
  const DecodeCapacities& c = capacities_;
  const int64_t B = params_.block_size;
  BatchLayout batch;
  batch.q_start = at<int64_t>(step.workspace, q_start_offset_);
  batch.k_len = at<int64_t>(step.workspace, k_len_offset_);
  batch.seq_of_query = at<int32_t>(step.workspace, seq_of_query_offset_);
  batch.batch = c.max_batch;
  batch.total_q = c.max_total_queries;
  batch.max_k_len = c.max_context;
  batch.max_q_len = c.max_queries;

  // Paged caches as KeyLayout: K/V [pages, Hkv, B, D], index keys [pages, B, Di].
  KeyLayout k;
  k.block_size = B;
  k.token_stride = dims_.head_dim;
  k.head_stride = B * dims_.head_dim;
  k.block_stride = dims_.kv_heads * B * dims_.head_dim;
  k.page_table = step.page_table;
  k.page_table_stride = step.page_table_stride;
  k.page_fault = at<GeometryStatus>(step.workspace, status_offset_);  // v and index keys too
  k.pages = step.num_pages;
  KeyLayout v = k;
  k.data = step.k_cache;
  v.data = step.v_cache;
  KeyLayout index_keys = k;
  index_keys.data = step.index_key_cache;
  index_keys.token_stride = dims_.index_dim;
  index_keys.head_stride = B * dims_.index_dim;
  index_keys.block_stride = B * dims_.index_dim;

  MsaForwardLaunch forward;
  IndexerLaunch& index = forward.index;
  index.qi = step.qi;
  index.heads = dims_.kv_heads;
  index.dim = dims_.index_dim;
  index.ki = index_keys;
  index.batch = batch;
  index.block_size = params_.block_size;
  index.topk = params_.topk;
  index.local_blocks = params_.local_blocks;
  index.init_blocks = params_.init_blocks;
  index.topk_out = step.topk;
  index.lse_out = nullptr;  // decode needs no selected LSE (training only)

  AttentionLaunch& attention = forward.attention;
  attention.q = step.q;
  attention.k = k;
  attention.v = v;
  attention.q_heads = dims_.q_heads;
  attention.kv_heads = dims_.kv_heads;
  attention.head_dim = dims_.head_dim;
  attention.batch = batch;
  attention.topk = step.topk;  // msa_forward drops it on the dense path
  attention.slots = params_.topk;
  attention.scale = static_cast<float>(params_.scale);
  attention.o = step.o;
  attention.o_type = step.o_type;
  attention.lse = step.lse;
  attention.kv_format = step.kv_format;  // fp8: the codes keep k / v's layout, in bytes
  attention.k_fp8 = step.k_fp8;
  attention.v_fp8 = step.v_fp8;
  return forward;
}

void DecodePlan::run(const DecodeStep& step, Stream stream) const {
  // Host-known values only: lengths live on the device (checked there).
  require_pointer(step.q, "q");
  const bool fp8 = step.kv_format == KvFormat::fp8;
  MSA_CHECK_ARG(fp8 || step.kv_format == KvFormat::bf16, "kv_format", "bf16 or fp8",
                static_cast<int>(step.kv_format));
  if (fp8) {
    require_pointer(step.k_fp8.codes, "k_fp8.codes");
    require_pointer(step.v_fp8.codes, "v_fp8.codes");
    require_pointer(step.k_fp8.scales.data, "k_fp8.scales");
    require_pointer(step.v_fp8.scales.data, "v_fp8.scales");
    require_aligned16(step.k_fp8.codes, "k_fp8.codes");
    require_aligned16(step.v_fp8.codes, "v_fp8.codes");
  } else {
    require_pointer(step.k_cache, "k_cache");
    require_pointer(step.v_cache, "v_cache");
    require_aligned16(step.k_cache, "k_cache");
    require_aligned16(step.v_cache, "v_cache");
  }
  require_pointer(step.page_table, "page_table");
  require_pointer(step.cu_seqlens_q, "cu_seqlens_q");
  require_pointer(step.seq_lens, "seq_lens");
  require_pointer(step.o, "o");
  require_pointer(step.lse, "lse");
  require_pointer(step.workspace, "workspace");
  if (!dense_) {
    require_pointer(step.qi, "qi");
    require_pointer(step.index_key_cache, "index_key_cache");
    require_pointer(step.topk, "topk");
  }
  require_aligned16(step.q, "q");
  MSA_CHECK_ARG(aligned(step.workspace, kWorkspaceAlign), "workspace",
                "a 256-byte aligned pointer", "a misaligned pointer");
  const int64_t pages = ceil_div(capacities_.max_context, params_.block_size);
  MSA_CHECK_ARG(step.num_pages >= 1 && step.num_pages <= (int64_t{1} << 31), "num_pages",
                "the caches' page count, 1 .. 2^31 (page ids are int32)", step.num_pages);
  MSA_CHECK_ARG(step.page_table_stride >= pages, "page_table_stride",
                "at least ceil(max_context / block_size) = " + std::to_string(pages) + " columns",
                step.page_table_stride);

  SequenceGeometryArgs geometry;
  geometry.seqs = {.cu_seqlens_q = step.cu_seqlens_q,
                   .seq_lens = step.seq_lens,
                   .batch = capacities_.max_batch,
                   .total_q = capacities_.max_total_queries,
                   .max_seqlen_q = capacities_.max_queries,
                   .max_seqlen_k = capacities_.max_context};
  geometry.q_start = at<int64_t>(step.workspace, q_start_offset_);
  geometry.k_len = at<int64_t>(step.workspace, k_len_offset_);
  geometry.seq_of_query = at<int32_t>(step.workspace, seq_of_query_offset_);
  geometry.status = at<GeometryStatus>(step.workspace, status_offset_);
  derive_sequence_geometry(geometry, stream);
  msa_forward(forward_launch(step), at<char>(step.workspace, forward_offset_), stream);
}

const void* DecodePlan::step_status(const DecodeStep& step) const {
  require_pointer(step.workspace, "workspace");
  static_assert(sizeof(GeometryStatus) == kStepStatusBytes);
  return at<GeometryStatus>(step.workspace, status_offset_);
}

void DecodePlan::check_last_step(const DecodeStep& step, Stream stream) const {
  require_pointer(step.workspace, "workspace");
  const GeometryStatus status =
      read_geometry_status(at<GeometryStatus>(step.workspace, status_offset_), stream);
  const std::string b = std::to_string(status.request);
  const std::string next = std::to_string(int64_t{status.request} + 1);
  const std::string skipped = " (the step computed nothing)";
  switch (status.error) {
    case GeometryError::none:
      return;
    case GeometryError::first_offset:
      throw_arg_error("cu_seqlens_q[0]", "0" + skipped, status.value);
    case GeometryError::negative_queries:
      throw_arg_error("cu_seqlens_q[" + next + "] - cu_seqlens_q[" + b + "]",
                      "non-decreasing offsets" + skipped, status.value);
    case GeometryError::too_many_queries:
      throw_arg_error("cu_seqlens_q[" + next + "] - cu_seqlens_q[" + b + "]",
                      "at most max_queries = " + std::to_string(capacities_.max_queries) +
                          " new tokens" + skipped,
                      status.value);
    case GeometryError::too_many_rows:
      throw_arg_error("cu_seqlens_q[" + next + "]",
                      "at most max_total_queries = " +
                          std::to_string(capacities_.max_total_queries) + skipped,
                      status.value);
    case GeometryError::too_few_tokens:
      throw_arg_error("seq_lens[" + b + "]",
                      "at least the request's new tokens (its query count)" + skipped,
                      status.value);
    case GeometryError::context_too_long:
      throw_arg_error("seq_lens[" + b + "]",
                      "at most max_context = " + std::to_string(capacities_.max_context) +
                          " tokens" + skipped,
                      status.value);
    case GeometryError::page_out_of_range:
      throw_arg_error("page_table[" + b + ", " + std::to_string(page_fault_block(status.value)) + "]",
                      "a page of the caches, 0 .. num_pages - 1 = " + std::to_string(step.num_pages - 1) +
                          " (the step read page 0 in its place; its outputs are unspecified)",
                      page_fault_id(status.value));
  }
  MSA_FAIL("decode step: unknown geometry status ", static_cast<int32_t>(status.error),
           " for request ", status.request);
}

}  // namespace msa::cuda
