"""msa.torch's ops on the CPU against msa's C++ reference (f64, through the package) and a plain
PyTorch statement of docs/msa.md; gradients by gradcheck and against the reference backward;
fake kernels; torch.compile."""

from __future__ import annotations

import pytest
import torch

import msa.torch as mt
from conftest import key_sets, make_case, ref_attention, ref_kl, ref_rows


@pytest.fixture(scope="module")
def case():
    return make_case()


def test_indexer_reference_matches_the_rule(case):
    rows, lse = mt.indexer(case.qi, case.ki, case.cu_q, case.cu_k, topk=case.topk, block_size=case.block,
                           return_lse=True)
    assert rows.dtype == torch.int32 and rows.shape == (2, case.q.shape[0], case.topk)
    assert lse.dtype == torch.float64 and lse.shape == (2, case.q.shape[0])
    assert key_sets(rows) == key_sets(ref_rows(case.qi, case.ki, case, case.topk, case.block))
    # the own block is the last valid entry, -1 only as a suffix
    for head in rows:
        for r in head:
            valid = [int(x) for x in r if x >= 0]
            assert list(r[:len(valid)]) == valid and all(int(x) == -1 for x in r[len(valid):])
    rows_off, none = mt.indexer(case.qi, case.ki, case.cu_q, case.cu_k, topk=case.topk, block_size=case.block)
    assert none is None and torch.equal(rows_off, rows)


@pytest.mark.parametrize("init,local", [(0, 1), (1, 2)])
def test_indexer_cpu_matches_reference(case, init, local):
    args = (case.cu_q, case.cu_k)
    kw = dict(topk=case.topk, block_size=case.block, init_blocks=init, local_blocks=local)
    ref, _ = mt.indexer(case.qi, case.ki, *args, **kw)
    cpu, _ = mt.indexer(case.qi.float(), case.ki.float(), *args, **kw)
    assert key_sets(cpu) == key_sets(ref)
    assert key_sets(ref) == key_sets(ref_rows(case.qi, case.ki, case, case.topk, case.block, local, init))


def test_selected_lse_matches_plain_pytorch(case):
    rows, lse = mt.indexer(case.qi, case.ki, case.cu_q, case.cu_k, topk=case.topk, block_size=case.block,
                           return_lse=True, temperature=0.5)
    iscale = 1.0 / case.qi.shape[2] ** 0.5
    from conftest import positions
    for b, pos, k0, row in positions(case)[::7]:
        t = torch.arange(pos + 1)
        for h in range(2):
            sel = torch.tensor([int(x) for x in rows[h, row] if x >= 0])
            tt = t[torch.isin(t // case.block, sel)]
            expected = torch.logsumexp(iscale * (case.ki[k0 + tt] @ case.qi[row, h]) / 0.5, 0)
            assert torch.allclose(lse[h, row], expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_sparse_and_dense_attention_match_plain_pytorch(case, dtype, tol):
    rows = ref_rows(case.qi, case.ki, case, case.topk, case.block)
    c = case.to(dtype=dtype)
    o, lse = mt.sparse_attention(c.q, c.k, c.v, rows, c.cu_q, c.cu_k, block_size=case.block)
    assert o.dtype == dtype and o.shape == case.q.shape
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    ro, rl = ref_attention(c.q, c.k, c.v, rows, case, case.block)
    assert torch.allclose(o.double(), ro, atol=tol, rtol=tol)
    assert torch.allclose(lse.double(), rl, atol=tol, rtol=tol)
    od, ld = mt.dense_attention(c.q, c.k, c.v, c.cu_q, c.cu_k)
    rdo, rdl = ref_attention(c.q, c.k, c.v, None, case, case.block)
    assert torch.allclose(od.double(), rdo, atol=tol, rtol=tol)
    assert torch.allclose(ld.double(), rdl, atol=tol, rtol=tol)


def test_explicit_scale_and_reference_impl(case):
    rows = ref_rows(case.qi, case.ki, case, case.topk, case.block)
    c = case.to(dtype=torch.float32)
    o, _ = mt.sparse_attention(c.q, c.k, c.v, rows, c.cu_q, c.cu_k, case.block, 0.3, impl="reference")
    ro, _ = ref_attention(c.q, c.k, c.v, rows, case, case.block, scale=0.3)
    assert o.dtype == torch.float32 and torch.allclose(o.double(), ro, atol=1e-6)


def test_msa_attention_is_dense_below_topk_blocks_and_sparse_above():
    small = make_case(lengths=((20, 40), (5, 60)), topk=4, block=16)  # every context <= 64 keys
    o, lse = mt.msa_attention(small.q, small.k, small.v, small.qi, small.ki, small.cu_q, small.cu_k, topk=4,
                              block_size=16)
    ro, _ = ref_attention(small.q, small.k, small.v, None, small, 16)
    assert torch.allclose(o, ro, atol=1e-10)
    c = make_case()
    o, _ = mt.msa_attention(c.q, c.k, c.v, c.qi, c.ki, c.cu_q, c.cu_k, topk=4, block_size=16)
    rows = ref_rows(c.qi, c.ki, c, 4, 16)
    ro, _ = ref_attention(c.q, c.k, c.v, rows, c, 16)
    assert torch.allclose(o, ro, atol=1e-10)


def tiny():
    return make_case(lengths=((9, 20), (6, 6)), hq=2, hkv=1, d=4, di=3, block=4, topk=2, seed=3)


def test_sparse_attention_gradcheck_f64():
    c = tiny()
    rows = ref_rows(c.qi, c.ki, c, c.topk, c.block)
    q, k, v = (t.clone().requires_grad_() for t in (c.q, c.k, c.v))
    assert torch.autograd.gradcheck(
        lambda q, k, v: mt.sparse_attention(q, k, v, rows, c.cu_q, c.cu_k, block_size=c.block)[0], (q, k, v))
    assert torch.autograd.gradcheck(lambda q, k, v: mt.dense_attention(q, k, v, c.cu_q, c.cu_k)[0], (q, k, v))


def test_indexer_kl_gradcheck_f64_and_plain_pytorch():
    c = tiny()
    rows = ref_rows(c.qi, c.ki, c, c.topk, c.block)
    _, lse = mt.sparse_attention(c.q, c.k, c.v, rows, c.cu_q, c.cu_k, block_size=c.block)
    qi, ki = c.qi.clone().requires_grad_(), c.ki.clone().requires_grad_()
    kl = lambda qi, ki: mt.indexer_kl_loss(c.q, c.k, lse, qi, ki, rows, c.cu_q, c.cu_k, block_size=c.block,  # noqa: E731
                                           temperature=0.7, kl_coefficient=2.0)
    assert torch.autograd.gradcheck(kl, (qi, ki))
    loss = kl(qi, ki)
    loss.backward()
    qi2, ki2 = c.qi.clone().requires_grad_(), c.ki.clone().requires_grad_()
    ref = ref_kl(c.q, c.k, lse, qi2, ki2, rows, c, c.block, temperature=0.7, coefficient=2.0)
    ref.backward()
    assert torch.allclose(loss, ref, atol=1e-12)
    assert torch.allclose(qi.grad, qi2.grad, atol=1e-12) and torch.allclose(ki.grad, ki2.grad, atol=1e-12)


def test_kl_teacher_is_detached():
    c = tiny()
    rows = ref_rows(c.qi, c.ki, c, c.topk, c.block)
    q, k = c.q.clone().requires_grad_(), c.k.clone().requires_grad_()
    _, lse = mt.sparse_attention(q, k, c.v, rows, c.cu_q, c.cu_k, block_size=c.block)
    qi = c.qi.clone().requires_grad_()
    mt.indexer_kl_loss(q, k, lse, qi, c.ki, rows, c.cu_q, c.cu_k, block_size=c.block).backward()
    assert q.grad is None and k.grad is None and qi.grad is not None


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_cpu_backward_matches_reference_backward(dtype, tol):
    c = make_case(seed=5)
    rows = ref_rows(c.qi, c.ki, c, c.topk, c.block)
    grads = {}
    for name, dt in (("ref", torch.float64), ("cpu", dtype)):
        q, k, v = (t.to(dt).clone().requires_grad_() for t in (c.q, c.k, c.v))
        o, _ = mt.sparse_attention(q, k, v, rows, c.cu_q, c.cu_k, block_size=c.block)
        w = torch.linspace(-1, 1, o.numel(), dtype=torch.float64).view(o.shape).to(dt)
        (o * w).sum().backward()
        grads[name] = [t.grad.double() for t in (q, k, v)]
        assert all(t.grad.dtype == dt for t in (q, k, v))
    for a, b in zip(grads["cpu"], grads["ref"]):
        assert torch.allclose(a, b, atol=tol * max(1.0, b.abs().max().item()), rtol=tol)


def test_fake_kernels_give_the_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    c = make_case(dtype=torch.bfloat16)
    rows = torch.zeros((2, c.q.shape[0], 4), dtype=torch.int32)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fq, fk, fv, fqi, fki = (torch.empty_like(t) for t in (c.q, c.k, c.v, c.qi, c.ki))
        r, lse = mt.indexer(fqi, fki, c.cu_q, c.cu_k, topk=4, block_size=16, return_lse=True)
        assert r.shape == (2, c.q.shape[0], 4) and r.dtype == torch.int32 and lse.shape == (2, c.q.shape[0])
        o, lse = mt.sparse_attention(fq, fk, fv, rows, c.cu_q, c.cu_k, block_size=16)
        assert o.shape == c.q.shape and o.dtype == torch.bfloat16 and lse.shape == c.q.shape[:2]
        assert lse.dtype == torch.float32
        loss = mt.indexer_kl_loss(fq, fk, lse, fqi, fki, rows, c.cu_q, c.cu_k, block_size=16)
        assert loss.shape == () and loss.dtype == torch.float32


def test_opcheck_of_the_custom_ops():
    from msa.torch import _ops
    c = make_case(dtype=torch.float32)
    rows = ref_rows(c.qi, c.ki, c, 4, 16)
    torch.library.opcheck(_ops.indexer_op, (c.qi, c.ki, c.cu_q, c.cu_k, 4, 16, 1, 0, True, 0.0, 1.0, False, -1, -1, -1),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(_ops.attention_op, (c.q, c.k, c.v, rows, c.cu_q, c.cu_k, 16, 0.0, -1, -1, -1, True),
                          test_utils=("test_schema", "test_faketensor"))


def test_torch_compile_of_a_module():
    c = make_case(dtype=torch.float32)
    layer = mt.MSAAttention(hidden_size=12, num_kv_heads=2, index_dim=8, topk=4, block_size=16)
    x = torch.randn(c.k.shape[0], 12)

    def f(x, q, k, v):
        out = layer(x, q, k, v, c.cu_k)
        return out.o.sum() + out.kl_loss

    q = torch.randn(c.k.shape[0], 4, 16)
    eager = f(x, q, c.k.float(), c.v.float())
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)(x, q, c.k.float(), c.v.float())
    assert torch.allclose(eager, compiled, atol=1e-5)


def test_msa_attention_module_trains_the_index_projections_only_through_the_kl():
    torch.manual_seed(0)
    c = make_case(lengths=((120, 120), (64, 64)), dtype=torch.float32)
    layer = mt.MSAAttention(hidden_size=12, num_kv_heads=2, index_dim=8, topk=4, block_size=16)
    x = torch.randn(c.k.shape[0], 12)
    q = torch.randn(c.k.shape[0], 4, 16, requires_grad=True)
    out = layer(x, q, c.k.float(), c.v.float(), c.cu_q)
    assert out.o.shape == q.shape and out.rows.shape == (2, q.shape[0], 4)
    out.o.sum().backward(retain_graph=True)
    assert q.grad is not None and layer.index_q.weight.grad is None
    out.kl_loss.backward()
    assert layer.index_q.weight.grad.abs().sum() > 0 and layer.index_k.weight.grad.abs().sum() > 0
