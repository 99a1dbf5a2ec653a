"""GPU tests (skipped without a CUDA device and a CUDA build of msa): the kernels through the
package against msa's CPU ops, bf16 outputs, refused f32, autograd, torch.compile, a decode step
captured in torch.cuda.graph and replayed with new lengths, the vLLM-layout functions."""

from __future__ import annotations

import math

import pytest
import torch

import msa.torch as mt
import msa.vllm as mv
from conftest import gpu, key_sets, make_case, ref_rows

pytestmark = gpu

M3 = dict(hq=16, hkv=2, d=128, di=128, block=128, topk=4)


def m3_case(lengths=((600, 1500), (300, 300), (1, 900)), seed=0):
    return make_case(lengths=lengths, seed=seed, dtype=torch.float32, **M3)


def rows_close(a, b, tolerance=0.01):
    """Selection sets agree up to near-ties (docs/msa.md §3.4: at most 1% of rows differ)."""
    sa, sb = key_sets(a), key_sets(b)
    differ = sum(x != y for ha, hb in zip(sa, sb) for x, y in zip(ha, hb))
    total = sum(len(h) for h in sa)
    assert differ <= max(1, tolerance * total), f"{differ} of {total} rows differ"


def test_f32_on_cuda_is_refused_not_rounded():
    c = m3_case().to("cuda")
    with pytest.raises(TypeError, match="argument 'q': expected dtype bfloat16"):
        mt.dense_attention(c.q, c.k, c.v, c.cu_q, c.cu_k)


def test_indexer_and_attention_match_the_cpu_ops():
    c = m3_case()
    cb = c.to(dtype=torch.bfloat16)
    g = cb.to("cuda")
    rows_gpu, lse_gpu = mt.indexer(g.qi, g.ki, g.cu_q, g.cu_k, topk=4, block_size=128, return_lse=True)
    rows_cpu, lse_cpu = mt.indexer(cb.qi.float(), cb.ki.float(), c.cu_q, c.cu_k, topk=4, block_size=128,
                                   return_lse=True)
    rows_close(rows_gpu, rows_cpu)
    rows = rows_cpu
    o, lse = mt.sparse_attention(g.q, g.k, g.v, rows.cuda(), g.cu_q, g.cu_k, block_size=128,
                                 max_seqlen_q=600, max_seqlen_k=1500)
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    ro, rl = mt.sparse_attention(cb.q.float(), cb.k.float(), cb.v.float(), rows, c.cu_q, c.cu_k, block_size=128)
    assert torch.allclose(o.float().cpu(), ro, atol=2e-2, rtol=2e-2)
    assert torch.allclose(lse.cpu(), rl, atol=1e-3, rtol=1e-3)
    od, _ = mt.dense_attention(g.q, g.k, g.v, g.cu_q, g.cu_k)
    rdo, _ = mt.dense_attention(cb.q.float(), cb.k.float(), cb.v.float(), c.cu_q, c.cu_k)
    assert torch.allclose(od.float().cpu(), rdo, atol=2e-2, rtol=2e-2)
    om, _ = mt.msa_attention(g.q, g.k, g.v, g.qi, g.ki, g.cu_q, g.cu_k, topk=4, block_size=128)
    assert torch.isfinite(om.float()).all()


def test_backward_and_kl_match_the_cpu_ops():
    c = m3_case(lengths=((700, 700), (200, 200)))
    cb = c.to(dtype=torch.bfloat16)
    rows = ref_rows(cb.qi, cb.ki, c, 4, 128)
    res = {}
    for dev in ("cuda", "cpu"):
        x = cb.to(dev) if dev == "cuda" else cb.to(dtype=torch.float32)
        q, k, v = (t.clone().requires_grad_() for t in (x.q, x.k, x.v))
        qi, ki = x.qi.clone().requires_grad_(), x.ki.clone().requires_grad_()
        r = rows.to(dev)
        o, lse = mt.sparse_attention(q, k, v, r, x.cu_q, x.cu_k, block_size=128)
        w = torch.linspace(-1, 1, o.numel(), device=dev).view(o.shape).to(o.dtype)
        (o * w).sum().backward()
        loss = mt.indexer_kl_loss(q, k, lse, qi, ki, r, x.cu_q, x.cu_k, block_size=128)
        loss.backward()
        res[dev] = [t.float().cpu() for t in (q.grad, k.grad, v.grad, qi.grad, ki.grad, loss.detach())]
        if dev == "cuda":
            assert q.grad.dtype == torch.bfloat16
    for a, b in zip(res["cuda"], res["cpu"]):
        scale = max(1.0, b.abs().max().item())
        assert torch.allclose(a, b, atol=3e-2 * scale, rtol=3e-2)


def test_deterministic_backward_is_bitwise_repeatable():
    c = m3_case(lengths=((900, 900),)).to("cuda", torch.bfloat16)
    rows, _ = mt.indexer(c.qi, c.ki, c.cu_q, c.cu_k, topk=4, block_size=128)
    grads = []
    for _ in range(2):
        q = c.q.clone().requires_grad_()
        o, _ = mt.sparse_attention(q, c.k, c.v, rows, c.cu_q, c.cu_k, block_size=128)
        o.float().sum().backward()
        grads.append(q.grad)
    assert torch.equal(grads[0], grads[1])


def test_torch_compile_on_cuda():
    c = m3_case(lengths=((512, 512),)).to("cuda", torch.bfloat16)
    layer = mt.MSAAttention(hidden_size=64, num_kv_heads=2, index_dim=128, topk=4, block_size=128).cuda()
    x = torch.randn(512, 64, device="cuda")

    def f(x, q, k, v):
        out = layer(x, q, k, v, c.cu_q, 512)
        return out.o.float().sum() + out.kl_loss

    eager = f(x, c.q, c.k, c.v)
    compiled = torch.compile(f, fullgraph=True)(x, c.q, c.k, c.v)
    assert torch.allclose(eager, compiled, rtol=1e-2, atol=1e-2)


def paged_setup(max_batch, max_context, hq=16, hkv=2, d=128, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages_per = math.ceil(max_context / 128)
    pages = max_batch * pages_per
    kw = dict(device="cuda", dtype=torch.bfloat16)
    k_cache = torch.randn(pages, hkv, 128, d, generator=g, **kw)
    v_cache = torch.randn(pages, hkv, 128, d, generator=g, **kw)
    ik = torch.randn(pages, 128, d, generator=g, **kw)
    table = torch.randperm(pages, device="cuda", generator=g).to(torch.int32).view(max_batch, pages_per)
    return k_cache, v_cache, ik, table


@pytest.mark.parametrize("max_context", [1024, 20000])  # dense plan, sparse plan
def test_decode_step_in_a_cuda_graph_replays_with_new_lengths(max_context):
    max_batch, hq, hkv, d = 4, 16, 2, 128
    k_cache, v_cache, ik, table = paged_setup(max_batch, max_context)
    step = mt.DecodeStep(max_batch=max_batch, max_context=max_context, q_heads=hq, kv_heads=hkv, head_dim=d,
                         index_dim=d, topk=4, device="cuda")
    q = torch.randn(max_batch, hq, d, device="cuda", dtype=torch.bfloat16)
    qi = torch.randn(max_batch, hkv, d, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(max_batch + 1, dtype=torch.int32, device="cuda")
    lens = torch.full((max_batch,), 10, dtype=torch.int32, device="cuda")
    args = (q, qi, k_cache, v_cache, ik, table, cu, lens)
    step.run(*args)  # warm-up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, lse = step.run(*args)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        new = torch.randint(1, max_context + 1, (max_batch,), generator=gen, dtype=torch.int32)
        lens.copy_(new)
        q.copy_(torch.randn_like(q))
        qi.copy_(torch.randn_like(qi))
        graph.replay()
        torch.cuda.synchronize()
        step.check(*args)
        expect, _ = mt.paged_msa_attention(q, qi, k_cache, v_cache, ik, table, lens, cu, topk=4,
                                           max_seqlen_q=1, max_seqlen_k=max_context)
        assert torch.allclose(o.float(), expect.float(), atol=2e-2, rtol=2e-2)
    # A page id outside the caches: read as page 0 by the replay, named by check().
    good = table[1, 0].item()
    table[1, 0] = k_cache.shape[0]
    graph.replay()
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=r"page_table\[1, 0\]"):
        step.check(*args)
    table[1, 0] = good
    graph.replay()
    step.check(*args)


def test_max_seqlen_is_required_inside_graph_capture():
    c = m3_case(lengths=((128, 128),)).to("cuda", torch.bfloat16)
    mt.dense_attention(c.q, c.k, c.v, c.cu_q, c.cu_k, max_seqlen_q=128, max_seqlen_k=128)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match="max_seqlen_q"):
        with torch.cuda.graph(graph):
            mt.dense_attention(c.q, c.k, c.v, c.cu_q, c.cu_k)


def test_vllm_functions_on_gpu_match_cpu():
    from test_vllm import build
    case, kv, icache, table, seq, prefix = build([1500, 700, 3000], [300, 700, 1], hq=16, hkv=2, d=128, di=128)
    dev = lambda t: t.cuda()  # noqa: E731
    rows_cpu = mv.minimax_m3_index_prefill(case.qi, icache, table, case.cu_q, seq, prefix, 700, 3000, 2, 16, 0, 1)
    rows_gpu = mv.minimax_m3_index_prefill(dev(case.qi), dev(icache), dev(table), dev(case.cu_q), dev(seq),
                                           dev(prefix), 700, 3000, 2, 16, 0, 1)
    rows_close(rows_gpu, rows_cpu)
    out_cpu, out_gpu = torch.zeros_like(case.q), torch.zeros_like(case.q).cuda()
    mv.minimax_m3_sparse_attn(case.q, kv, rows_cpu, table, case.cu_q, seq, prefix, 700, 2, 0.088, out_cpu)
    mv.minimax_m3_sparse_attn(dev(case.q), dev(kv), dev(rows_cpu), dev(table), dev(case.cu_q), dev(seq), dev(prefix),
                              700, 2, 0.088, out_gpu, max_seq_len=3000)
    assert torch.allclose(out_gpu.float().cpu(), out_cpu.float(), atol=2e-2, rtol=2e-2)


def test_vllm_decode_over_an_fp8_cache_on_gpu_matches_cpu():
    """kv_cache_dtype fp8 (float8_e4m3fn halves, per-tensor scales): msa's decode kernels read
    the codes in vLLM's interleaved layout (K at [..., :D], V at [..., D:]); the CPU host ops on
    the same cache are the reference. Prefill chunks (> 16 queries) over it run on a bf16 copy of
    the cache and match the CPU too."""
    from test_vllm import build, fp8_cache
    case, kv, icache, table, seq, prefix = build([1500, 700, 3000, 5], [1, 4, 1, 2], hq=16, hkv=2, d=128, di=128)
    kv8, k_scale, v_scale, _ = fp8_cache(kv, 128)
    dev = lambda t: t.cuda()  # noqa: E731
    rows = mv.minimax_m3_index_prefill(case.qi, icache, table, case.cu_q, seq, prefix, 4, 3000, 2, 16, 0, 1)
    out_cpu, out_gpu = torch.zeros_like(case.q), torch.zeros_like(case.q).cuda()
    mv.minimax_m3_sparse_attn(case.q, kv8, rows, table, case.cu_q, seq, prefix, 4, 2, 0.088, out_cpu, k_scale,
                              v_scale)
    mv.minimax_m3_sparse_attn(dev(case.q), dev(kv8), dev(rows), dev(table), dev(case.cu_q), dev(seq), dev(prefix),
                              4, 2, 0.088, out_gpu, dev(k_scale), dev(v_scale), max_seq_len=3000)
    assert torch.allclose(out_gpu.float().cpu(), out_cpu.float(), atol=2e-2, rtol=2e-2)
    long_case, long_kv, long_icache, long_table, long_seq, long_prefix = build([700], [40], hq=16, hkv=2, d=128,
                                                                               di=128)
    long_kv8, ks, vs, _ = fp8_cache(long_kv, 128)
    long_rows = mv.minimax_m3_index_prefill(long_case.qi, long_icache, long_table, long_case.cu_q, long_seq,
                                            long_prefix, 40, 700, 2, 16, 0, 1)
    long_cpu, long_gpu = torch.zeros_like(long_case.q), torch.zeros_like(long_case.q).cuda()
    mv.minimax_m3_sparse_attn(long_case.q, long_kv8, long_rows, long_table, long_case.cu_q, long_seq, long_prefix, 40,
                              2, 0.088, long_cpu, ks, vs)
    mv.minimax_m3_sparse_attn(dev(long_case.q), dev(long_kv8), dev(long_rows), dev(long_table), dev(long_case.cu_q),
                              dev(long_seq), dev(long_prefix), 40, 2, 0.088, long_gpu, dev(ks), dev(vs),
                              max_seq_len=700)
    assert torch.allclose(long_gpu.float().cpu(), long_cpu.float(), atol=2e-2, rtol=2e-2)
