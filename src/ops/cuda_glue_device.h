// Host-side helpers of the Impl::cuda glue (cuda_glue*.cpp): uploads of validated host
// tensors, the sequences and key layouts of the public device API (msa/cuda/*.h) on the
// device, downloads, and poisoned output buffers. Host-only (no CUDA headers).
#pragma once
#include <algorithm>
#include <vector>

#include "batch.h"
#include "cuda/common/device_buffer.h"
#include "cuda_glue.h"
#include "msa/cuda/types.h"

namespace msa::detail {

using cuda::DeviceBuffer;

inline DeviceBuffer upload_as(const Tensor& tensor, DType dtype) {
  const Tensor converted = tensor.dtype() == dtype ? tensor : tensor.to(dtype);
  DeviceBuffer buffer(converted.nbytes());
  buffer.upload(converted.raw(), converted.nbytes());
  return buffer;
}

// A validated Batch as the int32 arrays of cuda::Sequences: cu_seqlens_q, and cu_seqlens_k
// (packed keys) or seq_lens (paged). The buffers live as long as this object.
struct DeviceSequences {
  DeviceBuffer cu_seqlens_q, cu_seqlens_k, seq_lens;
  cuda::Sequences seqs;

  DeviceSequences(const Batch& batch, bool paged) {
    std::vector<int32_t> cu_q(batch.q_start.begin(), batch.q_start.end());
    cu_seqlens_q = DeviceBuffer::from(cu_q);
    seqs.cu_seqlens_q = cu_seqlens_q.as<int32_t>();
    std::vector<int32_t> keys(batch.k_len.begin(), batch.k_len.end());
    if (paged) {
      seq_lens = DeviceBuffer::from(keys.empty() ? std::vector<int32_t>{0} : keys);
      seqs.seq_lens = seq_lens.as<int32_t>();
    } else {
      std::vector<int32_t> cu_k(batch.size() + 1, 0);
      for (int64_t b = 0; b < batch.size(); ++b)
        cu_k[b + 1] = static_cast<int32_t>(batch.k_start[b] + batch.k_len[b]);
      cu_seqlens_k = DeviceBuffer::from(cu_k);
      seqs.cu_seqlens_k = cu_seqlens_k.as<int32_t>();
    }
    seqs.batch = batch.size();
    seqs.total_q = batch.total_q();
    for (int64_t b = 0; b < batch.size(); ++b) {
      seqs.max_seqlen_k = std::max(seqs.max_seqlen_k, batch.k_len[b]);
      seqs.max_seqlen_q = std::max(seqs.max_seqlen_q, batch.q_len(b));
    }
  }
};

// A key tensor on the device and its cuda::Keys: packed [total, heads, dim] (Batch::k_start
// must be the prefix sums of k_len, as validated batches have them), or paged [pages, heads,
// B, dim] through `page_table`.
struct DeviceKeys {
  DeviceBuffer values;
  cuda::Keys keys;

  DeviceKeys(HostKeys host, int64_t block_size, const DeviceBuffer* page_table,
             int64_t page_table_stride)
      : values(upload_as(host.values, DType::bf16)) {
    keys = page_table ? cuda::paged_keys(values.as<uint16_t>(), host.heads, block_size, host.dim,
                                         page_table->as<int32_t>(), page_table_stride)
                      : cuda::packed_keys(values.as<uint16_t>(), host.heads, host.dim);
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
