"""Drop-in replacements for vLLM's MiniMax-M3 Triton ops (vllm/models/minimax_m3/common/ops/),
running msa's Hopper kernels: same arguments, layouts and semantics.

  vLLM op (Triton)                         here
  minimax_m3_index_score + _index_topk     minimax_m3_index_score + minimax_m3_index_topk
                                           (msa's scan fuses scoring and top-k: index_score
                                           returns an IndexScores handle, index_topk runs the
                                           fused kernel; minimax_m3_index_prefill is both in one)
  minimax_m3_index_decode                  minimax_m3_index_decode
  minimax_m3_sparse_attn                   minimax_m3_sparse_attn      (writes `output` in place)
  minimax_m3_sparse_attn_decode            minimax_m3_sparse_attn_decode (writes `output`)

Layouts (vLLM's): KV cache [num_blocks, num_kv_heads, 128, 2 * head_dim] with K in
[..., :head_dim] and V in [..., head_dim:] (read in place as strided views); index-key cache
[num_blocks, 128, index_head_dim]; block_table int32 [batch, max_blocks]; seq_lens int32 [batch]
(tokens in the cache, the new ones included); prefix_lens int32 [batch] (the tokens before this
chunk's queries: seq_lens - query lengths); top-k rows int32 [num_kv_heads, total_q, topk] (a
transposed view of vLLM's shared buffer is accepted), -1 padded; q / output [total_q, heads, dim].

Supported: bf16 caches and queries, head_dim 64 / 128 (M3: 128), block size 64 / 128 (M3: 128),
top-k 1..32, GQA group 1..16. fp8 KV caches (kv_cache_dtype fp8: float8_e4m3fn with vLLM's
per-tensor k_scale / v_scale, docs/msa.md §6.6): msa's CUDA decode kernels read the e4m3 codes
(up to 16 queries per request); longer queries widen the sequences' blocks into a bf16 copy
first and run the bf16 prefill kernels on it. Other fp8 formats
(e5m2, e4m3fnuz), scales without an fp8 cache and fp8 index caches raise ValueError. float16
queries raise TypeError (bf16 only). Everything runs on the current stream with no host
synchronisation, so vLLM's CUDA graph capture of decode works.

Differences from the Triton ops that a caller can observe (docs/python.md):
- query positions come from seq_lens (pos = seq_len - q_len + i, docs/msa.md §2); prefix_lens is
  accepted and not read (vLLM passes seq_lens - q_len, which is the same position);
- the selection rule is msa's (docs/msa.md §3.3: forced init/local blocks, ties to the lower
  block); rows list the same block *sets* as Triton's up to near-ties, in another order;
- index_score returns a handle, not the [heads, total_q, blocks] score matrix.

Also runs on CPU tensors (through msa's host ops, copying the layouts), for tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from . import _ext
from .torch import _common as _c

SPARSE_BLOCK_SIZE = 128

__all__ = [
    "minimax_m3_index_score", "minimax_m3_index_topk", "minimax_m3_index_prefill", "minimax_m3_index_decode",
    "minimax_m3_sparse_attn", "minimax_m3_sparse_attn_decode", "IndexScores", "SPARSE_BLOCK_SIZE",
]

_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
             if hasattr(torch, n))


_E4M3 = getattr(torch, "float8_e4m3fn", None)


def _check_kv_cache(kv_cache: Tensor, k_scale, v_scale) -> int:
    dtype = str(kv_cache.dtype).replace('torch.', '')
    if kv_cache.dtype in _FP8:
        if kv_cache.dtype != _E4M3:
            raise ValueError("argument 'kv_cache': expected a bfloat16 or float8_e4m3fn KV cache (msa reads "
                             f"e4m3 codes with f32 scales), got dtype {dtype}")
        if k_scale is None or v_scale is None:
            raise ValueError("argument 'k_scale': expected vLLM's per-tensor k_scale and v_scale with a "
                             f"float8_e4m3fn KV cache, got {'no k_scale' if k_scale is None else 'no v_scale'}")
    elif k_scale is not None or v_scale is not None:
        raise ValueError("argument 'k_scale': expected no k_scale / v_scale with a bfloat16 KV cache (they go "
                         f"with kv_cache_dtype fp8), got dtype {dtype} with scales")
    if kv_cache.dim() != 4 or kv_cache.shape[3] % 2:
        raise ValueError("argument 'kv_cache': expected shape [num_blocks, num_kv_heads, block_size, "
                         f"2 * head_dim], got {list(kv_cache.shape)}")
    return kv_cache.shape[3] // 2


def _check_index_cache(index_kv_cache: Tensor) -> None:
    if index_kv_cache.dtype in _FP8:
        raise ValueError("argument 'index_kv_cache': expected a bfloat16 index-key cache (fp8 index caches "
                         "with vLLM's scale layout are not supported here), got "
                         f"{str(index_kv_cache.dtype).replace('torch.', '')}")
    if index_kv_cache.dim() != 3:
        raise ValueError("argument 'index_kv_cache': expected shape [num_blocks, block_size, head_dim], got "
                         f"{list(index_kv_cache.shape)}")


def _check_query(q: Tensor, name: str) -> None:
    _c.check_tensor(q, name)
    if q.dim() != 3:
        raise ValueError(f"argument '{name}': expected shape [total_q, heads, head_dim], got {list(q.shape)}")
    if q.is_cuda and q.dtype != torch.bfloat16:
        raise TypeError(f"argument '{name}': expected dtype bfloat16 (msa's kernels read bf16), got "
                        f"{str(q.dtype).replace('torch.', '')}")


def _scale_of(scale, name: str, device) -> Tensor:
    """vLLM's per-tensor k_scale / v_scale (a one-element tensor, or a float) as f32 [1] on
    `device`: a view of an f32 one-element tensor already there (no copy: CUDA-graph safe)."""
    if isinstance(scale, Tensor):
        if scale.numel() != 1:
            raise ValueError(f"argument '{name}': expected one per-tensor scale (vLLM's), got shape "
                             f"{list(scale.shape)}")
        if scale.device != device:
            raise ValueError(f"argument '{name}': expected a tensor on {device}, got {scale.device}")
        return scale.reshape(1).to(torch.float32)
    return torch.full((1,), float(scale), dtype=torch.float32, device=device)


def _kv_views(kv_cache: Tensor, head_dim: int):
    """K and V halves of vLLM's cache as strided views (no copy)."""
    return kv_cache[..., :head_dim], kv_cache[..., head_dim:]


def _host(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.contiguous()


def _impl(t: Tensor) -> int:
    return _c.IMPL_CUDA if t.is_cuda else _c.IMPL_CPU


def _rows_out(out: Optional[Tensor], heads: int, total_q: int, topk: int, device) -> Tensor:
    """Where selection rows go: `out[:, :total_q, :]` (vLLM's persistent buffer, possibly a
    transposed view) or a new tensor."""
    if out is None:
        return torch.empty((heads, total_q, topk), dtype=torch.int32, device=device)
    _c.check_int32(out, "out")
    if out.dim() != 3 or out.shape[0] != heads or out.shape[1] < total_q or out.shape[2] != topk:
        raise ValueError(f"argument 'out': expected shape [{heads}, >= {total_q}, {topk}], got {list(out.shape)}")
    return out[:, :total_q, :]


def _indexer(idx_q: Tensor, index_kv_cache: Tensor, block_table: Tensor, cu_seqlens_q: Tensor, seq_lens: Tensor,
             max_query_len: int, max_seq_len: int, topk: int, init_blocks: int, local_blocks: int,
             out: Optional[Tensor]) -> Tensor:
    _check_query(idx_q, "idx_q")
    _check_index_cache(index_kv_cache)
    for t, n in ((block_table, "block_table"), (cu_seqlens_q, "cu_seqlens_q"), (seq_lens, "seq_lens")):
        _c.check_int32(t, n)
    total_q, heads = idx_q.shape[0], idx_q.shape[1]
    block = index_kv_cache.shape[1]
    target = _rows_out(out, heads, total_q, topk, idx_q.device)
    rows = target if target.is_contiguous() else torch.empty((heads, total_q, topk), dtype=torch.int32,
                                                             device=idx_q.device)
    if total_q == 0:
        return target
    local = max(int(local_blocks), 1)  # vLLM's local_blocks 0 still keeps the query's own block
    if idx_q.is_cuda:
        stream = _c.stream_of(idx_q.device)
        mq, mk = int(max_query_len), int(max_seq_len)

        def call(ws):
            return _ext.indexer(_c.dl(idx_q), _c.dl(index_kv_cache), _c.dl(cu_seqlens_q), None, _c.dl(block_table),
                                _c.dl(seq_lens), _c.dl(rows), None, _c.dl(ws), block, int(topk), local,
                                int(init_blocks), 0.0, 1.0, False, mq, mk, stream, _c.IMPL_CUDA)

        _c.launch(("vllm_indexer", idx_q.shape, index_kv_cache.shape, block_table.shape, cu_seqlens_q.shape[0],
                   mq, mk, topk, local, init_blocks), idx_q.device, call)
    else:
        _ext.indexer(_c.dl(_host(idx_q)), _c.dl(_host(index_kv_cache)), _c.dl(_host(cu_seqlens_q)), None,
                     _c.dl(_host(block_table)), _c.dl(_host(seq_lens)), _c.dl(rows), None, None, block, int(topk),
                     local, int(init_blocks), 0.0, 1.0, False, 0, 0, 0, _c.IMPL_CPU)
    if rows is not target:
        target.copy_(rows)
    return target


@dataclass
class IndexScores:
    """What minimax_m3_index_score returns: its arguments, for minimax_m3_index_topk to run msa's
    fused score + top-k scan (msa never materialises the [heads, total_q, blocks] scores: at 1M
    tokens they would not fit, docs/msa.md §3.7)."""
    idx_q: Tensor
    index_kv_cache: Tensor
    block_table: Tensor
    cu_seqlens_q: Tensor
    seq_lens: Tensor
    prefix_lens: Tensor
    max_query_len: int
    max_seq_len: int
    num_kv_heads: int

    @property
    def shape(self):
        blocks = -(-int(self.max_seq_len) // int(self.index_kv_cache.shape[1]))
        return (self.idx_q.shape[1], self.idx_q.shape[0], blocks)


def minimax_m3_index_score(idx_q: Tensor, index_kv_cache: Tensor, block_table: Tensor, cu_seqlens_q: Tensor,
                           seq_lens: Tensor, prefix_lens: Tensor, max_query_len: int, max_seq_len: int,
                           num_kv_heads: int, sm_scale: Optional[float] = None) -> IndexScores:
    """vLLM's prefill index scoring; returns a handle for minimax_m3_index_topk (see IndexScores)."""
    _check_query(idx_q, "idx_q")
    _check_index_cache(index_kv_cache)
    if idx_q.shape[1] != num_kv_heads:
        raise ValueError(f"argument 'idx_q': expected {num_kv_heads} index heads (num_kv_heads: M3 has one "
                         f"index head per KV head), got {idx_q.shape[1]}")
    return IndexScores(idx_q, index_kv_cache, block_table, cu_seqlens_q, seq_lens, prefix_lens, int(max_query_len),
                       int(max_seq_len), int(num_kv_heads))


def minimax_m3_index_topk(score: IndexScores, cu_seqlens_q: Tensor, prefix_lens: Tensor, max_query_len: int,
                          topk: int, init_blocks: int, local_blocks: int, out: Optional[Tensor] = None) -> Tensor:
    """vLLM's prefill top-k: rows int32 [num_kv_heads, total_q, topk] (into out[:, :total_q] when
    given), -1 beyond each query's min(topk, own block + 1) valid blocks."""
    if not isinstance(score, IndexScores):
        raise TypeError("argument 'score': expected the IndexScores of msa.vllm.minimax_m3_index_score (msa "
                        f"fuses scoring and top-k), got {type(score).__name__}")
    return _indexer(score.idx_q, score.index_kv_cache, score.block_table, cu_seqlens_q, score.seq_lens,
                    max_query_len, score.max_seq_len, topk, init_blocks, local_blocks, out)


def minimax_m3_index_prefill(idx_q: Tensor, index_kv_cache: Tensor, block_table: Tensor, cu_seqlens_q: Tensor,
                             seq_lens: Tensor, prefix_lens: Tensor, max_query_len: int, max_seq_len: int,
                             num_kv_heads: int, topk: int, init_blocks: int, local_blocks: int,
                             out: Optional[Tensor] = None) -> Tensor:
    """index_score then index_topk in one call (what the plugin runs for prefill)."""
    return minimax_m3_index_topk(
        minimax_m3_index_score(idx_q, index_kv_cache, block_table, cu_seqlens_q, seq_lens, prefix_lens,
                               max_query_len, max_seq_len, num_kv_heads),
        cu_seqlens_q, prefix_lens, max_query_len, topk, init_blocks, local_blocks, out)


def _decode_cu_seqlens(num_reqs: int, decode_query_len: int, device) -> Tensor:
    return torch.arange(0, (num_reqs + 1) * decode_query_len, decode_query_len, dtype=torch.int32, device=device)


def _padded_decode_lengths(seq_lens: Tensor, decode_query_len: int) -> Tensor:
    """vLLM pads CUDA-graph decode batches with zero-length requests that still own
    decode_query_len query rows; msa's kernels take every request's lengths as valid (q_len <=
    seq_len), so padded rows get seq_len = decode_query_len (their outputs are unused; one small
    device op, capturable)."""
    return seq_lens.clamp_min(int(decode_query_len))


def minimax_m3_index_decode(idx_q: Tensor, index_kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                            max_seq_len: int, topk: int, init_blocks: int, local_blocks: int, num_kv_heads: int,
                            decode_query_len: int, max_decode_query_len: Optional[int] = None,
                            out: Optional[Tensor] = None, *, query_start_loc: Optional[Tensor] = None) -> Tensor:
    """vLLM's decode index score + top-k: request-major queries, decode_query_len (1..16) per
    request (query_start_loc [num_reqs + 1] for ragged ones). Capturable: no host sync."""
    _check_query(idx_q, "idx_q")
    if idx_q.shape[1] != num_kv_heads:
        raise ValueError(f"argument 'idx_q': expected {num_kv_heads} index heads, got {idx_q.shape[1]}")
    if query_start_loc is None:
        if idx_q.shape[0] != seq_lens.shape[0] * decode_query_len:
            raise ValueError(f"argument 'idx_q': expected {seq_lens.shape[0]} x {decode_query_len} query rows "
                             f"(num_reqs x decode_query_len), got {idx_q.shape[0]}")
        query_start_loc = _decode_cu_seqlens(seq_lens.shape[0], decode_query_len, idx_q.device)
        seq_lens = _padded_decode_lengths(seq_lens, decode_query_len)
    max_q = int(max_decode_query_len) if max_decode_query_len else int(decode_query_len)
    return _indexer(idx_q, index_kv_cache, block_table, query_start_loc, seq_lens, max_q, max_seq_len, topk,
                    init_blocks, local_blocks, out)


def _attention(q: Tensor, kv_cache: Tensor, topk_idx: Tensor, block_table: Tensor, cu_seqlens_q: Tensor,
               seq_lens: Tensor, max_query_len: int, max_seq_len: Optional[int], num_kv_heads: int, sm_scale: float,
               output: Tensor, k_scale, v_scale) -> None:
    _check_query(q, "q")
    head_dim = _check_kv_cache(kv_cache, k_scale, v_scale)
    if kv_cache.shape[1] != num_kv_heads:
        raise ValueError(f"argument 'kv_cache': expected {num_kv_heads} KV heads, got {kv_cache.shape[1]}")
    if q.shape[2] != head_dim:
        raise ValueError(f"argument 'q': expected head_dim {head_dim} (half the cache's last dim), got {q.shape[2]}")
    _c.check_tensor(output, "output")
    if output.shape != q.shape or output.dtype != q.dtype or output.device != q.device:
        raise ValueError(f"argument 'output': expected a {str(q.dtype).replace('torch.', '')} tensor of shape "
                         f"{list(q.shape)} on {q.device}, got {str(output.dtype).replace('torch.', '')} "
                         f"{list(output.shape)} on {output.device}")
    for t, n in ((topk_idx, "topk_idx"), (block_table, "block_table"), (cu_seqlens_q, "cu_seqlens_q"),
                 (seq_lens, "seq_lens")):
        _c.check_int32(t, n)
    total_q = q.shape[0]
    if total_q == 0:
        return
    block = kv_cache.shape[2]
    rows = topk_idx[:, :total_q, :]
    rows = rows if rows.is_contiguous() else rows.contiguous()
    k, v = _kv_views(kv_cache, head_dim)
    scales = {}  # fp8: vLLM's per-tensor scales as f32 [1]
    if kv_cache.dtype in _FP8:
        scales = dict(k_scale=_scale_of(k_scale, "k_scale", kv_cache.device),
                      v_scale=_scale_of(v_scale, "v_scale", kv_cache.device))
    o = output if output.is_contiguous() else torch.empty_like(output)
    if q.is_cuda:
        lse = torch.empty((total_q, q.shape[1]), dtype=torch.float32, device=q.device)
        mq = int(max_query_len)
        mk = int(max_seq_len) if max_seq_len is not None else _c.max_seqlen(-1, None, "max_seq_len", lengths=seq_lens)
        stream = _c.stream_of(q.device)
        qc = q if q.is_contiguous() else q.contiguous()

        def call(ws):
            return _ext.attention(_c.dl(qc), _c.dl(k), _c.dl(v), _c.dl(rows), _c.dl(cu_seqlens_q), None,
                                  _c.dl(block_table), _c.dl(seq_lens), _c.dl(o), _c.dl(lse), _c.dl(ws), block,
                                  float(sm_scale), mq, mk, stream, _c.IMPL_CUDA,
                                  **{n: _c.dl(t) for n, t in scales.items()})

        _c.launch(("vllm_attention", q.shape, kv_cache.shape, kv_cache.dtype, block_table.shape, rows.shape,
                   cu_seqlens_q.shape[0], mq, mk), q.device, call)
    else:
        lse = torch.empty((total_q, q.shape[1]), dtype=torch.float32)
        _ext.attention(_c.dl(_host(q)), _c.dl(k.contiguous()), _c.dl(v.contiguous()), _c.dl(rows),
                       _c.dl(_host(cu_seqlens_q)), None, _c.dl(_host(block_table)), _c.dl(_host(seq_lens)),
                       _c.dl(o), _c.dl(lse), None, block, float(sm_scale), 0, 0, 0, _c.IMPL_CPU,
                       **{n: _c.dl(_host(t)) for n, t in scales.items()})
    if o is not output:
        output.copy_(o)


def minimax_m3_sparse_attn(q: Tensor, kv_cache: Tensor, topk_idx: Tensor, block_table: Tensor,
                           cu_seqlens_q: Tensor, seq_lens: Tensor, prefix_lens: Tensor, max_query_len: int,
                           num_kv_heads: int, sm_scale: float, output: Tensor, k_scale: Optional[Tensor] = None,
                           v_scale: Optional[Tensor] = None, *, max_seq_len: Optional[int] = None) -> None:
    """vLLM's prefill sparse attention: writes `output` [total_q, heads, head_dim] in place.
    max_seq_len (keyword, msa's addition) avoids the host sync that sizes the launch otherwise."""
    _attention(q, kv_cache, topk_idx, block_table, cu_seqlens_q, seq_lens, max_query_len, max_seq_len,
               num_kv_heads, sm_scale, output, k_scale, v_scale)


def minimax_m3_sparse_attn_decode(q: Tensor, kv_cache: Tensor, topk_idx: Tensor, block_table: Tensor,
                                  seq_lens: Tensor, num_kv_heads: int, sm_scale: float, output: Tensor,
                                  decode_query_len: int, k_scale: Optional[Tensor] = None,
                                  v_scale: Optional[Tensor] = None, query_start_loc: Optional[Tensor] = None,
                                  token_to_req_indices: Optional[Tensor] = None, *,
                                  max_seq_len: Optional[int] = None) -> None:
    """vLLM's decode sparse attention (uniform decode_query_len per request, or ragged with
    query_start_loc; token_to_req_indices is accepted and not needed). Writes `output`.
    Inside CUDA graph capture pass max_seq_len (the longest context the graph serves)."""
    if query_start_loc is None:
        if q.shape[0] != seq_lens.shape[0] * decode_query_len:
            raise ValueError(f"argument 'q': expected {seq_lens.shape[0]} x {decode_query_len} query rows "
                             f"(num_reqs x decode_query_len), got {q.shape[0]}")
        query_start_loc = _decode_cu_seqlens(seq_lens.shape[0], decode_query_len, q.device)
        seq_lens = _padded_decode_lengths(seq_lens, decode_query_len)
    _attention(q, kv_cache, topk_idx, block_table, query_start_loc, seq_lens, decode_query_len, max_seq_len,
               num_kv_heads, sm_scale, output, k_scale, v_scale)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


# ---- the vLLM plugin: swaps the Triton ops of the MiniMax-M3 backend for these on Hopper ----


def patch_vllm(max_model_len: Optional[int] = None, *, force: bool = False) -> bool:
    """Points vLLM's MiniMax-M3 Triton backend (MiniMaxM3IndexerTritonImpl,
    MiniMaxM3SparseTritonImpl) at msa's kernels, on an sm_90 GPU with a CUDA build of msa (or
    anywhere with force=True). Decode launches are sized by max_model_len (vLLM's, read from the
    current vLLM config when not given) so that they can be captured in CUDA graphs. Returns
    whether it patched. Registered as the vLLM general plugin "msa" (pyproject.toml)."""
    if not force:
        if not (_ext.built_with_cuda() and torch.cuda.is_available()):
            return False
        if torch.cuda.get_device_capability() != (9, 0):
            return False
    import vllm.models.minimax_m3.common.indexer as vllm_indexer  # noqa: PLC0415
    import vllm.models.minimax_m3.common.sparse_attention as vllm_attention  # noqa: PLC0415

    if max_model_len is None:
        try:
            from vllm.config import get_current_vllm_config  # noqa: PLC0415
            max_model_len = int(get_current_vllm_config().model_config.max_model_len)
        except Exception:  # no config yet: decode then sizes launches by the metadata's lengths
            max_model_len = None
    decode_len = max_model_len

    def index_decode(idx_q, index_kv_cache, block_table, seq_lens, max_seq_len, topk, init_blocks,
                     local_blocks, num_kv_heads, decode_query_len, max_decode_query_len=None, out=None, **_):
        bound = max(int(max_seq_len), decode_len or 0)
        return minimax_m3_index_decode(idx_q, index_kv_cache, block_table, seq_lens, bound, topk, init_blocks,
                                       local_blocks, num_kv_heads, decode_query_len, max_decode_query_len, out)

    def sparse_attn_decode(q, kv_cache, topk_idx, block_table, seq_lens, num_kv_heads, sm_scale, output,
                           decode_query_len, k_scale=None, v_scale=None, query_start_loc=None,
                           token_to_req_indices=None):
        return minimax_m3_sparse_attn_decode(q, kv_cache, topk_idx, block_table, seq_lens, num_kv_heads, sm_scale,
                                             output, decode_query_len, k_scale, v_scale, query_start_loc,
                                             token_to_req_indices, max_seq_len=decode_len)

    def sparse_attn(q, kv_cache, topk_idx, block_table, cu_seqlens_q, seq_lens, prefix_lens, max_query_len,
                    num_kv_heads, sm_scale, output, k_scale=None, v_scale=None, **_):
        return minimax_m3_sparse_attn(q, kv_cache, topk_idx, block_table, cu_seqlens_q, seq_lens, prefix_lens,
                                      max_query_len, num_kv_heads, sm_scale, output, k_scale, v_scale)

    vllm_indexer.minimax_m3_index_score = minimax_m3_index_score
    vllm_indexer.minimax_m3_index_topk = minimax_m3_index_topk
    vllm_indexer.minimax_m3_index_decode = index_decode
    vllm_attention.minimax_m3_sparse_attn = sparse_attn
    vllm_attention.minimax_m3_sparse_attn_decode = sparse_attn_decode
    return True


def register() -> None:
    """vLLM general-plugin entry point (vllm.general_plugins = msa)."""
    patch_vllm()
