"""DecodeStep: a decode step over a paged cache, planned once (msa::cuda::DecodePlan) and run as
often as wanted, inside a CUDA graph too, with new lengths in the same buffers."""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import _ext
from . import _common as _c
from . import _ops


class DecodeStep:
    """One planned MSA decode step (docs/msa.md §6.5).

    Plan (host, outside capture) from capacities: the largest batch, up to 16 new tokens per
    request, the longest context. The plan fixes the grids, the workspace (allocated here once,
    by PyTorch) and dense vs sparse (max_context <= topk * block_size: dense). The step's
    outputs o [rows, Hq, D] (out_dtype), lse [rows, Hq] f32 and topk [Hkv, rows, topk] live here
    too, so run() allocates nothing and can be captured:

        step = DecodeStep(max_batch=8, max_context=131072, q_heads=64, kv_heads=4, head_dim=128,
                          index_dim=128, device="cuda")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o, lse = step.run(q, qi, k_cache, v_cache, index_key_cache, page_table, cu_seqlens_q, seq_lens)
        # per step: write q / qi / cu_seqlens_q / seq_lens / page_table / cache contents in place,
        graph.replay()    # o, lse hold the new step's outputs

    The inputs must be the buffers the graph was captured with, sized for the capacities:
    q [rows, Hq, D], qi [rows, Hkv, Di], rows = max_total_queries (default max_batch *
    max_queries); cu_seqlens_q [max_batch + 1] and seq_lens [max_batch] int32 (unused slots:
    zero queries); page_table [max_batch, >= ceil(max_context / B)]; index_key_cache has the
    pages of k_cache. A step whose lengths exceed the plan computes nothing and leaves o / lse
    untouched; a page id outside the caches is read as page 0 (the step's outputs are then
    unspecified); check() reports either (it synchronises).

    On the CPU (no plan), run() computes the same step with the host ops (tests, reference)."""

    def __init__(self, *, max_batch: int, max_context: int, q_heads: int, kv_heads: int, head_dim: int,
                 index_dim: int, max_queries: int = 1, max_total_queries: Optional[int] = None,
                 topk: int = 16, block_size: int = 128, local_blocks: int = 1, init_blocks: int = 0,
                 scale: Optional[float] = None, index_scale: Optional[float] = None,
                 index_compute: str = "exact", out_dtype: torch.dtype = torch.bfloat16,
                 device="cuda") -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.max_batch, self.max_queries, self.max_context = int(max_batch), int(max_queries), int(max_context)
        self.rows = int(max_total_queries) if max_total_queries else self.max_batch * self.max_queries
        self.q_heads, self.kv_heads, self.head_dim, self.index_dim = int(q_heads), int(kv_heads), int(head_dim), int(index_dim)
        self.topk, self.block_size = int(topk), int(block_size)
        self.local_blocks, self.init_blocks = int(local_blocks), int(init_blocks)
        self.scale = float(scale) if scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.index_scale = float(index_scale) if index_scale is not None else 0.0
        if index_compute not in ("exact", "fp8"):
            raise ValueError(f"argument 'index_compute': expected 'exact' or 'fp8', got {index_compute!r}")
        self.fp8_index_compute = index_compute == "fp8"
        if out_dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"argument 'out_dtype': expected torch.bfloat16 or torch.float32, got {out_dtype}")
        self.plan = None
        if self.device.type == "cuda":
            if not _c.has_cuda_build():
                raise ValueError("argument 'device': expected 'cpu' (this msa build has no CUDA kernels), got cuda")
            self.plan = _ext.DecodePlan(self.max_batch, self.max_queries, self.rows, self.max_context,
                                        self.q_heads, self.kv_heads, self.head_dim, self.index_dim,
                                        self.block_size, self.topk, self.local_blocks, self.init_blocks,
                                        self.scale, self.index_scale, self.fp8_index_compute,
                                        self.device.index)
            self.workspace = torch.empty(self.plan.workspace_bytes, dtype=torch.uint8, device=self.device)
            self.dense = bool(self.plan.is_dense)
        else:
            self.workspace = None
            self.dense = self.max_context <= self.topk * self.block_size
        self.o = torch.zeros((self.rows, self.q_heads, self.head_dim), dtype=out_dtype, device=self.device)
        self.lse = torch.zeros((self.rows, self.q_heads), dtype=torch.float32, device=self.device)
        self.topk_rows = None if self.dense else torch.full((self.kv_heads, self.rows, self.topk), -1,
                                                            dtype=torch.int32, device=self.device)

    def _stream(self) -> int:
        return _c.stream_of(self.device)

    def run(self, q: Tensor, qi: Tensor, k_cache: Tensor, v_cache: Tensor, index_key_cache: Tensor,
            page_table: Tensor, cu_seqlens_q: Tensor, seq_lens: Tensor) -> Tuple[Tensor, Tensor]:
        """Runs the step on the current stream (capturable on CUDA: kernels only); returns the
        step's o and lse buffers (rows past cu_seqlens_q[max_batch] are left untouched)."""
        if self.plan is None:
            return self._run_host(q, qi, k_cache, v_cache, index_key_cache, page_table, cu_seqlens_q, seq_lens)
        self.plan.run(_c.dl(q), _c.dl(qi), _c.dl(k_cache), _c.dl(v_cache), _c.dl(index_key_cache),
                      _c.dl(page_table), _c.dl(cu_seqlens_q), _c.dl(seq_lens), _c.dl(self.o), _c.dl(self.lse),
                      _c.dl(self.topk_rows), _c.dl(self.workspace), self._stream())
        return self.o, self.lse

    def check(self, q: Tensor, qi: Tensor, k_cache: Tensor, v_cache: Tensor, index_key_cache: Tensor,
              page_table: Tensor, cu_seqlens_q: Tensor, seq_lens: Tensor) -> None:
        """Raises ValueError naming the first request of the last run() whose lengths did not fit
        the plan (that run computed nothing), or the page_table entry found outside the caches.
        Synchronises the stream: not for the hot loop."""
        if self.plan is None:
            return
        self.plan.check_last_step(_c.dl(q), _c.dl(qi), _c.dl(k_cache), _c.dl(v_cache), _c.dl(index_key_cache),
                                  _c.dl(page_table), _c.dl(cu_seqlens_q), _c.dl(seq_lens), _c.dl(self.o),
                                  _c.dl(self.lse), _c.dl(self.topk_rows), _c.dl(self.workspace), self._stream())

    def _run_host(self, q, qi, k_cache, v_cache, index_key_cache, page_table, cu_seqlens_q, seq_lens):
        total = int(cu_seqlens_q[-1])
        o, lse = _ops.paged_msa_attention_op(q[:total], qi[:total], k_cache, v_cache, index_key_cache,
                                             page_table, seq_lens, cu_seqlens_q, self.topk, self.block_size,
                                             self.local_blocks, self.init_blocks, self.scale,
                                             self.fp8_index_compute, -1, -1, -1)
        self.o[:total].copy_(o)
        self.lse[:total].copy_(lse)
        return self.o, self.lse
