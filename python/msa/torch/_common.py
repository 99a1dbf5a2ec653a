"""What every op of msa.torch shares: tensors into msa._ext by DLPack, the caller's CUDA stream,
which implementation runs, host values (max_seqlen_*) and workspaces."""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.utils.dlpack import to_dlpack as _to_dlpack

from .. import _ext

# msa::Impl values, as msa._ext takes them.
IMPL_REFERENCE = 0
IMPL_CPU = 1
IMPL_CUDA = 2

_IMPL_NAMES = {"reference": IMPL_REFERENCE, "cpu": IMPL_CPU}


def dl(t: Optional[torch.Tensor]):
    """A DLPack capsule of `t` (zero copy; no stream synchronisation), or None."""
    return None if t is None else _to_dlpack(t)


try:  # the raw current stream without building a torch.cuda.Stream object (~1 us faster)
    _raw_stream = torch._C._cuda_getCurrentRawStream  # type: ignore[attr-defined]
except AttributeError:  # pragma: no cover - older / CPU-only builds of torch
    _raw_stream = None


def stream_of(device: torch.device) -> int:
    """The caller's current CUDA stream on `device` (msa launches its kernels there)."""
    if _raw_stream is not None:
        return int(_raw_stream(device.index if device.index is not None else torch.cuda.current_device()))
    return int(torch.cuda.current_stream(device).cuda_stream)


def impl_of(t: torch.Tensor, impl: Optional[str]) -> int:
    """CUDA tensors run the kernels; host f64 tensors the f64 reference; other host tensors the
    optimised CPU ops. `impl` ("cpu" / "reference") pins a host implementation."""
    if t.is_cuda:
        if impl not in (None, "cuda"):
            raise ValueError(f"argument 'impl': expected None or 'cuda' for CUDA tensors, got {impl!r}")
        return IMPL_CUDA
    if impl is None:
        return IMPL_REFERENCE if t.dtype == torch.float64 else IMPL_CPU
    if impl not in _IMPL_NAMES:
        raise ValueError(f"argument 'impl': expected None, 'cpu' or 'reference', got {impl!r}")
    return _IMPL_NAMES[impl]


def impl_code(impl: Optional[str]) -> int:
    """`impl` as the custom ops carry it: -1 = chosen from the tensors."""
    if impl is None:
        return -1
    if impl == "cuda":
        return IMPL_CUDA
    if impl not in _IMPL_NAMES:
        raise ValueError(f"argument 'impl': expected None, 'cpu', 'reference' or 'cuda', got {impl!r}")
    return _IMPL_NAMES[impl]


def resolve_impl(t: torch.Tensor, code: int) -> int:
    if code < 0:
        return impl_of(t, None)
    if t.is_cuda != (code == IMPL_CUDA):
        raise ValueError(
            "argument 'impl': expected " + ("'cuda' (or None) for CUDA tensors" if t.is_cuda else
                                            "'cpu' or 'reference' (or None) for CPU tensors")
            + f", got {['reference', 'cpu', 'cuda'][code]!r}")
    return code


def out_dtype(t: torch.Tensor) -> torch.dtype:
    """Outputs take the inputs' float type (bf16 in, bf16 out)."""
    return t.dtype


def lse_dtype(t: torch.Tensor, impl: int) -> torch.dtype:
    """LSEs are f32, f64 from the reference given f64 (gradcheck)."""
    return torch.float64 if (impl == IMPL_REFERENCE and t.dtype == torch.float64) else torch.float32


def longest(cu_seqlens: torch.Tensor) -> int:
    """The longest sequence of int32 offsets [batch + 1] (a host sync for CUDA tensors)."""
    if cu_seqlens.numel() < 2:
        return 0
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item())


def max_seqlen(value: int, cu_seqlens: Optional[torch.Tensor], name: str,
               lengths: Optional[torch.Tensor] = None) -> int:
    """A launch size (flash-attn's max_seqlen_q / max_seqlen_k): the caller's when given (>= 0),
    else computed from the offsets (or the lengths) with a host sync, which CUDA graph capture
    cannot do: there it must be given."""
    if value is not None and value >= 0:
        return int(value)
    source = lengths if lengths is not None else cu_seqlens
    if source is not None and source.is_cuda and torch.cuda.is_current_stream_capturing():
        raise ValueError(
            f"argument '{name}': expected an int inside CUDA graph capture (computing it from "
            "the device's sequence lengths needs a host sync, which capture forbids), got None")
    if lengths is not None:
        return int(lengths.max().item()) if lengths.numel() else 0
    return longest(source)


# Workspace sizes of CUDA calls, by the host values they depend on (bounded).
_WORKSPACE_BYTES: dict = {}


def launch(key: tuple, device: torch.device, call: Callable[[Optional[torch.Tensor]], int]) -> None:
    """Runs a CUDA op of msa._ext with a workspace from PyTorch's caching allocator on the
    current stream. `call(None)` returns the workspace size (nothing launched); `call(ws)`
    launches. Sizes are remembered per `key` (the call's shapes and host values), so the steady
    state is one allocation and one launch per call."""
    size = _WORKSPACE_BYTES.get(key)
    if size is None:
        size = int(call(None))
        if len(_WORKSPACE_BYTES) > 4096:
            _WORKSPACE_BYTES.clear()
        _WORKSPACE_BYTES[key] = size
    workspace = torch.empty(size, dtype=torch.uint8, device=device)
    call(workspace)


def check_tensor(t, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"argument '{name}': expected a torch.Tensor, got {type(t).__name__}")


def check_same_device(tensors, names) -> None:
    ref = tensors[0]
    for t, n in zip(tensors, names):
        check_tensor(t, n)
        if t.device != ref.device:
            raise ValueError(f"argument '{n}': expected a tensor on {ref.device} (the device of "
                             f"'{names[0]}'), got one on {t.device}")


def check_int32(t: torch.Tensor, name: str) -> None:
    if t.dtype != torch.int32:
        raise TypeError(f"argument '{name}': expected dtype int32 (as PyTorch code has cu_seqlens / "
                        f"page tables / rows), got {str(t.dtype).replace('torch.', '')}")


def check_float_input(t: torch.Tensor, name: str) -> None:
    if t.is_cuda:
        if t.dtype != torch.bfloat16:
            raise TypeError(f"argument '{name}': expected dtype bfloat16 on CUDA (msa's kernels read "
                            f"bf16; convert with .to(torch.bfloat16), nothing is rounded silently), got "
                            f"{str(t.dtype).replace('torch.', '')}")
    elif t.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise TypeError(f"argument '{name}': expected a float32, bfloat16, float16 or float64 tensor, "
                        f"got {str(t.dtype).replace('torch.', '')}")


def check_contiguous(t: torch.Tensor, name: str) -> None:
    if not t.is_contiguous():
        raise ValueError(f"argument '{name}': expected a contiguous tensor (call .contiguous()), got "
                         f"strides {tuple(t.stride())} for shape {tuple(t.shape)}")


def has_cuda_build() -> bool:
    return bool(_ext.built_with_cuda())
