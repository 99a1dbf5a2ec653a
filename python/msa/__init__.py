"""msa: MiniMax Sparse Attention (MSA) kernels for Python.

- ``msa.torch``: the ops as PyTorch custom ops (autograd, torch.compile, CUDA graphs) and the
  ``MSAAttention`` module.
- ``msa.vllm``: drop-in replacements for vLLM's MiniMax-M3 Triton ops (Hopper).
- ``msa._ext``: the compiled layer over DLPack arrays (any framework; used by the above).

CUDA tensors run msa's sm_90a kernels on the caller's current stream; CPU tensors run the
optimised CPU ops (f32 / bf16) or the f64 reference (f64). docs/python.md has the details.
"""

from . import _ext

__version__ = "0.2.0"


def built_with_cuda() -> bool:
    """Whether this build of msa has the CUDA kernels (nvcc was found when it was built)."""
    return bool(_ext.built_with_cuda())


def set_num_threads(threads: int) -> None:
    """Threads of the optimised CPU ops (0: every core, the default)."""
    _ext.set_num_threads(int(threads))


def num_threads() -> int:
    return int(_ext.num_threads())


__all__ = ["built_with_cuda", "set_num_threads", "num_threads", "__version__"]
