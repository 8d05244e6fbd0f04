"""Code paths that compute one layer's block checksums.

numba_path: one compiled pass over the blocks in place, used on CPU caches
  when numba imports (vLLM installs it).
torch_path: the PyTorch implementation, the fallback on CPU without numba
  and on devices without Triton; also the reference the compiled paths are
  checked against.
triton_kernel: one Triton kernel per layer, used on CUDA.

triton and numba are imported only when a view needs them, so users do not
pay for an import they do not use.
"""

from __future__ import annotations

import functools
import importlib


def _imports(*modules: str) -> bool:
    """Whether every module imports; any failure means: use the PyTorch path."""
    try:
        for module in modules:
            importlib.import_module(module)
    except Exception:
        return False
    return True


@functools.cache
def triton_available() -> bool:
    """Whether triton imports (checked once)."""
    return _imports("triton", "triton.language")


@functools.cache
def numba_available() -> bool:
    """Whether numba imports (checked once)."""
    return _imports("numba")
