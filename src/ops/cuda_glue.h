// Impl::cuda for the op API: uploads validated host tensors (as bf16) and the sequences,
// runs the public device API (msa/cuda/*.h), and downloads f32/int32 results.
// Outputs are poisoned on the device first, so an element a kernel forgets to write
// comes back as NaN (or an out-of-range id) and fails every test.
#pragma once
#include <vector>

#include "batch.h"
#include "msa/ops.h"

namespace msa::cuda {
class DeviceBuffer;
}

namespace msa::detail {

// Keys described like KeyBlocks: varlen [total, heads, dim] with batch.k_start when
// `page_table` is null, else a paged cache [pages, heads, B, dim].
struct HostKeys {
  const Tensor& values;
  int64_t heads, dim;
};

// `key_scale` (paged only) marks quantized index keys (msa/quantized_index_keys.h): `keys`
// then holds their codes (e4m3 or u8), uploaded as stored with the scales.
IndexerOutput cuda_indexer(const Tensor& qi, HostKeys keys, const Batch& batch,
                           const Tensor* page_table, const MsaParams& params, double index_scale,
                           bool want_lse, const Tensor* key_scale = nullptr);

// o comes back as f32 or, with o_type bf16, bf16 (the kernels' own rounding of their f32
// results: the device API's bf16 outputs are tested through it). `k_scale` / `v_scale` (paged
// only) mark fp8 K/V (msa/quantized_kv_cache.h): k and v then hold e4m3 codes, uploaded as
// stored with their scales.
AttentionOutput cuda_attention(const Tensor& q, HostKeys k, HostKeys v, const Batch& batch,
                               const Tensor* page_table, const Tensor* topk,
                               const AttentionDims& dims, const MsaParams& params, double scale,
                               cuda::OutputType o_type = cuda::OutputType::f32,
                               const Tensor* k_scale = nullptr, const Tensor* v_scale = nullptr);

// append_kv_cache (msa/ops.h) on validated arguments: the fp8 cache's codes and scales go to
// the device, msa::cuda::append_kv_fp8 writes the new tokens (k, v as bf16 or f32, as given:
// f16 and f64 as f32), and the cache comes back. Float caches are refused (msa::Error).
void cuda_append_kv(PagedKvCache& cache, const Tensor& k, const Tensor& v,
                    const std::vector<int64_t>& slots);

// Inputs of indexer_kl (validated, varlen): q [total_q, Hq, D], k [total_k, Hkv, D], the
// main-branch lse [total_q, Hq], qi [total_q, Hi, Di], ki [total_k, Di], topk [Hi, total_q, k].
struct KlInputs {
  const Tensor &q, &k, &lse, &qi, &ki, &topk;
  const Tensor* student_lse = nullptr;  // optional [Hi, total_q]: the indexer's selected LSE
};
// `teacher` (optional): the KL's teacher on the device, as cuda_attention_backward's kl_teacher
// wrote it for the same rows. `student_lse_out` (optional, in.student_lse null): receives the
// student LSE the KL computed, [Hi, total_q] f32.
IndexerKlOutput cuda_indexer_kl(const KlInputs& in, const Batch& batch, const AttentionDims& dims,
                                const MsaParams& params, double scale, double index_scale,
                                const cuda::DeviceBuffer* teacher = nullptr, Tensor* student_lse_out = nullptr);

// Inputs of sparse/dense_attention_backward (validated, varlen): q, o, grad_o [total_q, Hq, D],
// k, v [total_k, Hkv, D], lse [total_q, Hq]. topk null = dense causal (cuda_glue_backward.cpp).
struct AttentionBackwardInputs {
  const Tensor &q, &k, &v, &o, &lse, &grad_o;
};
// `kl_teacher` (optional, sparse, group sizes cuda::backward_writes_kl_teacher): allocated and
// filled with the KL's teacher of the selection rows (cuda::AttentionBackwardParams::kl_teacher).
AttentionGrads cuda_attention_backward(const AttentionBackwardInputs& in, const Batch& batch,
                                       const Tensor* topk, const AttentionDims& dims,
                                       const MsaParams& params, double scale,
                                       cuda::DeviceBuffer* kl_teacher = nullptr);

}  // namespace msa::detail
