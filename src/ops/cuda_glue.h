// Impl::cuda for the op API: uploads validated host tensors (as bf16) and the request
// geometry, runs the kernels of src/cuda/launch.h, and downloads f32/int32 results.
// Outputs are poisoned on the device first, so an element a kernel forgets to write
// comes back as NaN (or an out-of-range id) and fails every test.
#pragma once
#include "batch.h"
#include "msa/ops.h"

namespace msa::detail {

// Keys described like KeyBlocks: varlen [total, heads, dim] with batch.k_start when
// `page_table` is null, else a paged cache [pages, heads, B, dim].
struct HostKeys {
  const Tensor& values;
  int64_t heads, dim;
};

IndexerOutput cuda_indexer(const Tensor& qi, HostKeys keys, const Batch& batch,
                           const Tensor* page_table, const MsaParams& params, double index_scale,
                           bool want_lse);

AttentionOutput cuda_attention(const Tensor& q, HostKeys k, HostKeys v, const Batch& batch,
                               const Tensor* page_table, const Tensor* topk,
                               const AttentionDims& dims, int64_t block_size, double scale);

}  // namespace msa::detail
