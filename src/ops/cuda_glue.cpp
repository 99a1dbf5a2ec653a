#include "cuda_glue.h"

#include <optional>
#include <vector>

#include "cuda/common/device_buffer.h"
#include "msa/cuda/attention.h"
#include "cuda_glue_device.h"

namespace msa::detail {

IndexerOutput cuda_indexer(const Tensor& qi, HostKeys keys, const Batch& batch,
                           const Tensor* page_table, const MsaParams& params, double index_scale,
                           bool want_lse, const Tensor* key_scale) {
  const DeviceSequences sequences(batch, page_table != nullptr);
  const DeviceBuffer d_page_table = page_table ? upload_as(*page_table, DType::i32) : DeviceBuffer();
  const int64_t table_stride = page_table ? page_table->size(1) : 0;
  // Quantized (paged) index keys travel as stored, codes and scales, for the kernels to
  // read directly; float keys as bf16.
  std::optional<DeviceKeys> d_keys;
  DeviceBuffer d_codes, d_scales;
  cuda::IndexerParams p;
  if (key_scale) {
    d_codes = upload_as(keys.values, keys.values.dtype());
    d_scales = upload_as(*key_scale, key_scale->dtype());
    p.ki.page_table = d_page_table.as<int32_t>();
    p.ki.page_table_stride = table_stride;
    p.ki_format = keys.values.dtype() == DType::e4m3 ? cuda::KeyFormat::fp8 : cuda::KeyFormat::fp4;
    p.ki_quantized = {d_codes.as<uint8_t>(), d_scales.as<uint8_t>()};
  } else {
    d_keys.emplace(keys, params.block_size, page_table ? &d_page_table : nullptr, table_stride);
    p.ki = d_keys->keys;
  }
  const DeviceBuffer d_qi = upload_as(qi, DType::bf16);
  const int64_t heads = qi.size(1);
  // topk is poisoned with 0x7f bytes (a huge id) so an unwritten slot can never pass.
  DeviceBuffer d_topk(static_cast<size_t>(heads * batch.total_q() * params.topk) * 4);
  d_topk.fill_bytes(0x7f);
  DeviceBuffer d_lse = want_lse ? poisoned(static_cast<size_t>(heads * batch.total_q()) * 4)
                                : DeviceBuffer();

  p.qi = d_qi.as<uint16_t>();
  p.heads = heads;
  p.dim = qi.size(2);
  p.seqs = sequences.seqs;
  p.block_size = params.block_size;
  p.topk = params.topk;
  p.local_blocks = params.local_blocks;
  p.init_blocks = params.init_blocks;
  p.logit_scale = static_cast<float>(index_scale / params.temperature);
  p.topk_out = d_topk.as<int32_t>();
  p.lse_out = want_lse ? d_lse.as<float>() : nullptr;
  p.fp8_compute = params.index_compute == IndexCompute::fp8;
  p.ki_tokens = key_scale ? 0 : keys.values.numel() / keys.dim;  // varlen total_k, paged pages * B
  p.scan_engine = params.cuda.index_scan;
  DeviceBuffer workspace(cuda::indexer_workspace_bytes(p));
  // Quantized keys (decode path): the workspace holds the block maxima, every entry the
  // select reads written by the scan. Poison it (0x7f: a huge score an unwritten block would
  // win with), so that the maxima of a previous call (cudaMalloc hands back the freed
  // workspace) cannot stand in for a scan that skipped them (tests run scans back to back).
  // fp8 compute likewise: its split mode's block maxima live there too.
  if ((key_scale && cuda::indexer_uses_decode_path(p)) || p.fp8_compute)
    workspace.fill_bytes(0x7f);
  cuda::indexer(p, workspace.get(), nullptr);
  cuda::synchronize();

  IndexerOutput out;
  out.topk = download(d_topk, {heads, batch.total_q(), params.topk}, DType::i32);
  if (want_lse) out.lse = download(d_lse, {heads, batch.total_q()}, DType::f32);
  return out;
}

AttentionOutput cuda_attention(const Tensor& q, HostKeys k, HostKeys v, const Batch& batch,
                               const Tensor* page_table, const Tensor* topk,
                               const AttentionDims& dims, const MsaParams& params, double scale,
                               cuda::OutputType o_type) {
  const DeviceSequences sequences(batch, page_table != nullptr);
  const DeviceBuffer d_page_table = page_table ? upload_as(*page_table, DType::i32) : DeviceBuffer();
  const DeviceBuffer* table = page_table ? &d_page_table : nullptr;
  const int64_t table_stride = page_table ? page_table->size(1) : 0;
  const DeviceKeys d_k(k, params.block_size, table, table_stride);
  const DeviceKeys d_v(v, params.block_size, table, table_stride);
  const DeviceBuffer d_q = upload_as(q, DType::bf16);
  const DeviceBuffer d_topk = topk ? upload_as(*topk, DType::i32) : DeviceBuffer();
  const size_t o_bytes = o_type == cuda::OutputType::bf16 ? 2 : 4;
  DeviceBuffer d_o = poisoned(static_cast<size_t>(q.numel()) * o_bytes);
  DeviceBuffer d_lse = poisoned(static_cast<size_t>(batch.total_q() * dims.q_heads) * 4);

  cuda::AttentionParams p;
  p.q = d_q.as<uint16_t>();
  p.k = d_k.keys;
  p.v = d_v.keys;
  p.q_heads = dims.q_heads;
  p.kv_heads = dims.kv_heads;
  p.head_dim = dims.head_dim;
  p.seqs = sequences.seqs;
  p.block_size = params.block_size;
  p.topk = topk ? d_topk.as<int32_t>() : nullptr;
  p.slots = topk ? topk->size(2) : 0;
  p.scale = static_cast<float>(scale);
  p.o = d_o.get();
  p.o_type = o_type;
  p.lse = d_lse.as<float>();
  p.sparse_engine = params.cuda.sparse;
  p.sparse_q_load = params.cuda.sparse_q_load;
  p.dense_engine = params.cuda.dense;
  p.max_chunk_queries = params.cuda.max_chunk_queries;
  DeviceBuffer workspace(cuda::attention_workspace_bytes(p));
  cuda::attention(p, workspace.get(), nullptr);
  cuda::synchronize();

  return {download(d_o, q.shape(), o_type == cuda::OutputType::bf16 ? DType::bf16 : DType::f32),
          download(d_lse, {batch.total_q(), dims.q_heads}, DType::f32)};
}

}  // namespace msa::detail
