"""msa.vllm on vLLM's layouts, built by hand (vLLM itself is not needed): a KV cache
[num_blocks, num_kv_heads, 128, 2 * head_dim] with K and V halves, an index cache
[num_blocks, 128, Di], shuffled block tables, ragged prefill chunks over cached prefixes and
decode batches, rows [num_kv_heads, total_q, topk] (also a transposed view of vLLM's buffer),
outputs written in place; checked against msa's paged reference and plain PyTorch."""

from __future__ import annotations

import math

import pytest
import torch

import msa.torch as mt
import msa.vllm as mv
from conftest import Case, key_sets, ref_attention, ref_rows

B = 128


def build(seq_lens, q_lens, hq=4, hkv=2, d=16, di=16, dtype=torch.bfloat16, seed=0):
    """Contiguous per-sequence K/V/index keys, scattered into vLLM's paged caches."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    batch = len(seq_lens)
    pages_per = [math.ceil(s / B) for s in seq_lens]
    num_blocks = sum(pages_per) + 3
    perm = torch.randperm(num_blocks, generator=g)
    width = max(pages_per) + 1
    block_table = torch.zeros((batch, width), dtype=torch.int32)
    kv_cache = r(num_blocks, hkv, B, 2 * d)
    index_cache = r(num_blocks, B, di)
    k_flat, v_flat, ki_flat = [], [], []
    used = 0
    for b, s in enumerate(seq_lens):
        pages = perm[used:used + pages_per[b]]
        used += pages_per[b]
        block_table[b, :len(pages)] = pages.to(torch.int32)
        idx = torch.arange(s)
        page_of = pages[idx // B]
        k_flat.append(kv_cache[page_of, :, idx % B, :d])
        v_flat.append(kv_cache[page_of, :, idx % B, d:])
        ki_flat.append(index_cache[page_of, idx % B])
    total_q = sum(q_lens)
    q = r(total_q, hq, d)
    qi = r(total_q, hkv, di)
    cu_q = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.tensor(seq_lens).cumsum(0).tolist(), dtype=torch.int32)
    case = Case(q, torch.cat(k_flat), torch.cat(v_flat), qi, torch.cat(ki_flat), cu_q, cu_k, B, 16,
                list(zip(q_lens, seq_lens)))
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    prefix = seq - torch.tensor(q_lens, dtype=torch.int32)
    return case, kv_cache, index_cache, block_table, seq, prefix


@pytest.mark.parametrize("topk", [4, 16])
def test_prefill_chunks_over_cached_prefixes(topk):
    seq_lens, q_lens = [700, 300, 1030], [200, 300, 7]
    case, kv, icache, table, seq, prefix = build(seq_lens, q_lens)
    score = mv.minimax_m3_index_score(case.qi, icache, table, case.cu_q, seq, prefix, max(q_lens), max(seq_lens), 2)
    rows = mv.minimax_m3_index_topk(score, case.cu_q, prefix, max(q_lens), topk, 0, 1)
    assert rows.shape == (2, sum(q_lens), topk) and rows.dtype == torch.int32
    expected = ref_rows(case.qi, case.ki, case, topk, B)
    assert key_sets(rows) == key_sets(expected)
    out = torch.full_like(case.q, float("nan"))
    scale = 1 / math.sqrt(case.q.shape[2])
    assert mv.minimax_m3_sparse_attn(case.q, kv, rows, table, case.cu_q, seq, prefix, max(q_lens), 2, scale,
                                     out) is None
    ro, _ = ref_attention(case.q, case.k, case.v, rows, case, B)
    assert torch.allclose(out.double(), ro, atol=3e-2)
    # the native-layout paged ops agree bitwise (same host op, copied layouts)
    k_cache, v_cache = kv[..., :16].contiguous(), kv[..., 16:].contiguous()
    o2, _ = mt.paged_sparse_attention(case.q, k_cache, v_cache, table, seq, rows, case.cu_q)
    assert torch.equal(o2, out)


def test_topk_into_vllms_transposed_buffer():
    seq_lens, q_lens = [500, 260], [3, 260]
    case, kv, icache, table, seq, prefix = build(seq_lens, q_lens)
    buffer = torch.full((400, 2, 8), 7, dtype=torch.int32)  # vLLM's [tokens, heads, topk]
    view = buffer.transpose(0, 1)                              # [heads, tokens, topk]
    rows = mv.minimax_m3_index_prefill(case.qi, icache, table, case.cu_q, seq, prefix, 260, 500, 2, 8, 0, 1,
                                       out=view)
    assert rows.data_ptr() == view.data_ptr()
    assert key_sets(view[:, :263]) == key_sets(ref_rows(case.qi, case.ki, case, 8, B))
    assert int(buffer[263:].ne(7).sum()) == 0  # rows past total_q untouched


@pytest.mark.parametrize("query_len", [1, 3])
def test_decode_uniform_and_ragged(query_len):
    seq_lens = [129, 2000, 640, 5]
    seq_lens = [max(s, query_len) for s in seq_lens]
    case, kv, icache, table, seq, _ = build(seq_lens, [query_len] * len(seq_lens))
    rows = mv.minimax_m3_index_decode(case.qi, icache, table, seq, max(seq_lens), 16, 0, 1, 2, query_len, 4)
    assert key_sets(rows) == key_sets(ref_rows(case.qi, case.ki, case, 16, B))
    out = torch.zeros_like(case.q)
    mv.minimax_m3_sparse_attn_decode(case.q, kv, rows, table, seq, 2, 0.25, out, query_len)
    ro, _ = ref_attention(case.q, case.k, case.v, rows, case, B, scale=0.25)
    assert torch.allclose(out.double(), ro, atol=3e-2)
    out2 = torch.zeros_like(case.q)
    qsl = case.cu_q.clone()
    mv.minimax_m3_sparse_attn_decode(case.q, kv, rows, table, seq, 2, 0.25, out2, query_len, query_start_loc=qsl,
                                     token_to_req_indices=torch.zeros(case.q.shape[0], dtype=torch.int32))
    assert torch.equal(out, out2)


def fp8_cache(kv: torch.Tensor, d: int):
    """vLLM's kv_cache_dtype fp8: K and V halves in float8_e4m3fn, each with a per-tensor scale
    (amax / 448, so no value saturates); the dequantized cache beside it."""
    k_scale = kv[..., :d].float().abs().amax() / 448
    v_scale = kv[..., d:].float().abs().amax() / 448
    kv8 = torch.cat([(kv[..., :d].float() / k_scale).to(torch.float8_e4m3fn),
                     (kv[..., d:].float() / v_scale).to(torch.float8_e4m3fn)], dim=-1)
    dequantized = torch.cat([kv8[..., :d].double() * k_scale.double(), kv8[..., d:].double() * v_scale.double()],
                            dim=-1)
    return kv8, k_scale.reshape(1), v_scale.reshape(1), dequantized


def flat_kv(kv: torch.Tensor, table: torch.Tensor, seq_lens, d: int):
    """Per-sequence K, V [total_k, Hkv, d] gathered from a paged cache (as build() lays them out)."""
    k, v = [], []
    for b, s in enumerate(seq_lens):
        idx = torch.arange(s)
        page_of = table[b, (idx // B)].long()
        k.append(kv[page_of, :, idx % B, :d])
        v.append(kv[page_of, :, idx % B, d:])
    return torch.cat(k), torch.cat(v)


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="this torch has no float8_e4m3fn")
@pytest.mark.parametrize("query_len", [1, 3])
def test_decode_over_an_fp8_cache_with_per_tensor_scales(query_len):
    seq_lens = [129, 2000, 640, 5]
    case, kv, icache, table, seq, _ = build(seq_lens, [query_len] * len(seq_lens))
    kv8, k_scale, v_scale, dequantized = fp8_cache(kv, 16)
    rows = mv.minimax_m3_index_decode(case.qi, icache, table, seq, max(seq_lens), 16, 0, 1, 2, query_len, 4)
    out = torch.zeros_like(case.q)
    mv.minimax_m3_sparse_attn_decode(case.q, kv8, rows, table, seq, 2, 0.25, out, query_len, k_scale, v_scale)
    k, v = flat_kv(dequantized, table, seq_lens, 16)
    ro, _ = ref_attention(case.q, k, v, rows, case, B, scale=0.25)  # over the dequantized values
    assert torch.allclose(out.double(), ro, atol=3e-2)
    # against the bf16 cache: fp8 moves O by a few percent (docs/msa.md §6.6)
    ro16, _ = ref_attention(case.q, case.k, case.v, rows, case, B, scale=0.25)
    assert float((out.double() - ro16).norm() / ro16.norm()) < 0.1
    # scales as 0-dim tensors or floats (vLLM's _k_scale / _k_scale_float): the same output
    out2 = torch.zeros_like(case.q)
    mv.minimax_m3_sparse_attn_decode(case.q, kv8, rows, table, seq, 2, 0.25, out2, query_len, k_scale.reshape(()),
                                     float(v_scale))
    assert torch.equal(out, out2)


def test_padded_decode_rows_compute_without_error():
    seq_lens = [300, 0]  # vLLM pads CUDA-graph batches with zero-length requests
    case, kv, icache, table, seq, _ = build([300, 1], [1, 1])
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    rows = mv.minimax_m3_index_decode(case.qi, icache, table, seq, 300, 16, 0, 1, 2, 1)
    out = torch.zeros_like(case.q)
    mv.minimax_m3_sparse_attn_decode(case.q, kv, rows, table, seq, 2, 0.25, out, 1)
    assert torch.isfinite(out.float()).all()


def test_unsupported_caches_and_dtypes_are_clear_errors():
    case, kv, icache, table, seq, prefix = build([300], [300])
    rows = mv.minimax_m3_index_prefill(case.qi, icache, table, case.cu_q, seq, prefix, 300, 300, 2, 16, 0, 1)
    out = torch.empty_like(case.q)
    if hasattr(torch, "float8_e5m2"):
        with pytest.raises(ValueError, match="argument 'kv_cache': expected a bfloat16 or float8_e4m3fn KV cache"):
            mv.minimax_m3_sparse_attn(case.q, kv.to(torch.float8_e5m2), rows, table, case.cu_q, seq, prefix, 300, 2,
                                      0.25, out, k_scale=torch.ones(1), v_scale=torch.ones(1))
    if hasattr(torch, "float8_e4m3fn"):
        with pytest.raises(ValueError, match="argument 'k_scale': expected vLLM's per-tensor k_scale and v_scale"):
            mv.minimax_m3_sparse_attn(case.q, kv.to(torch.float8_e4m3fn), rows, table, case.cu_q, seq, prefix, 300, 2,
                                      0.25, out)
        with pytest.raises(ValueError, match="argument 'v_scale': expected one per-tensor scale"):
            mv.minimax_m3_sparse_attn(case.q, kv.to(torch.float8_e4m3fn), rows, table, case.cu_q, seq, prefix, 300, 2,
                                      0.25, out, k_scale=torch.ones(1), v_scale=torch.ones(2))
    with pytest.raises(ValueError, match="k_scale"):
        mv.minimax_m3_sparse_attn(case.q, kv, rows, table, case.cu_q, seq, prefix, 300, 2, 0.25, out,
                                  k_scale=torch.ones(1), v_scale=torch.ones(1))
    with pytest.raises(ValueError, match="argument 'output'"):
        mv.minimax_m3_sparse_attn(case.q, kv, rows, table, case.cu_q, seq, prefix, 300, 2, 0.25, out[:10])
    with pytest.raises(TypeError, match="argument 'score'"):
        mv.minimax_m3_index_topk(torch.zeros(2, 300, 3), case.cu_q, prefix, 300, 16, 0, 1)
