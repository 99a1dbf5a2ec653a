"""MSAAttention: MSA as a layer of a PyTorch model, holding the index projections, computing the
attention output and the indexer's KL auxiliary loss (docs/msa.md §3-5)."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor, nn


class MSAOutput(NamedTuple):
    o: Tensor         # [total_q, Hq, D], dtype of q
    kl_loss: Tensor   # scalar: the indexer's KL objective (trains the index projections only)
    rows: Tensor      # int32 [Hkv, total_q, topk]: the blocks each (query, group) attended


class MSAAttention(nn.Module):
    """The attention of an MSA layer over packed (varlen) sequences, for training and prefill.

    The model computes q, k, v (its own projections, RoPE and norms); this module holds the
    index branch's projections (index queries: one head of `index_dim` per KV group; index keys:
    one shared head) and computes

        qi, ki = index_q(x), index_k(x)
        rows   = indexer(qi, ki)                       # top-k blocks per (query, group)
        o, lse = sparse_attention(q, k, v, rows)      # gradients into q, k, v
        kl     = indexer_kl_loss(q, k, lse, qi, ki)   # gradients into the index projections

    Add `kl_loss` (times a coefficient, or `kl_coefficient` here) to the LM loss: it is the only
    signal that trains the index projections, and it does not reach q, k, v (docs/msa.md §5).
    On CUDA the ops read bf16: q, k, v, qi, ki are cast to bf16 for them (gradients flow back
    through the casts) and o is cast back to q's dtype.
    """

    def __init__(self, hidden_size: int, num_kv_heads: int, index_dim: int = 128, *, topk: int = 16,
                 block_size: int = 128, local_blocks: int = 1, init_blocks: int = 0,
                 scale: Optional[float] = None, index_scale: Optional[float] = None,
                 temperature: float = 1.0, kl_coefficient: float = 1.0, deterministic: bool = True,
                 bias: bool = False, detach_index_input: bool = True, device=None, dtype=None) -> None:
        super().__init__()
        factory = dict(device=device, dtype=dtype)
        self.num_kv_heads, self.index_dim = int(num_kv_heads), int(index_dim)
        self.topk, self.block_size = int(topk), int(block_size)
        self.local_blocks, self.init_blocks = int(local_blocks), int(init_blocks)
        self.scale, self.index_scale = scale, index_scale
        self.temperature, self.kl_coefficient = float(temperature), float(kl_coefficient)
        self.deterministic = bool(deterministic)
        # The KL trains the index projections; with detach_index_input its gradient stops there
        # and does not reach the hidden states (the trunk learns from the LM loss only).
        self.detach_index_input = bool(detach_index_input)
        self.index_q = nn.Linear(hidden_size, self.num_kv_heads * self.index_dim, bias=bias, **factory)
        self.index_k = nn.Linear(hidden_size, self.index_dim, bias=bias, **factory)

    def index_projections(self, x: Tensor):
        """qi [total_q, Hkv, Di] and ki [total_k, Di] of hidden states x [tokens, hidden]."""
        if self.detach_index_input:
            x = x.detach()
        return self.index_q(x).view(x.shape[0], self.num_kv_heads, self.index_dim), self.index_k(x)

    def forward(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor,
                max_seqlen: Optional[int] = None, *, cu_seqlens_k: Optional[Tensor] = None,
                max_seqlen_k: Optional[int] = None) -> MSAOutput:
        """x [total, hidden] (the layer's input, for the index projections), q [total, Hq, D],
        k, v [total, Hkv, D], cu_seqlens int32 [batch + 1]. Training and whole-prompt prefill have
        queries = keys (cu_seqlens for both); pass cu_seqlens_k for queries that are the suffix
        of longer key sequences (then x is the keys' hidden states and q the suffix's queries)."""
        from . import indexer, indexer_kl_loss, sparse_attention

        cu_k = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k
        max_k = max_seqlen if cu_seqlens_k is None else max_seqlen_k
        qi, ki = self.index_projections(x)
        if cu_seqlens_k is not None:
            qi = qi[qi.shape[0] - q.shape[0]:]
        if q.is_cuda:
            compute = torch.bfloat16
            q_c, k_c, v_c = q.to(compute), k.to(compute), v.to(compute)
            qi_c, ki_c = qi.to(compute), ki.to(compute)
        else:
            q_c, k_c, v_c, qi_c, ki_c = q, k, v, qi, ki
            if qi_c.dtype != q_c.dtype:
                qi_c, ki_c = qi_c.to(q_c.dtype), ki_c.to(q_c.dtype)
        q_c, k_c, v_c = q_c.contiguous(), k_c.contiguous(), v_c.contiguous()
        qi_c, ki_c = qi_c.contiguous(), ki_c.contiguous()
        if q.is_cuda:  # one host sync for the three ops when the caller gave no lengths
            from ._common import max_seqlen as _max_seqlen
            max_seqlen = _max_seqlen(-1 if max_seqlen is None else max_seqlen, cu_seqlens, "max_seqlen")
            max_k = _max_seqlen(-1 if max_k is None else max_k, cu_k, "max_seqlen_k")
        lengths = dict(max_seqlen_q=max_seqlen, max_seqlen_k=max_k)
        with torch.no_grad():
            rows, _ = indexer(qi_c.detach(), ki_c.detach(), cu_seqlens, cu_k, self.topk, self.block_size,
                              self.local_blocks, self.init_blocks, index_scale=self.index_scale,
                              temperature=self.temperature, **lengths)
        o, lse = sparse_attention(q_c, k_c, v_c, rows, cu_seqlens, cu_k, self.block_size, self.scale,
                                  deterministic=self.deterministic, **lengths)
        kl = indexer_kl_loss(q_c, k_c, lse, qi_c, ki_c, rows, cu_seqlens, cu_k, self.block_size,
                             scale=self.scale, index_scale=self.index_scale, temperature=self.temperature,
                             kl_coefficient=self.kl_coefficient, deterministic=self.deterministic, **lengths)
        return MSAOutput(o.to(q.dtype), kl, rows)
