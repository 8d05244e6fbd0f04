"""Code paths that compute one layer's block checksums.

torch_path: the PyTorch implementation, used on CPU and wherever Triton is
  missing; also the reference the kernel is checked against.
triton_kernel: one Triton kernel per layer, used on CUDA.

triton is imported only when a view needs it, so CPU users do not pay for
its import.
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
