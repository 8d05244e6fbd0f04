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
import logging

logger = logging.getLogger(__name__)


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
    """Whether numba imports and the compiled pass with it (checked once).

    Importing numba_path compiles the pass, or loads it from numba's disk
    cache; a failure there is logged, and CPU caches use the PyTorch path.
    """
    if not _imports("numba"):
        return False
    try:
        importlib.import_module("vllm_kvchecksum.core.kernels.numba_path")
    except Exception as exc:
        logger.warning("KV checksums: numba imports but the compiled CPU pass does not (%s: %s); "
                       "CPU caches are checksummed on the slower PyTorch path", type(exc).__name__, exc)
        return False
    return True
