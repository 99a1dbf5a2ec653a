// Host-side helpers of the Impl::cuda glue (cuda_glue*.cpp): uploads of validated host
// tensors, the request geometry and key layouts on the device, downloads, and poisoned
// output buffers. Host-only (no CUDA headers).
#pragma once
#include <algorithm>
#include <vector>

#include "batch.h"
#include "cuda/device_buffer.h"
#include "cuda/launch.h"
#include "cuda_glue.h"

namespace msa::detail {

using cuda::DeviceBuffer;

inline DeviceBuffer upload_as(const Tensor& tensor, DType dtype) {
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

inline Tensor download(const DeviceBuffer& buffer, const Shape& shape, DType dtype) {
  Tensor out = Tensor::zeros(shape, dtype);
  buffer.download(out.raw(), out.nbytes());
  return out;
}

inline DeviceBuffer poisoned(size_t bytes) {
  DeviceBuffer buffer(bytes);
  buffer.fill_bytes(0xff);  // f32 NaN, int32 -1 ... topk rows are checked for structure
  return buffer;
}

}  // namespace msa::detail
