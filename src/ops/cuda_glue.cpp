#include "cuda_glue.h"

#include <vector>

#include "cuda/device_buffer.h"
#include "cuda/launch.h"

namespace msa::detail {

namespace {

using cuda::DeviceBuffer;

DeviceBuffer upload_as(const Tensor& tensor, DType dtype) {
  const Tensor converted = tensor.dtype() == dtype ? tensor : tensor.to(dtype);
  DeviceBuffer buffer(converted.nbytes());
  buffer.upload(converted.raw(), converted.nbytes());
  return buffer;
}

// Request geometry on the device; the vectors stay alive as long as this object.
struct DeviceBatch {
  DeviceBuffer q_start, k_len, seq_of_query, k_start;
  cuda::BatchLayout layout;

  explicit DeviceBatch(const Batch& batch)
      : q_start(DeviceBuffer::from(batch.q_start)),
        k_len(DeviceBuffer::from(batch.k_len)),
        seq_of_query(DeviceBuffer::from(batch.seq_of_query)),
        k_start(DeviceBuffer::from(batch.k_start.empty() ? std::vector<int64_t>{0}
                                                         : batch.k_start)) {
    layout.q_start = q_start.as<int64_t>();
    layout.k_len = k_len.as<int64_t>();
    layout.seq_of_query = seq_of_query.as<int32_t>();
    layout.batch = batch.size();
    layout.total_q = batch.total_q();
    for (int64_t b = 0; b < batch.size(); ++b) {
      layout.max_k_len = std::max(layout.max_k_len, batch.k_len[b]);
      layout.max_q_len = std::max(layout.max_q_len, batch.q_len(b));
    }
  }
};

// A key tensor on the device and its layout.
struct DeviceKeys {
  DeviceBuffer values;
  cuda::KeyLayout layout;

  DeviceKeys(HostKeys keys, int64_t block_size, const DeviceBatch& batch,
             const DeviceBuffer* page_table, int64_t page_table_stride)
      : values(upload_as(keys.values, DType::bf16)) {
    layout.data = values.as<uint16_t>();
    layout.block_size = block_size;
    if (page_table) {  // [pages, heads, B, dim]
      layout.token_stride = keys.dim;
      layout.head_stride = block_size * keys.dim;
      layout.block_stride = keys.heads * block_size * keys.dim;
      layout.page_table = page_table->as<int32_t>();
      layout.page_table_stride = page_table_stride;
    } else {  // [total, heads, dim]
      layout.token_stride = keys.heads * keys.dim;
      layout.head_stride = keys.dim;
      layout.block_stride = block_size * keys.heads * keys.dim;
      layout.seq_token_start = batch.k_start.as<int64_t>();
    }
  }
};

Tensor download(const DeviceBuffer& buffer, const Shape& shape, DType dtype) {
  Tensor out = Tensor::zeros(shape, dtype);
  buffer.download(out.raw(), out.nbytes());
  return out;
}

DeviceBuffer poisoned(size_t bytes) {
  DeviceBuffer buffer(bytes);
  buffer.fill_bytes(0xff);  // f32 NaN, int32 -1 ... topk rows are checked for structure
  return buffer;
}

}  // namespace

IndexerOutput cuda_indexer(const Tensor& qi, HostKeys keys, const Batch& batch,
                           const Tensor* page_table, const MsaParams& params, double index_scale,
                           bool want_lse) {
  const DeviceBatch device_batch(batch);
  const DeviceBuffer d_page_table = page_table ? upload_as(*page_table, DType::i32) : DeviceBuffer();
  const DeviceKeys d_keys(keys, params.block_size, device_batch, page_table ? &d_page_table : nullptr,
                          page_table ? page_table->size(1) : 0);
  const DeviceBuffer d_qi = upload_as(qi, DType::bf16);
  const int64_t heads = qi.size(1);
  // topk is poisoned with 0x7f bytes (a huge id) so an unwritten slot can never pass.
  DeviceBuffer d_topk(static_cast<size_t>(heads * batch.total_q() * params.topk) * 4);
  d_topk.fill_bytes(0x7f);
  DeviceBuffer d_lse = want_lse ? poisoned(static_cast<size_t>(heads * batch.total_q()) * 4)
                                : DeviceBuffer();

  cuda::IndexerParams p;
  p.qi = d_qi.as<uint16_t>();
  p.heads = heads;
  p.dim = qi.size(2);
  p.ki = d_keys.layout;
  p.batch = device_batch.layout;
  p.block_size = params.block_size;
  p.topk = params.topk;
  p.local_blocks = params.local_blocks;
  p.init_blocks = params.init_blocks;
  p.logit_scale = static_cast<float>(index_scale / params.temperature);
  p.topk_out = d_topk.as<int32_t>();
  p.lse_out = want_lse ? d_lse.as<float>() : nullptr;
  DeviceBuffer workspace(cuda::indexer_workspace_bytes(p));
  cuda::indexer(p, workspace.get(), nullptr);
  cuda::synchronize();

  IndexerOutput out;
  out.topk = download(d_topk, {heads, batch.total_q(), params.topk}, DType::i32);
  if (want_lse) out.lse = download(d_lse, {heads, batch.total_q()}, DType::f32);
  return out;
}

AttentionOutput cuda_attention(const Tensor& q, HostKeys k, HostKeys v, const Batch& batch,
                               const Tensor* page_table, const Tensor* topk,
                               const AttentionDims& dims, int64_t block_size, double scale) {
  const DeviceBatch device_batch(batch);
  const DeviceBuffer d_page_table = page_table ? upload_as(*page_table, DType::i32) : DeviceBuffer();
  const DeviceBuffer* table = page_table ? &d_page_table : nullptr;
  const int64_t table_stride = page_table ? page_table->size(1) : 0;
  const DeviceKeys d_k(k, block_size, device_batch, table, table_stride);
  const DeviceKeys d_v(v, block_size, device_batch, table, table_stride);
  const DeviceBuffer d_q = upload_as(q, DType::bf16);
  const DeviceBuffer d_topk = topk ? upload_as(*topk, DType::i32) : DeviceBuffer();
  DeviceBuffer d_o = poisoned(static_cast<size_t>(q.numel()) * 4);
  DeviceBuffer d_lse = poisoned(static_cast<size_t>(batch.total_q() * dims.q_heads) * 4);

  cuda::AttentionParams p;
  p.q = d_q.as<uint16_t>();
  p.k = d_k.layout;
  p.v = d_v.layout;
  p.q_heads = dims.q_heads;
  p.kv_heads = dims.kv_heads;
  p.head_dim = dims.head_dim;
  p.batch = device_batch.layout;
  p.topk = topk ? d_topk.as<int32_t>() : nullptr;
  p.slots = topk ? topk->size(2) : 0;
  p.scale = static_cast<float>(scale);
  p.o = d_o.as<float>();
  p.lse = d_lse.as<float>();
  DeviceBuffer workspace(cuda::attention_workspace_bytes(p));
  cuda::attention(p, workspace.get(), nullptr);
  cuda::synchronize();

  return {download(d_o, q.shape(), DType::f32),
          download(d_lse, {batch.total_q(), dims.q_heads}, DType::f32)};
}

}  // namespace msa::detail
