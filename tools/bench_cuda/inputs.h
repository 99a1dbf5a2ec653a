// msa bench --device cuda: what the prefill, decode and training rows build alike from the
// Config: key layouts, the indexer's and the attention kernels' parameters, how many input
// sets to rotate through, the MSA == dense gate and the cuDNN baseline.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>

#include "bench_cuda/common.h"
#include "bench_cuda/bench_kernels.h"
#include "cuda/common/sequence_geometry.h"
#ifdef MSA_WITH_CUDNN
#include "cudnn/cudnn_sdpa.h"
#endif

namespace msa::cli::bench_cuda {

// Varlen keys [tokens, heads, dim] (sequence b starts at token k_start[b]) in blocks of
// `block` tokens.
inline cuda::KeyLayout varlen_keys(const DeviceBuffer& data, int64_t heads, int64_t dim, int64_t block,
                                   const DeviceBuffer& k_start) {
  cuda::KeyLayout l;
  l.data = data.as<uint16_t>();
  l.block_size = block;
  l.token_stride = heads * dim;
  l.head_stride = dim;
  l.block_stride = block * heads * dim;
  l.seq_token_start = k_start.as<int64_t>();
  return l;
}

// Paged keys [pages, heads, block, dim] through `table` [sequences, table_stride]; with
// `page_fault`, every page id read is checked against [0, pages) as DecodePlan has it
// (KeyLayout::page_fault).
inline cuda::KeyLayout paged_keys(const DeviceBuffer& data, int64_t heads, int64_t dim, int64_t block,
                                  const DeviceBuffer& table, int64_t table_stride,
                                  cuda::GeometryStatus* page_fault = nullptr, int64_t pages = 0) {
  cuda::KeyLayout l;
  l.data = data.as<uint16_t>();
  l.block_size = block;
  l.token_stride = dim;
  l.head_stride = block * dim;
  l.block_stride = heads * block * dim;
  l.page_table = table.as<int32_t>();
  l.page_table_stride = table_stride;
  l.page_fault = page_fault;
  l.pages = pages;
  return l;
}

// The indexer of the Config's shape and selection parameters over index queries `qi` and
// keys `ki`, its rows into `topk_out`, no LSE.
inline cuda::IndexerLaunch indexer_params(const Config& c, const DeviceBuffer& qi, const cuda::KeyLayout& ki,
                                          const cuda::BatchLayout& batch, const DeviceBuffer& topk_out) {
  cuda::IndexerLaunch ip;
  ip.qi = qi.as<uint16_t>();
  ip.heads = c.kv_heads;  // one index head per KV group
  ip.dim = c.index_dim;
  ip.ki = ki;
  ip.batch = batch;
  ip.block_size = c.params.block_size;
  ip.topk = c.params.topk;
  ip.local_blocks = c.params.local_blocks;
  ip.init_blocks = c.params.init_blocks;
  ip.logit_scale = index_logit_scale(c);
  ip.topk_out = topk_out.as<int32_t>();
  ip.lse_out = nullptr;
  return ip;
}

// The inputs of sparse attention of the Config's shape and scale, forward or backward
// (cuda::AttentionLaunch and cuda::AttentionBackwardLaunch name them alike): q, k, v and
// the selection rows `topk` (topk slots each). Outputs are the caller's.
template <class Params>
void set_sparse_inputs(Params& p, const Config& c, const DeviceBuffer& q, const cuda::KeyLayout& k,
                       const cuda::KeyLayout& v, const cuda::BatchLayout& batch, const DeviceBuffer& topk) {
  p.q = q.as<uint16_t>();
  p.k = k;
  p.v = v;
  p.q_heads = c.heads;
  p.kv_heads = c.kv_heads;
  p.head_dim = c.head_dim;
  p.batch = batch;
  p.topk = topk.as<int32_t>();
  p.slots = c.params.topk;
  p.scale = main_scale(c);
}

// The same call over every causal key: dense attention (no selection rows).
template <class Params>
Params dense_of(Params p) {
  p.topk = nullptr;
  p.slots = 0;
  return p;
}

// Input sets to rotate through so that repeated calls do not run from L2: --rotate-mb
// worth of sets of `set_bytes`, 1 .. `most`.
inline int64_t rotation_sets(const Config& c, size_t set_bytes, int64_t most) {
  return std::clamp<int64_t>(static_cast<int64_t>(std::ceil(c.rotate_bytes / static_cast<double>(set_bytes))),
                             1, most);
}

// The MSA == dense gate: `sparse` run again with its output in `o_msa`, its relative L2
// error against the dense output `o` (`elems` floats).
inline double msa_dense_error(cuda::AttentionLaunch sparse, const DeviceBuffer& o_msa, const DeviceBuffer& o,
                              size_t elems, const DeviceBuffer& workspace, cudaStream_t stream) {
  sparse.o = o_msa.as<float>();
  cuda::attention(sparse, workspace.get(), stream);
  return cuda::bench::relative_l2_error(o_msa.as<float>(), o.get(), false, elems, stream);
}

#ifdef MSA_WITH_CUDNN
// cuDNN's causal SDPA at the Config's heads and scale: `batch` requests of q_len queries
// over k_len keys (contiguous; a paged caller adds the page fields).
inline cuda::CudnnSdpaShape causal_sdpa_shape(const Config& c, int64_t batch, int64_t q_len, int64_t k_len) {
  cuda::CudnnSdpaShape shape;
  shape.batch = batch;
  shape.q_heads = c.heads;
  shape.kv_heads = c.kv_heads;
  shape.head_dim = c.head_dim;
  shape.q_len = q_len;
  shape.k_len = k_len;
  shape.scale = main_scale(c);
  shape.causal = true;
  return shape;
}

// The cuDNN baseline for `shape` (its plan named in row.cudnn_plan) and its bf16 output
// buffer `o_ref` of `o_ref_bytes`; null, with the reason in row.cudnn_note, where cuDNN
// cannot run it.
inline std::unique_ptr<cuda::CudnnSdpa> try_cudnn_sdpa(const cuda::CudnnSdpaShape& shape, Row& row,
                                                       DeviceBuffer& o_ref, size_t o_ref_bytes) {
  std::unique_ptr<cuda::CudnnSdpa> sdpa;
  try {
    sdpa = std::make_unique<cuda::CudnnSdpa>(shape);
    row.cudnn_plan = sdpa->plan_name();
    o_ref = DeviceBuffer(o_ref_bytes);
  } catch (const std::exception& e) {
    row.cudnn_note = e.what();
    std::fprintf(stderr, "[bench]   cuDNN SDPA%s unavailable: %s\n", shape.block_size > 0 ? " (paged)" : "",
                 e.what());
  }
  return sdpa;
}
#endif

}  // namespace msa::cli::bench_cuda
