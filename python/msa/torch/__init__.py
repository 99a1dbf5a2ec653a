"""msa's ops for PyTorch: custom ops (torch.library, "msa::*") with fake kernels, so they work
under torch.compile and inside torch.cuda.graph capture; autograd for training; MSAAttention.

Layouts (include/msa/ops.h): q [total_q, Hq, D], k, v [total_k, Hkv, D], qi [total_q, Hi, Di],
ki [total_k, Di], int32 cu_seqlens [batch + 1]; selection rows int32 [Hkv, total_q, topk]; the
attention LSE [total_q, Hq], the indexer's [Hi, total_q]. A sequence's queries are the last
q_len of its keys.

CUDA tensors run msa's sm_90a kernels on the current stream (bf16 inputs; an f32 tensor on
CUDA raises TypeError), with outputs and workspaces from PyTorch's caching allocator and no host
synchronisation when max_seqlen_q / max_seqlen_k are given (else they are computed from
cu_seqlens: one .item()). CPU tensors run the optimised CPU ops (f32 / bf16 / f16) or, for f64,
the f64 reference (so torch.autograd.gradcheck is exact). Outputs have the inputs' dtype.

    rows, sel_lse = indexer(qi, ki, cu_seqlens_q, cu_seqlens_k, topk=16, block_size=128)
    o, lse = sparse_attention(q, k, v, rows, cu_seqlens_q, cu_seqlens_k)   # differentiable in q, k, v
    o, lse = dense_attention(q, k, v, cu_seqlens_q, cu_seqlens_k)
    loss = indexer_kl_loss(q, k, lse, qi, ki, rows, cu_seqlens_q, cu_seqlens_k)  # in qi, ki
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _common as _c
from . import _ops
from ._decode import DecodeStep
from ._module import MSAAttention, MSAOutput

__all__ = [
    "indexer", "sparse_attention", "dense_attention", "indexer_kl_loss", "msa_attention",
    "paged_indexer", "paged_sparse_attention", "paged_dense_attention", "paged_msa_attention",
    "DecodeStep", "MSAAttention", "MSAOutput",
]


def _seqlen(value: Optional[int]) -> int:
    return -1 if value is None else int(value)


def _scale(value: Optional[float]) -> float:
    return 0.0 if value is None else float(value)


def _index_compute(name: str) -> bool:
    if name not in ("exact", "fp8"):
        raise ValueError(f"argument 'index_compute': expected 'exact' or 'fp8', got {name!r}")
    return name == "fp8"


def _check_varlen(floats, float_names, ints, int_names) -> None:
    _c.check_same_device(list(floats) + list(ints), list(float_names) + list(int_names))
    for t, n in zip(floats, float_names):
        _c.check_float_input(t, n)
    for t, n in zip(ints, int_names):
        _c.check_int32(t, n)
    ref = floats[0]
    for t, n in zip(floats, float_names):
        if t.dtype != ref.dtype:
            raise TypeError(f"argument '{n}': expected dtype {str(ref.dtype).replace('torch.', '')} (that of "
                            f"'{float_names[0]}'), got {str(t.dtype).replace('torch.', '')}")
    if not ref.is_cuda:  # the host ops read contiguous tensors
        for t, n in zip(list(floats) + list(ints), list(float_names) + list(int_names)):
            _c.check_contiguous(t, n)
    else:
        _c.check_contiguous(ref, float_names[0])


def indexer(qi: Tensor, ki: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, topk: int = 16,
            block_size: int = 128, local_blocks: int = 1, init_blocks: int = 0,
            return_lse: bool = False, *, index_scale: Optional[float] = None,
            temperature: float = 1.0, index_compute: str = "exact",
            max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
            impl: Optional[str] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """Selection rows int32 [Hi, total_q, topk] (block ids, the query's own block in the last
    valid slot, -1 suffix; docs/msa.md §3) and, with return_lse, the selected LSE [Hi, total_q]
    of index_scale * s / temperature (None otherwise). No gradient (the selection is discrete)."""
    _check_varlen((qi, ki), ("qi", "ki"), (cu_seqlens_q, cu_seqlens_k), ("cu_seqlens_q", "cu_seqlens_k"))
    rows, lse = _ops.indexer_op(qi, ki, cu_seqlens_q, cu_seqlens_k, int(topk), int(block_size),
                                int(local_blocks), int(init_blocks), bool(return_lse), _scale(index_scale),
                                float(temperature), _index_compute(index_compute), _seqlen(max_seqlen_q),
                                _seqlen(max_seqlen_k), _c.impl_code(impl))
    return rows, (lse if return_lse else None)


def sparse_attention(q: Tensor, k: Tensor, v: Tensor, rows: Tensor, cu_seqlens_q: Tensor,
                     cu_seqlens_k: Tensor, block_size: int = 128, scale: Optional[float] = None, *,
                     max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
                     deterministic: bool = True, impl: Optional[str] = None) -> Tuple[Tensor, Tensor]:
    """Exact attention over the selected blocks (docs/msa.md §4): o [total_q, Hq, D] (q's dtype)
    and lse [total_q, Hq] (f32; f64 for f64 inputs). Differentiable in q, k, v with msa's
    backward (deterministic: a fixed summation order on CUDA); lse carries no gradient."""
    _check_varlen((q, k, v), ("q", "k", "v"), (rows, cu_seqlens_q, cu_seqlens_k),
                  ("rows", "cu_seqlens_q", "cu_seqlens_k"))
    if q.is_cuda and not rows.is_contiguous():
        rows = rows.contiguous()
    return _ops.attention_op(q, k, v, rows, cu_seqlens_q, cu_seqlens_k, int(block_size), _scale(scale),
                             _seqlen(max_seqlen_q), _seqlen(max_seqlen_k), _c.impl_code(impl),
                             bool(deterministic))


def dense_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                    scale: Optional[float] = None, *, max_seqlen_q: Optional[int] = None,
                    max_seqlen_k: Optional[int] = None, deterministic: bool = True,
                    impl: Optional[str] = None) -> Tuple[Tensor, Tensor]:
    """Dense causal GQA attention (the same formula over every visible key); differentiable."""
    _check_varlen((q, k, v), ("q", "k", "v"), (cu_seqlens_q, cu_seqlens_k), ("cu_seqlens_q", "cu_seqlens_k"))
    return _ops.attention_op(q, k, v, None, cu_seqlens_q, cu_seqlens_k, 128, _scale(scale),
                             _seqlen(max_seqlen_q), _seqlen(max_seqlen_k), _c.impl_code(impl),
                             bool(deterministic))


def indexer_kl_loss(q: Tensor, k: Tensor, lse: Tensor, qi: Tensor, ki: Tensor, rows: Tensor,
                    cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, block_size: int = 128, *,
                    scale: Optional[float] = None, index_scale: Optional[float] = None,
                    temperature: float = 1.0, kl_coefficient: float = 1.0, deterministic: bool = True,
                    max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
                    impl: Optional[str] = None) -> Tensor:
    """The indexer's KL objective (docs/msa.md §5): a scalar (f32; f64 for f64 inputs),
    differentiable in qi and ki. The teacher (q, k and the main-branch lse of sparse_attention)
    is detached. qi must have Hkv heads ([total_q, Hkv, Di])."""
    _check_varlen((q, k, qi, ki), ("q", "k", "qi", "ki"), (rows, cu_seqlens_q, cu_seqlens_k),
                  ("rows", "cu_seqlens_q", "cu_seqlens_k"))
    _c.check_same_device([q, lse], ["q", "lse"])
    if q.is_cuda:
        if lse.dtype != torch.float32:
            raise TypeError(f"argument 'lse': expected dtype float32 on CUDA, got {str(lse.dtype).replace('torch.', '')}")
        rows = rows.contiguous()
        q, k, qi, ki, lse = (t.contiguous() for t in (q, k, qi, ki, lse))
    loss, _, _ = _ops.indexer_kl_op(q.detach(), k.detach(), lse.detach(), qi, ki, rows, cu_seqlens_q,
                                    cu_seqlens_k, int(block_size), _scale(scale), _scale(index_scale),
                                    float(temperature), float(kl_coefficient), bool(deterministic),
                                    _seqlen(max_seqlen_q), _seqlen(max_seqlen_k), _c.impl_code(impl))
    return loss


def msa_attention(q: Tensor, k: Tensor, v: Tensor, qi: Tensor, ki: Tensor, cu_seqlens_q: Tensor,
                  cu_seqlens_k: Tensor, topk: int = 16, block_size: int = 128, local_blocks: int = 1,
                  init_blocks: int = 0, scale: Optional[float] = None, *, index_compute: str = "exact",
                  max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
                  impl: Optional[str] = None) -> Tuple[Tensor, Tensor]:
    """MSA in one call: the indexer, then sparse attention over its rows; where every context is
    at most topk * block_size, dense causal attention (equal to MSA there, docs/msa.md §4). On
    CUDA this is msa_forward (one call). Forward only: train with indexer + sparse_attention."""
    _check_varlen((q, k, v, qi, ki), ("q", "k", "v", "qi", "ki"), (cu_seqlens_q, cu_seqlens_k),
                  ("cu_seqlens_q", "cu_seqlens_k"))
    return _ops.msa_attention_op(q, k, v, qi, ki, cu_seqlens_q, cu_seqlens_k, int(topk), int(block_size),
                                 int(local_blocks), int(init_blocks), _scale(scale),
                                 _index_compute(index_compute), _seqlen(max_seqlen_q), _seqlen(max_seqlen_k),
                                 _c.impl_code(impl))


# ---- paged forms: k_cache / v_cache [pages, Hkv, B, D], index_key_cache [pages, B, Di],
# page_table int32 [batch, max_pages], seq_lens int32 [batch] (tokens in the cache, the new
# queries' included); request b's q_len new queries sit at seq_lens[b] - q_len + i. ----


def _check_paged(floats, float_names, ints, int_names) -> None:
    _check_varlen(floats, float_names, ints, int_names)


def paged_indexer(qi: Tensor, index_key_cache: Tensor, page_table: Tensor, seq_lens: Tensor,
                  cu_seqlens_q: Tensor, topk: int = 16, local_blocks: int = 1, init_blocks: int = 0,
                  return_lse: bool = False, *, block_size: Optional[int] = None,
                  index_scale: Optional[float] = None, temperature: float = 1.0,
                  index_compute: str = "exact", max_seqlen_q: Optional[int] = None,
                  max_seqlen_k: Optional[int] = None, impl: Optional[str] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """indexer() over a paged index-key cache (block size = the cache's page size)."""
    _check_paged((qi, index_key_cache), ("qi", "index_key_cache"), (page_table, seq_lens, cu_seqlens_q),
                 ("page_table", "seq_lens", "cu_seqlens_q"))
    b = int(block_size) if block_size is not None else int(index_key_cache.shape[1])
    rows, lse = _ops.paged_indexer_op(qi, index_key_cache, page_table, seq_lens, cu_seqlens_q, int(topk), b,
                                      int(local_blocks), int(init_blocks), bool(return_lse), _scale(index_scale),
                                      float(temperature), _index_compute(index_compute), _seqlen(max_seqlen_q),
                                      _seqlen(max_seqlen_k), _c.impl_code(impl))
    return rows, (lse if return_lse else None)


def paged_sparse_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor, seq_lens: Tensor,
                           rows: Tensor, cu_seqlens_q: Tensor, scale: Optional[float] = None, *,
                           max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
                           impl: Optional[str] = None) -> Tuple[Tensor, Tensor]:
    """sparse_attention() over a paged K/V cache (forward only)."""
    _check_paged((q, k_cache, v_cache), ("q", "k_cache", "v_cache"), (page_table, seq_lens, rows, cu_seqlens_q),
                 ("page_table", "seq_lens", "rows", "cu_seqlens_q"))
    if q.is_cuda and not rows.is_contiguous():
        rows = rows.contiguous()
    return _ops.paged_attention_op(q, k_cache, v_cache, page_table, seq_lens, rows, cu_seqlens_q,
                                   int(k_cache.shape[2]), _scale(scale), _seqlen(max_seqlen_q),
                                   _seqlen(max_seqlen_k), _c.impl_code(impl))


def paged_dense_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor, seq_lens: Tensor,
                          cu_seqlens_q: Tensor, scale: Optional[float] = None, *,
                          max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
                          impl: Optional[str] = None) -> Tuple[Tensor, Tensor]:
    """dense_attention() over a paged K/V cache (forward only)."""
    _check_paged((q, k_cache, v_cache), ("q", "k_cache", "v_cache"), (page_table, seq_lens, cu_seqlens_q),
                 ("page_table", "seq_lens", "cu_seqlens_q"))
    return _ops.paged_attention_op(q, k_cache, v_cache, page_table, seq_lens, None, cu_seqlens_q,
                                   int(k_cache.shape[2]), _scale(scale), _seqlen(max_seqlen_q),
                                   _seqlen(max_seqlen_k), _c.impl_code(impl))


def paged_msa_attention(q: Tensor, qi: Tensor, k_cache: Tensor, v_cache: Tensor, index_key_cache: Tensor,
                        page_table: Tensor, seq_lens: Tensor, cu_seqlens_q: Tensor, topk: int = 16,
                        local_blocks: int = 1, init_blocks: int = 0, scale: Optional[float] = None, *,
                        index_compute: str = "exact", max_seqlen_q: Optional[int] = None,
                        max_seqlen_k: Optional[int] = None, impl: Optional[str] = None) -> Tuple[Tensor, Tensor]:
    """msa_attention() over a paged cache: chunked prefill and decode (msa/ops.h's
    paged_msa_attention; CUDA: msa_forward on paged keys)."""
    _check_paged((q, qi, k_cache, v_cache, index_key_cache), ("q", "qi", "k_cache", "v_cache", "index_key_cache"),
                 (page_table, seq_lens, cu_seqlens_q), ("page_table", "seq_lens", "cu_seqlens_q"))
    return _ops.paged_msa_attention_op(q, qi, k_cache, v_cache, index_key_cache, page_table, seq_lens,
                                       cu_seqlens_q, int(topk), int(k_cache.shape[2]), int(local_blocks),
                                       int(init_blocks), _scale(scale), _index_compute(index_compute),
                                       _seqlen(max_seqlen_q), _seqlen(max_seqlen_k), _c.impl_code(impl))
