// The host forms of msa._ext's ops: host arrays wrapped zero-copy as msa::Tensor views, the
// host-tensor ops of msa/ops.h (Impl::cpu, or Impl::reference in f64), which validate every
// argument (cu_seqlens contents, selection rows, page ids) and return new tensors, copied into
// the caller's outputs in their element type.
#include "ext.h"
#include "msa/ops.h"

namespace msa::python {

namespace {

void expect_host(const Array& a) {
  if (a.present && a.cuda) value_error(a.name, "a CPU tensor (this call runs the host ops)", "a CUDA tensor");
}

// The paged cache of msa/ops.h from the host arrays given (k / v / index keys as present).
PagedKvCache paged_cache(const KeySource& keys, const Array* k, const Array* v, const Array* index_keys) {
  PagedKvCache cache;
  if (k) cache.k_cache = host_tensor(*k);
  if (v) cache.v_cache = host_tensor(*v);
  if (index_keys) cache.index_key_cache = host_tensor(*index_keys);
  cache.page_table = host_tensor(keys.page_table);
  cache.seq_lens = host_tensor(keys.seq_lens);
  return cache;
}

}  // namespace

int64_t indexer_cpu(const IndexerArgs& a, const MsaParams& p, Impl impl) {
  for (const Array* x : {&a.qi, &a.ki, &a.cu_seqlens_q, &a.topk_out, &a.lse_out, &a.keys.cu_seqlens_k,
                         &a.keys.page_table, &a.keys.seq_lens})
    expect_host(*x);
  const Tensor qi = host_tensor(a.qi), cu_q = host_tensor(a.cu_seqlens_q);
  const MsaParams& params = p;
  const IndexerOutput out =
      a.keys.paged() ? paged_indexer(qi, paged_cache(a.keys, nullptr, nullptr, &a.ki), cu_q, params, impl,
                                     /*want_lse=*/a.lse_out.present)
                     : indexer(qi, host_tensor(a.ki), cu_q, host_tensor(a.keys.cu_seqlens_k), params, impl);
  copy_out(out.topk, a.topk_out);
  if (a.lse_out.present) copy_out(out.lse, a.lse_out);
  return 0;
}

int64_t attention_cpu(const AttentionArgs& a, const MsaParams& p, Impl impl) {
  for (const Array* x : {&a.q, &a.k, &a.v, &a.topk, &a.cu_seqlens_q, &a.o, &a.lse, &a.keys.cu_seqlens_k,
                         &a.keys.page_table, &a.keys.seq_lens, &a.k_scale, &a.v_scale})
    expect_host(*x);
  if ((a.k_scale.present || a.v_scale.present) && !a.keys.paged())
    value_error("k_scale", "no scale for packed K/V (fp8 K/V caches are paged)", "a scale tensor");
  const Tensor q = host_tensor(a.q), cu_q = host_tensor(a.cu_seqlens_q);
  const MsaParams& params = p;
  AttentionOutput out;
  if (a.keys.paged()) {
    PagedKvCache cache = paged_cache(a.keys, &a.k, &a.v, nullptr);
    if (a.k_scale.present) cache.k_scale = host_tensor(a.k_scale);  // fp8 K/V: checked by the op
    if (a.v_scale.present) cache.v_scale = host_tensor(a.v_scale);
    out = a.topk.present ? paged_sparse_attention(q, cache, host_tensor(a.topk), cu_q, params, impl)
                         : paged_dense_attention(q, cache, cu_q, params, impl);
  } else {
    const Tensor k = host_tensor(a.k), v = host_tensor(a.v), cu_k = host_tensor(a.keys.cu_seqlens_k);
    out = a.topk.present ? sparse_attention(q, k, v, host_tensor(a.topk), cu_q, cu_k, params, impl)
                         : dense_attention(q, k, v, cu_q, cu_k, params, impl);
  }
  copy_out(out.o, a.o);
  copy_out(out.lse, a.lse);
  return 0;
}

int64_t attention_backward_cpu(const BackwardArgs& a, const MsaParams& p, Impl impl) {
  for (const Array* x : {&a.q, &a.k, &a.v, &a.topk, &a.o, &a.lse, &a.grad_o, &a.cu_seqlens_q, &a.cu_seqlens_k,
                         &a.dq, &a.dk, &a.dv})
    expect_host(*x);
  const Tensor q = host_tensor(a.q), k = host_tensor(a.k), v = host_tensor(a.v), o = host_tensor(a.o),
               lse = host_tensor(a.lse), grad_o = host_tensor(a.grad_o), cu_q = host_tensor(a.cu_seqlens_q),
               cu_k = host_tensor(a.cu_seqlens_k);
  const MsaParams& params = p;
  const AttentionGrads g =
      a.topk.present ? sparse_attention_backward(q, k, v, host_tensor(a.topk), o, lse, grad_o, cu_q, cu_k, params, impl)
                     : dense_attention_backward(q, k, v, o, lse, grad_o, cu_q, cu_k, params, impl);
  copy_out(g.dq, a.dq);
  copy_out(g.dk, a.dk);
  copy_out(g.dv, a.dv);
  return 0;
}

int64_t indexer_kl_cpu(const KlArgs& a, const MsaParams& p, Impl impl) {
  for (const Array* x : {&a.q, &a.k, &a.lse, &a.qi, &a.ki, &a.topk, &a.cu_seqlens_q, &a.cu_seqlens_k, &a.loss,
                         &a.dqi, &a.dki})
    expect_host(*x);
  const IndexerKlOutput out =
      indexer_kl(host_tensor(a.q), host_tensor(a.k), host_tensor(a.lse), host_tensor(a.qi), host_tensor(a.ki),
                 host_tensor(a.topk), host_tensor(a.cu_seqlens_q), host_tensor(a.cu_seqlens_k), p, impl);
  copy_out(out.loss, a.loss);
  copy_out(out.dqi, a.dqi);
  copy_out(out.dki, a.dki);
  return 0;
}

}  // namespace msa::python
