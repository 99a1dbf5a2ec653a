// Attention of one decoder layer: projections, per-head Gemma q/k norm, partial RoPE,
// cache insert, then dense causal GQA or MSA (indexer -> per-group top-k -> sparse
// attention) through the library's paged ops.
#include <algorithm>
#include <vector>

#include "layers.h"
#include "tensor_math.h"

namespace msa::model {
namespace {

// Copies [T, heads, dim] rows into a cache laid out [pages, heads, B, dim] (f32, or bf16
// rounded to nearest even).
void write_pages(const float* src, int64_t tokens, int64_t heads, int64_t dim, int64_t block,
                 const std::vector<int64_t>& slots, const Tensor& cache) {
  const bool bf16 = cache.dtype() == DType::bf16;
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t page = slots[t] / block, offset = slots[t] % block;
    for (int64_t h = 0; h < heads; ++h) {
      const float* row = src + (t * heads + h) * dim;
      const int64_t at = ((page * heads + h) * block + offset) * dim;
      if (bf16)
        std::transform(row, row + dim, static_cast<uint16_t*>(cache.raw()) + at,
                       [](float x) { return float_to_bf16(x); });
      else
        std::copy_n(row, dim, cache.data<float>() + at);
    }
  }
}

Tensor view(std::vector<float>& data, const Shape& shape) {
  return Tensor::wrap(data.data(), shape, DType::f32, nullptr);
}

}  // namespace

void attention_forward(const float* xn, const LayerWeights& w, const ModelConfig& c, int64_t layer,
                       std::span<const float> inv_freq, const StepBatch& batch, KvCache& cache,
                       Impl impl, const ForwardTap& tap, float* out) {
  const int64_t T = batch.tokens, Hq = c.num_heads, Hkv = c.num_kv_heads, D = c.head_dim;
  std::vector<float> q(T * Hq * D), k(T * Hkv * D), v(T * Hkv * D);
  linear(xn, T, w.q_proj, q.data());
  linear(xn, T, w.k_proj, k.data());
  linear(xn, T, w.v_proj, v.data());
  gemma_rms_norm(q.data(), T * Hq, D, w.q_norm, c.rms_norm_eps);
  gemma_rms_norm(k.data(), T * Hkv, D, w.k_norm, c.rms_norm_eps);
  apply_rope(q.data(), T, Hq, D, batch.positions, inv_freq);
  apply_rope(k.data(), T, Hkv, D, batch.positions, inv_freq);
  const std::string name = tap ? "layers." + std::to_string(layer) : std::string();
  if (tap) {  // what the attention below reads (the attention maps recompute it from these)
    tap(name + ".q", view(q, {T, Hq, D}));
    tap(name + ".k", view(k, {T, Hkv, D}));
    tap(name + ".v", view(v, {T, Hkv, D}));
  }
  PagedKvCache paged{.k_cache = cache.k(layer),
                     .v_cache = cache.v(layer),
                     .index_key_cache = cache.index_keys(layer),
                     .page_table = batch.page_table,
                     .seq_lens = batch.seq_lens,
                     .k_scale = cache.k_scale(layer),
                     .v_scale = cache.v_scale(layer)};
  if (cache.dtype() == DType::e4m3) {  // quantized per token and head (msa/quantized_kv_cache.h)
    append_kv_cache(paged, view(k, {T, Hkv, D}), view(v, {T, Hkv, D}), Tensor::from_vector(batch.slot, {T}),
                    Impl::cpu);
  } else {
    write_pages(k.data(), T, Hkv, D, c.block_size, batch.slot, cache.k(layer));
    write_pages(v.data(), T, Hkv, D, c.block_size, batch.slot, cache.v(layer));
  }
  const MsaParams params = c.msa_params();
  const Tensor queries = view(q, {T, Hq, D});
  AttentionOutput attention;
  if (c.sparse_layers[layer]) {
    // The indexer reads the same normed input; one shared index-key head.
    const int64_t Hi = c.index_heads, Di = c.index_head_dim;
    std::vector<float> iq(T * Hi * Di), ik(T * Di);
    linear(xn, T, w.index_q_proj, iq.data());
    linear(xn, T, w.index_k_proj, ik.data());
    gemma_rms_norm(iq.data(), T * Hi, Di, w.index_q_norm, c.rms_norm_eps);
    gemma_rms_norm(ik.data(), T, Di, w.index_k_norm, c.rms_norm_eps);
    apply_rope(iq.data(), T, Hi, Di, batch.positions, inv_freq);
    apply_rope(ik.data(), T, 1, Di, batch.positions, inv_freq);
    write_pages(ik.data(), T, 1, Di, c.block_size, batch.slot, cache.index_keys(layer));
    const IndexerOutput selection =
        paged_indexer(view(iq, {T, Hi, Di}), paged, batch.cu_seqlens_q, params, impl);
    if (tap) tap(name + ".topk", selection.topk);
    attention = paged_sparse_attention(queries, paged, selection.topk, batch.cu_seqlens_q, params,
                                       impl);
  } else {
    attention = paged_dense_attention(queries, paged, batch.cu_seqlens_q, params, impl);
  }
  const Tensor o = attention.o.dtype() == DType::f32 && attention.o.is_contiguous()
                       ? attention.o
                       : attention.o.to(DType::f32);
  if (tap) tap(name + ".attn_heads", o);
  linear(o.data<float>(), T, w.o_proj, out);
}

}  // namespace msa::model
