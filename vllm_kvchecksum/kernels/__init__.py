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


@functools.cache
def triton_available() -> bool:
    """Whether triton imports (checked once)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # any import failure means: use the PyTorch path
        return False
    return True


@functools.cache
def numba_available() -> bool:
    """Whether numba imports (checked once)."""
    try:
        import numba  # noqa: F401
    except Exception:  # any import failure means: use the PyTorch path
        return False
    return True
