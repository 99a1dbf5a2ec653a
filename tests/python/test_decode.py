"""The paged ops and DecodeStep on the CPU (its host path): chunked prefill equals whole prefill,
decode steps with new lengths in the same buffers match the paged reference."""

from __future__ import annotations

import torch

import msa.torch as mt
from conftest import key_sets


def paged(seq_lens, hkv=2, d=16, block=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    pages_per = max(-(-s // block) for s in seq_lens) + 1
    pages = len(seq_lens) * pages_per
    k = torch.randn(pages, hkv, block, d, generator=g)
    v = torch.randn(pages, hkv, block, d, generator=g)
    ik = torch.randn(pages, block, d, generator=g)
    table = torch.randperm(pages, generator=g).to(torch.int32).view(len(seq_lens), pages_per)
    return k, v, ik, table


def test_chunked_prefill_equals_whole_prefill():
    k, v, ik, table = paged([300])
    g = torch.Generator().manual_seed(1)
    q = torch.randn(300, 4, 16, generator=g)
    qi = torch.randn(300, 2, 16, generator=g)
    whole = torch.tensor([0, 300], dtype=torch.int32)
    rows, _ = mt.paged_indexer(qi, ik, table, torch.tensor([300], dtype=torch.int32), whole, topk=4)
    o, _ = mt.paged_msa_attention(q, qi, k, v, ik, table, torch.tensor([300], dtype=torch.int32), whole, topk=4)
    parts = []
    for start, end in ((0, 100), (100, 250), (250, 300)):
        cu = torch.tensor([0, end - start], dtype=torch.int32)
        lens = torch.tensor([end], dtype=torch.int32)
        part, _ = mt.paged_msa_attention(q[start:end], qi[start:end], k, v, ik, table, lens, cu, topk=4)
        parts.append(part)
    assert torch.allclose(torch.cat(parts), o, atol=1e-6)
    o2, _ = mt.paged_sparse_attention(q, k, v, table, torch.tensor([300], dtype=torch.int32), rows, whole)
    assert torch.allclose(o2, o, atol=1e-6)


def test_decode_step_host_path_follows_new_lengths():
    max_batch, max_context = 3, 400
    k, v, ik, table = paged([max_context] * max_batch)
    step = mt.DecodeStep(max_batch=max_batch, max_context=max_context, q_heads=4, kv_heads=2, head_dim=16,
                         index_dim=16, topk=4, block_size=16, device="cpu", out_dtype=torch.float32)
    assert not step.dense
    q = torch.randn(max_batch, 4, 16)
    qi = torch.randn(max_batch, 2, 16)
    cu = torch.arange(max_batch + 1, dtype=torch.int32)
    lens = torch.tensor([5, 17, 400], dtype=torch.int32)
    for new in ([5, 17, 400], [64, 1, 333]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        o, lse = step.run(q, qi, k, v, ik, table, cu, lens)
        expect, expect_lse = mt.paged_msa_attention(q, qi, k, v, ik, table, lens, cu, topk=4)
        assert torch.equal(o, expect) and torch.equal(lse, expect_lse)


def test_paged_dense_equals_paged_sparse_with_every_block():
    k, v, ik, table = paged([60, 33])
    q = torch.randn(5, 4, 16)
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    lens = torch.tensor([60, 33], dtype=torch.int32)
    rows, _ = mt.paged_indexer(torch.randn(5, 2, 16), ik, table, lens, cu, topk=8)
    assert all(len(s) == (p // 16) + 1 for head in key_sets(rows) for s, p in zip(head, [57, 58, 59, 31, 32]))
    od, _ = mt.paged_dense_attention(q, k, v, table, lens, cu)
    os_, _ = mt.paged_sparse_attention(q, k, v, table, lens, rows, cu)
    assert torch.allclose(od, os_, atol=1e-6)
