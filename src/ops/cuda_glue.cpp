#include "cuda_glue.h"

#include <optional>
#include <vector>

#include "checks.h"
#include "cuda/common/device_buffer.h"
#include "msa/cuda/attention.h"
#include "msa/cuda/quantize.h"
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
  p.ranking = params.cuda.index_ranking;
  p.max_chunk_queries = params.cuda.max_chunk_queries;
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

namespace {
// An fp8 K or V cache on the device (codes as stored, f32 scales) and its cuda::Fp8Kv.
struct DeviceFp8Kv {
  DeviceBuffer codes, scales;
  cuda::Fp8Kv kv;

  DeviceFp8Kv(const Tensor& host_codes, const Tensor& host_scale)
      : codes(upload_as(host_codes, DType::e4m3)), scales(upload_as(host_scale, DType::f32)) {
    kv.codes = codes.as<uint8_t>();
    kv.scales = host_scale.dim() == 1  // [1]: per tensor; [pages, Hkv, B]: per token and head
                    ? cuda::kv_scale_per_tensor(scales.as<float>())
                    : cuda::kv_scales_per_token_head(scales.as<float>(), host_codes.size(1), host_codes.size(2));
  }
};
}  // namespace

AttentionOutput cuda_attention(const Tensor& q, HostKeys k, HostKeys v, const Batch& batch,
                               const Tensor* page_table, const Tensor* topk,
                               const AttentionDims& dims, const MsaParams& params, double scale,
                               cuda::OutputType o_type, const Tensor* k_scale,
                               const Tensor* v_scale) {
  const DeviceSequences sequences(batch, page_table != nullptr);
  const DeviceBuffer d_page_table = page_table ? upload_as(*page_table, DType::i32) : DeviceBuffer();
  const DeviceBuffer* table = page_table ? &d_page_table : nullptr;
  const int64_t table_stride = page_table ? page_table->size(1) : 0;
  // fp8 K/V travel as stored (codes and scales) for the decode kernels to read directly, and
  // their layout as bf16 keys with no data; float K/V as bf16.
  const bool fp8 = k_scale != nullptr;
  std::optional<DeviceKeys> d_k, d_v;
  std::optional<DeviceFp8Kv> k_fp8, v_fp8;
  cuda::Keys k_keys, v_keys;
  if (fp8) {  // paged (validated): the codes' layout, counted in bytes
    k_fp8.emplace(k.values, *k_scale);
    v_fp8.emplace(v.values, *v_scale);
    k_keys = v_keys = cuda::paged_keys(nullptr, k.heads, params.block_size, k.dim,
                                       table->as<int32_t>(), table_stride);
  } else {
    d_k.emplace(k, params.block_size, table, table_stride);
    d_v.emplace(v, params.block_size, table, table_stride);
    k_keys = d_k->keys;
    v_keys = d_v->keys;
  }
  const DeviceBuffer d_q = upload_as(q, DType::bf16);
  const DeviceBuffer d_topk = topk ? upload_as(*topk, DType::i32) : DeviceBuffer();
  const size_t o_bytes = o_type == cuda::OutputType::bf16 ? 2 : 4;
  DeviceBuffer d_o = poisoned(static_cast<size_t>(q.numel()) * o_bytes);
  DeviceBuffer d_lse = poisoned(static_cast<size_t>(batch.total_q() * dims.q_heads) * 4);

  cuda::AttentionParams p;
  p.q = d_q.as<uint16_t>();
  p.k = k_keys;
  p.v = v_keys;
  p.q_heads = dims.q_heads;
  p.kv_heads = dims.kv_heads;
  p.head_dim = dims.head_dim;
  p.seqs = sequences.seqs;
  p.block_size = params.block_size;
  p.topk = topk ? d_topk.as<int32_t>() : nullptr;
  p.slots = topk ? topk->size(2) : 0;
  p.scale = static_cast<float>(scale);
  p.causal = batch.causal;
  p.o = d_o.get();
  p.o_type = o_type;
  p.lse = d_lse.as<float>();
  p.sparse_engine = params.cuda.sparse;
  p.sparse_q_load = params.cuda.sparse_q_load;
  p.sparse_order = params.cuda.sparse_order;
  p.dense_engine = params.cuda.dense;
  p.max_chunk_queries = params.cuda.max_chunk_queries;
  if (fp8) {
    p.kv_format = cuda::KvFormat::fp8;
    p.k_fp8 = k_fp8->kv;
    p.v_fp8 = v_fp8->kv;
  }
  DeviceBuffer workspace(cuda::attention_workspace_bytes(p));
  cuda::attention(p, workspace.get(), nullptr);
  cuda::synchronize();

  return {download(d_o, q.shape(), o_type == cuda::OutputType::bf16 ? DType::bf16 : DType::f32),
          download(d_lse, {batch.total_q(), dims.q_heads}, DType::f32)};
}

void cuda_append_kv(PagedKvCache& cache, const Tensor& k, const Tensor& v,
                    const std::vector<int64_t>& slots) {
  if (!is_fp8_kv(cache))
    throw Error("impl 'cuda': append_kv_cache on the GPU writes fp8 caches (msa::cuda::append_kv_fp8); "
                "got a " + std::string(dtype_name(cache.k_cache.dtype())) +
                " cache: append to float caches with impl 'cpu'");
  const bool bf16 = k.dtype() == DType::bf16;  // bf16 as it is; f32, f16, f64 as f32 (exact but f64)
  const DType input = bf16 ? DType::bf16 : DType::f32;
  const DeviceBuffer d_k = upload_as(k, input), d_v = upload_as(v, input);
  const DeviceBuffer d_slots = DeviceBuffer::from(slots.empty() ? std::vector<int64_t>{-1} : slots);
  DeviceBuffer k_codes = upload_as(cache.k_cache, DType::e4m3), v_codes = upload_as(cache.v_cache, DType::e4m3);
  DeviceBuffer k_scale = upload_as(cache.k_scale, DType::f32), v_scale = upload_as(cache.v_scale, DType::f32);
  cuda::KvAppendParams p;
  p.k = d_k.get();
  p.v = d_v.get();
  p.input = bf16 ? cuda::InputType::bf16 : cuda::InputType::f32;
  p.tokens = static_cast<int64_t>(slots.size());
  p.kv_heads = cache.k_cache.size(1);
  p.head_dim = cache.k_cache.size(3);
  p.block_size = cache.k_cache.size(2);
  p.slot_mapping = d_slots.as<int64_t>();
  p.k_cache = k_codes.as<uint8_t>();
  p.v_cache = v_codes.as<uint8_t>();
  p.k_scale = k_scale.as<float>();
  p.v_scale = v_scale.as<float>();
  p.k_layout = cache.k_scale.dim() == 1 ? cuda::KvScaleLayout::per_tensor : cuda::KvScaleLayout::per_token_head;
  p.v_layout = cache.v_scale.dim() == 1 ? cuda::KvScaleLayout::per_tensor : cuda::KvScaleLayout::per_token_head;
  cuda::append_kv_fp8(p, nullptr);
  cuda::synchronize();
  k_codes.download(cache.k_cache.raw(), cache.k_cache.nbytes());
  v_codes.download(cache.v_cache.raw(), cache.v_cache.nbytes());
  k_scale.download(cache.k_scale.raw(), cache.k_scale.nbytes());
  v_scale.download(cache.v_scale.raw(), cache.v_scale.nbytes());
}

}  // namespace msa::detail
