"""msa's ops as torch.library custom ops ("msa::..."), with fake (meta) kernels for
torch.compile and autograd where the math has a gradient.

Every op allocates its outputs (and, on CUDA, its workspace) with PyTorch, then hands the
tensors to msa._ext by DLPack: on CUDA the kernels run on the current stream with no host
synchronisation (unless a max_seqlen_* is left to be computed); on the CPU the host ops run
(f32 / bf16 / f16 inputs: the optimised CPU code; f64: the f64 reference)."""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from .. import _ext
from . import _common as c

# ---------------------------------------------------------------------------------------------
# indexer
# ---------------------------------------------------------------------------------------------


def _indexer_outputs(qi: Tensor, topk: int, return_lse: bool, which: int) -> Tuple[Tensor, Tensor]:
    """The indexer's outputs, allocated by PyTorch: int32 rows [heads, total_q, topk] and the
    selected LSE [heads, total_q] (an empty tensor when it is not wanted)."""
    total_q, heads = qi.shape[0], qi.shape[1]
    rows = torch.empty((heads, total_q, topk), dtype=torch.int32, device=qi.device)
    lse = torch.empty((heads, total_q) if return_lse else (0,), dtype=c.lse_dtype(qi, which),
                      device=qi.device)
    return rows, lse


@torch.library.custom_op("msa::indexer", mutates_args=())
def indexer_op(qi: Tensor, ki: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, topk: int,
               block_size: int, local_blocks: int, init_blocks: int, return_lse: bool,
               index_scale: float, temperature: float, fp8_index_compute: bool, max_seqlen_q: int,
               max_seqlen_k: int, impl: int) -> Tuple[Tensor, Tensor]:
    which = c.resolve_impl(qi, impl)
    rows, lse = _indexer_outputs(qi, topk, return_lse, which)
    if qi.shape[0] == 0:
        return rows, lse
    if which != c.IMPL_CUDA:
        _ext.indexer(c.dl(qi), c.dl(ki), c.dl(cu_seqlens_q), c.dl(cu_seqlens_k), None, None,
                     c.dl(rows), c.dl(lse) if return_lse else None, None, block_size, topk,
                     local_blocks, init_blocks, index_scale, temperature, fp8_index_compute, 0, 0, 0,
                     which)
        return rows, lse
    mq = c.max_seqlen(max_seqlen_q, cu_seqlens_q, "max_seqlen_q")
    mk = c.max_seqlen(max_seqlen_k, cu_seqlens_k, "max_seqlen_k")
    stream = c.stream_of(qi.device)
    lse_arg = lse if return_lse else None

    def call(ws):
        return _ext.indexer(c.dl(qi), c.dl(ki), c.dl(cu_seqlens_q), c.dl(cu_seqlens_k), None, None,
                            c.dl(rows), c.dl(lse_arg), c.dl(ws), block_size, topk, local_blocks,
                            init_blocks, index_scale, temperature, fp8_index_compute, mq, mk, stream,
                            c.IMPL_CUDA)

    c.launch(("indexer", qi.shape, ki.shape, cu_seqlens_q.shape[0], mq, mk, block_size, topk,
              local_blocks, init_blocks, return_lse, fp8_index_compute), qi.device, call)
    return rows, lse


@indexer_op.register_fake
def _(qi, ki, cu_seqlens_q, cu_seqlens_k, topk, block_size, local_blocks, init_blocks, return_lse,
      index_scale, temperature, fp8_index_compute, max_seqlen_q, max_seqlen_k, impl):
    heads, total_q = qi.shape[1], qi.shape[0]
    which = c.IMPL_CUDA if qi.is_cuda else (c.IMPL_REFERENCE if (impl == 0 or (impl < 0 and qi.dtype == torch.float64)) else c.IMPL_CPU)
    rows = qi.new_empty((heads, total_q, topk), dtype=torch.int32)
    lse = qi.new_empty((heads, total_q) if return_lse else (0,), dtype=c.lse_dtype(qi, which))
    return rows, lse


# ---------------------------------------------------------------------------------------------
# attention (sparse when rows are given, else dense causal) and its backward
# ---------------------------------------------------------------------------------------------


def _impl_for_fake(t: Tensor, impl: int) -> int:
    if t.is_cuda:
        return c.IMPL_CUDA
    if impl >= 0:
        return impl
    return c.IMPL_REFERENCE if t.dtype == torch.float64 else c.IMPL_CPU


def _attention_outputs(q: Tensor, which: int) -> Tuple[Tensor, Tensor]:
    """Attention's outputs, allocated by PyTorch: o in the inputs' float type, and the LSE
    [total_q, Hq] (f32; f64 from the reference given f64)."""
    return (torch.empty(q.shape, dtype=c.out_dtype(q), device=q.device),
            torch.empty(q.shape[:2], dtype=c.lse_dtype(q, which), device=q.device))


@torch.library.custom_op("msa::attention", mutates_args=())
def attention_op(q: Tensor, k: Tensor, v: Tensor, rows: Optional[Tensor], cu_seqlens_q: Tensor,
                 cu_seqlens_k: Tensor, block_size: int, scale: float, max_seqlen_q: int,
                 max_seqlen_k: int, impl: int, deterministic: bool = True) -> Tuple[Tensor, Tensor]:
    # `deterministic` is the backward's (docs/msa.md §4): carried here for autograd.
    which = c.resolve_impl(q, impl)
    o, lse = _attention_outputs(q, which)
    if q.shape[0] == 0:
        return o, lse
    if which != c.IMPL_CUDA:
        _ext.attention(c.dl(q), c.dl(k), c.dl(v), c.dl(rows), c.dl(cu_seqlens_q), c.dl(cu_seqlens_k),
                       None, None, c.dl(o), c.dl(lse), None, block_size, scale, 0, 0, 0, which)
        return o, lse
    mq = c.max_seqlen(max_seqlen_q, cu_seqlens_q, "max_seqlen_q")
    mk = c.max_seqlen(max_seqlen_k, cu_seqlens_k, "max_seqlen_k")
    stream = c.stream_of(q.device)

    def call(ws):
        return _ext.attention(c.dl(q), c.dl(k), c.dl(v), c.dl(rows), c.dl(cu_seqlens_q),
                              c.dl(cu_seqlens_k), None, None, c.dl(o), c.dl(lse), c.dl(ws), block_size,
                              scale, mq, mk, stream, c.IMPL_CUDA)

    c.launch(("attention", q.shape, k.shape, None if rows is None else rows.shape,
              cu_seqlens_q.shape[0], mq, mk, block_size, o.dtype), q.device, call)
    return o, lse


@attention_op.register_fake
def _(q, k, v, rows, cu_seqlens_q, cu_seqlens_k, block_size, scale, max_seqlen_q, max_seqlen_k, impl,
      deterministic=True):
    which = _impl_for_fake(q, impl)
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=c.lse_dtype(q, which))


@torch.library.custom_op("msa::attention_backward", mutates_args=())
def attention_backward_op(q: Tensor, k: Tensor, v: Tensor, rows: Optional[Tensor], o: Tensor,
                          lse: Tensor, grad_o: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                          block_size: int, scale: float, deterministic: bool, max_seqlen_q: int,
                          max_seqlen_k: int, impl: int) -> Tuple[Tensor, Tensor, Tensor]:
    which = c.resolve_impl(q, impl)
    if which != c.IMPL_CUDA:
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        if q.shape[0] == 0:
            return dq, dk.zero_(), dv.zero_()
        _ext.attention_backward(c.dl(q), c.dl(k), c.dl(v), c.dl(rows), c.dl(o), c.dl(lse),
                                c.dl(grad_o), c.dl(cu_seqlens_q), c.dl(cu_seqlens_k), c.dl(dq), c.dl(dk),
                                c.dl(dv), None, block_size, scale, deterministic, 0, 0, 0, which)
        return dq, dk, dv
    # The kernels write f32 gradients; they are cast to the inputs' dtype here.
    f32 = dict(dtype=torch.float32, device=q.device)
    dq, dk, dv = torch.empty(q.shape, **f32), torch.empty(k.shape, **f32), torch.empty(v.shape, **f32)
    if q.shape[0] == 0:
        return dq.to(q.dtype), dk.zero_().to(k.dtype), dv.zero_().to(v.dtype)
    mq = c.max_seqlen(max_seqlen_q, cu_seqlens_q, "max_seqlen_q")
    mk = c.max_seqlen(max_seqlen_k, cu_seqlens_k, "max_seqlen_k")
    stream = c.stream_of(q.device)

    def call(ws):
        return _ext.attention_backward(c.dl(q), c.dl(k), c.dl(v), c.dl(rows), c.dl(o), c.dl(lse),
                                       c.dl(grad_o), c.dl(cu_seqlens_q), c.dl(cu_seqlens_k), c.dl(dq),
                                       c.dl(dk), c.dl(dv), c.dl(ws), block_size, scale, deterministic,
                                       mq, mk, stream, c.IMPL_CUDA)

    c.launch(("attention_backward", q.shape, k.shape, None if rows is None else rows.shape,
              cu_seqlens_q.shape[0], mq, mk, block_size, deterministic), q.device, call)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@attention_backward_op.register_fake
def _(q, k, v, rows, o, lse, grad_o, cu_seqlens_q, cu_seqlens_k, block_size, scale, deterministic,
      max_seqlen_q, max_seqlen_k, impl):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _attention_setup(ctx, inputs, output):
    q, k, v, rows, cu_q, cu_k, block_size, scale, max_q, max_k, impl, deterministic = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, rows, o, lse, cu_q, cu_k)
    ctx.params = (block_size, scale, max_q, max_k, impl)
    ctx.deterministic = deterministic
    ctx.mark_non_differentiable(lse)


def _attention_backward(ctx, grad_o, grad_lse):
    q, k, v, rows, o, lse, cu_q, cu_k = ctx.saved_tensors
    block_size, scale, max_q, max_k, impl = ctx.params
    # The kernels read o and dO in the inputs' type (bf16 on CUDA) and contiguous.
    grad_o = grad_o.to(o.dtype).contiguous()
    dq, dk, dv = attention_backward_op(q, k, v, rows, o, lse, grad_o, cu_q, cu_k, block_size, scale,
                                       ctx.deterministic, max_q, max_k, impl)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None

attention_op.register_autograd(_attention_backward, setup_context=_attention_setup)


# ---------------------------------------------------------------------------------------------
# the indexer's KL loss (its gradients computed with the loss; the teacher side detached)
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("msa::indexer_kl", mutates_args=())
def indexer_kl_op(q: Tensor, k: Tensor, lse: Tensor, qi: Tensor, ki: Tensor, rows: Tensor,
                  cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, block_size: int, scale: float,
                  index_scale: float, temperature: float, kl_coefficient: float, deterministic: bool,
                  max_seqlen_q: int, max_seqlen_k: int, impl: int) -> Tuple[Tensor, Tensor, Tensor]:
    which = c.resolve_impl(q, impl)
    if which != c.IMPL_CUDA:
        dt = torch.float64 if which == c.IMPL_REFERENCE and q.dtype == torch.float64 else torch.float32
        loss = torch.zeros((), dtype=dt)
        dqi = torch.zeros(qi.shape, dtype=dt)
        dki = torch.zeros(ki.shape, dtype=dt)
        if q.shape[0] == 0:
            return loss, dqi, dki
        _ext.indexer_kl(c.dl(q), c.dl(k), c.dl(lse), c.dl(qi), c.dl(ki), c.dl(rows), c.dl(cu_seqlens_q),
                        c.dl(cu_seqlens_k), c.dl(loss), c.dl(dqi), c.dl(dki), None, None, block_size, scale,
                        index_scale, temperature, kl_coefficient, deterministic, 0, 0, 0, which)
        return loss, dqi, dki
    f32 = dict(dtype=torch.float32, device=q.device)
    loss, dqi, dki = torch.empty((), **f32), torch.empty(qi.shape, **f32), torch.empty(ki.shape, **f32)
    if q.shape[0] == 0:
        return loss.zero_(), dqi.zero_(), dki.zero_()
    mq = c.max_seqlen(max_seqlen_q, cu_seqlens_q, "max_seqlen_q")
    mk = c.max_seqlen(max_seqlen_k, cu_seqlens_k, "max_seqlen_k")
    stream = c.stream_of(q.device)

    def call(ws):
        return _ext.indexer_kl(c.dl(q), c.dl(k), c.dl(lse), c.dl(qi), c.dl(ki), c.dl(rows),
                               c.dl(cu_seqlens_q), c.dl(cu_seqlens_k), c.dl(loss), c.dl(dqi), c.dl(dki), None,
                               c.dl(ws), block_size, scale, index_scale, temperature, kl_coefficient,
                               deterministic, mq, mk, stream, c.IMPL_CUDA)

    c.launch(("indexer_kl", q.shape, k.shape, qi.shape, rows.shape, cu_seqlens_q.shape[0], mq, mk,
              block_size, deterministic), q.device, call)
    return loss, dqi, dki


@indexer_kl_op.register_fake
def _(q, k, lse, qi, ki, rows, cu_seqlens_q, cu_seqlens_k, block_size, scale, index_scale, temperature,
      kl_coefficient, deterministic, max_seqlen_q, max_seqlen_k, impl):
    dt = torch.float64 if (not q.is_cuda and q.dtype == torch.float64 and impl in (-1, 0)) else torch.float32
    return (q.new_empty((), dtype=dt), q.new_empty(qi.shape, dtype=dt), q.new_empty(ki.shape, dtype=dt))


def _kl_setup(ctx, inputs, output):
    qi, ki = inputs[3], inputs[4]
    loss, dqi, dki = output
    ctx.save_for_backward(dqi, dki)
    ctx.dtypes = (qi.dtype, ki.dtype)
    ctx.mark_non_differentiable(dqi, dki)


def _kl_backward(ctx, grad_loss, grad_dqi, grad_dki):
    dqi, dki = ctx.saved_tensors
    qi_dtype, ki_dtype = ctx.dtypes
    g = grad_loss.to(dqi.dtype)
    return (None, None, None, (g * dqi).to(qi_dtype), (g * dki).to(ki_dtype), None, None, None, None,
            None, None, None, None, None, None, None, None)


indexer_kl_op.register_autograd(_kl_backward, setup_context=_kl_setup)


# ---------------------------------------------------------------------------------------------
# MSA in one call (indexer + sparse attention; dense where every context <= topk * block_size)
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("msa::msa_attention", mutates_args=())
def msa_attention_op(q: Tensor, k: Tensor, v: Tensor, qi: Tensor, ki: Tensor, cu_seqlens_q: Tensor,
                     cu_seqlens_k: Tensor, topk: int, block_size: int, local_blocks: int,
                     init_blocks: int, scale: float, fp8_index_compute: bool, max_seqlen_q: int,
                     max_seqlen_k: int, impl: int) -> Tuple[Tensor, Tensor]:
    which = c.resolve_impl(q, impl)
    if q.shape[0] == 0:
        return _attention_outputs(q, which)
    if which != c.IMPL_CUDA:
        mk = c.max_seqlen(max_seqlen_k, cu_seqlens_k, "max_seqlen_k")
        rows = None
        if mk > topk * block_size:
            rows, _ = indexer_op(qi, ki, cu_seqlens_q, cu_seqlens_k, topk, block_size, local_blocks,
                                 init_blocks, False, 0.0, 1.0, fp8_index_compute, 0, 0, which)
        return attention_op(q, k, v, rows, cu_seqlens_q, cu_seqlens_k, block_size, scale, 0, 0, which)
    o, lse = _attention_outputs(q, which)  # the CUDA path: lse f32
    rows = torch.empty((k.shape[1], q.shape[0], topk), dtype=torch.int32, device=q.device)
    mq = c.max_seqlen(max_seqlen_q, cu_seqlens_q, "max_seqlen_q")
    mk = c.max_seqlen(max_seqlen_k, cu_seqlens_k, "max_seqlen_k")
    stream = c.stream_of(q.device)

    def call(ws):
        return _ext.msa_forward(c.dl(q), c.dl(k), c.dl(v), c.dl(qi), c.dl(ki), c.dl(cu_seqlens_q),
                                c.dl(cu_seqlens_k), None, None, c.dl(rows), c.dl(o), c.dl(lse), c.dl(ws),
                                block_size, topk, local_blocks, init_blocks, scale, fp8_index_compute, mq,
                                mk, stream)

    c.launch(("msa_forward", q.shape, k.shape, qi.shape, ki.shape, cu_seqlens_q.shape[0], mq, mk,
              block_size, topk, local_blocks, init_blocks, fp8_index_compute), q.device, call)
    return o, lse


@msa_attention_op.register_fake
def _(q, k, v, qi, ki, cu_seqlens_q, cu_seqlens_k, topk, block_size, local_blocks, init_blocks, scale,
      fp8_index_compute, max_seqlen_q, max_seqlen_k, impl):
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=c.lse_dtype(q, _impl_for_fake(q, impl)))


# ---------------------------------------------------------------------------------------------
# paged forms (msa/ops.h layouts: k_cache / v_cache [pages, Hkv, B, D], index keys [pages, B, Di])
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("msa::paged_indexer", mutates_args=())
def paged_indexer_op(qi: Tensor, index_key_cache: Tensor, page_table: Tensor, seq_lens: Tensor,
                     cu_seqlens_q: Tensor, topk: int, block_size: int, local_blocks: int,
                     init_blocks: int, return_lse: bool, index_scale: float, temperature: float,
                     fp8_index_compute: bool, max_seqlen_q: int, max_seqlen_k: int,
                     impl: int) -> Tuple[Tensor, Tensor]:
    which = c.resolve_impl(qi, impl)
    rows, lse = _indexer_outputs(qi, topk, return_lse, which)
    if qi.shape[0] == 0:
        return rows, lse
    lse_arg = lse if return_lse else None
    if which != c.IMPL_CUDA:
        _ext.indexer(c.dl(qi), c.dl(index_key_cache), c.dl(cu_seqlens_q), None, c.dl(page_table),
                     c.dl(seq_lens), c.dl(rows), c.dl(lse_arg), None, block_size, topk, local_blocks,
                     init_blocks, index_scale, temperature, fp8_index_compute, 0, 0, 0, which)
        return rows, lse
    mq = c.max_seqlen(max_seqlen_q, cu_seqlens_q, "max_seqlen_q")
    mk = c.max_seqlen(max_seqlen_k, None, "max_seqlen_k", lengths=seq_lens)
    stream = c.stream_of(qi.device)

    def call(ws):
        return _ext.indexer(c.dl(qi), c.dl(index_key_cache), c.dl(cu_seqlens_q), None, c.dl(page_table),
                            c.dl(seq_lens), c.dl(rows), c.dl(lse_arg), c.dl(ws), block_size, topk,
                            local_blocks, init_blocks, index_scale, temperature, fp8_index_compute, mq, mk,
                            stream, c.IMPL_CUDA)

    c.launch(("paged_indexer", qi.shape, index_key_cache.shape, page_table.shape, cu_seqlens_q.shape[0],
              mq, mk, block_size, topk, local_blocks, init_blocks, return_lse, fp8_index_compute),
             qi.device, call)
    return rows, lse


@paged_indexer_op.register_fake
def _(qi, index_key_cache, page_table, seq_lens, cu_seqlens_q, topk, block_size, local_blocks,
      init_blocks, return_lse, index_scale, temperature, fp8_index_compute, max_seqlen_q, max_seqlen_k,
      impl):
    heads, total_q = qi.shape[1], qi.shape[0]
    rows = qi.new_empty((heads, total_q, topk), dtype=torch.int32)
    lse = qi.new_empty((heads, total_q) if return_lse else (0,),
                       dtype=c.lse_dtype(qi, _impl_for_fake(qi, impl)))
    return rows, lse


@torch.library.custom_op("msa::paged_attention", mutates_args=())
def paged_attention_op(q: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor, seq_lens: Tensor,
                       rows: Optional[Tensor], cu_seqlens_q: Tensor, block_size: int, scale: float,
                       max_seqlen_q: int, max_seqlen_k: int, impl: int) -> Tuple[Tensor, Tensor]:
    which = c.resolve_impl(q, impl)
    o, lse = _attention_outputs(q, which)
    if q.shape[0] == 0:
        return o, lse
    if which != c.IMPL_CUDA:
        _ext.attention(c.dl(q), c.dl(k_cache), c.dl(v_cache), c.dl(rows), c.dl(cu_seqlens_q), None,
                       c.dl(page_table), c.dl(seq_lens), c.dl(o), c.dl(lse), None, block_size, scale, 0, 0, 0,
                       which)
        return o, lse
    mq = c.max_seqlen(max_seqlen_q, cu_seqlens_q, "max_seqlen_q")
    mk = c.max_seqlen(max_seqlen_k, None, "max_seqlen_k", lengths=seq_lens)
    stream = c.stream_of(q.device)

    def call(ws):
        return _ext.attention(c.dl(q), c.dl(k_cache), c.dl(v_cache), c.dl(rows), c.dl(cu_seqlens_q), None,
                              c.dl(page_table), c.dl(seq_lens), c.dl(o), c.dl(lse), c.dl(ws), block_size,
                              scale, mq, mk, stream, c.IMPL_CUDA)

    c.launch(("paged_attention", q.shape, k_cache.shape, page_table.shape,
              None if rows is None else rows.shape, cu_seqlens_q.shape[0], mq, mk, block_size),
             q.device, call)
    return o, lse


@paged_attention_op.register_fake
def _(q, k_cache, v_cache, page_table, seq_lens, rows, cu_seqlens_q, block_size, scale, max_seqlen_q,
      max_seqlen_k, impl):
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=c.lse_dtype(q, _impl_for_fake(q, impl)))


@torch.library.custom_op("msa::paged_msa_attention", mutates_args=())
def paged_msa_attention_op(q: Tensor, qi: Tensor, k_cache: Tensor, v_cache: Tensor,
                           index_key_cache: Tensor, page_table: Tensor, seq_lens: Tensor,
                           cu_seqlens_q: Tensor, topk: int, block_size: int, local_blocks: int,
                           init_blocks: int, scale: float, fp8_index_compute: bool, max_seqlen_q: int,
                           max_seqlen_k: int, impl: int) -> Tuple[Tensor, Tensor]:
    which = c.resolve_impl(q, impl)
    if q.shape[0] == 0:
        return _attention_outputs(q, which)
    mk = c.max_seqlen(max_seqlen_k, None, "max_seqlen_k", lengths=seq_lens)
    if which != c.IMPL_CUDA:
        rows = None
        if mk > topk * block_size:
            rows, _ = paged_indexer_op(qi, index_key_cache, page_table, seq_lens, cu_seqlens_q, topk,
                                       block_size, local_blocks, init_blocks, False, 0.0, 1.0,
                                       fp8_index_compute, 0, 0, which)
        return paged_attention_op(q, k_cache, v_cache, page_table, seq_lens, rows, cu_seqlens_q,
                                  block_size, scale, 0, 0, which)
    o, lse = _attention_outputs(q, which)  # the CUDA path: lse f32
    rows = torch.empty((k_cache.shape[1], q.shape[0], topk), dtype=torch.int32, device=q.device)
    mq = c.max_seqlen(max_seqlen_q, cu_seqlens_q, "max_seqlen_q")
    stream = c.stream_of(q.device)

    def call(ws):
        return _ext.msa_forward(c.dl(q), c.dl(k_cache), c.dl(v_cache), c.dl(qi), c.dl(index_key_cache),
                                c.dl(cu_seqlens_q), None, c.dl(page_table), c.dl(seq_lens), c.dl(rows), c.dl(o),
                                c.dl(lse), c.dl(ws), block_size, topk, local_blocks, init_blocks, scale,
                                fp8_index_compute, mq, mk, stream)

    c.launch(("paged_msa_forward", q.shape, qi.shape, k_cache.shape, page_table.shape,
              cu_seqlens_q.shape[0], mq, mk, block_size, topk, local_blocks, init_blocks,
              fp8_index_compute), q.device, call)
    return o, lse


@paged_msa_attention_op.register_fake
def _(q, qi, k_cache, v_cache, index_key_cache, page_table, seq_lens, cu_seqlens_q, topk, block_size,
      local_blocks, init_blocks, scale, fp8_index_compute, max_seqlen_q, max_seqlen_k, impl):
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=c.lse_dtype(q, _impl_for_fake(q, impl)))


def default_scale(scale: Optional[float], dim: int) -> float:
    return float(scale) if scale is not None else 1.0 / math.sqrt(dim)


__all__: List[str] = []
