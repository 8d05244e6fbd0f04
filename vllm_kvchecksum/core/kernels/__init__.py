"""Code paths that compute one layer's block checksums.

numba_path: one compiled pass over the blocks in place, used on CPU caches
  when numba imports (vLLM installs it) and the pass runs here.
torch_path: the PyTorch implementation, the fallback on CPU without numba
  and on devices without Triton; also the reference the compiled paths are
  checked against.
triton_kernel: one Triton kernel per layer, used on CUDA.

triton and numba are imported only when a view needs them, so users do not
pay for an import they do not use.

No error of the compiled CPU pass stops a worker: where it cannot run
(NUMBA_DISABLE_JIT, a build that fails numba_available's check) CPU caches
take the PyTorch path from the start, and if it raises in a step
(LayerView.accumulate) that step and every later one do: the same values,
with one warning saying why and what to do.
"""

from __future__ import annotations

import functools
import importlib
import logging

logger = logging.getLogger(__name__)


class BlockIdOutOfRange(IndexError):
    """A row's block id is outside the layer: the caller's error, which the
    compiled pass reports like the PyTorch path (never a reason to leave it)."""


# Why the compiled pass was switched off in this process after it raised in
# a step (switch_numba_off), or None; numba_available() is False from then on.
_numba_off: str | None = None


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
    """Whether numba imports and the compiled pass with it runs (checked once).

    Importing numba_path compiles the pass, or loads it from numba's disk
    cache (a damaged cache is compiled afresh there); a failure is logged,
    and CPU caches use the PyTorch path. So is NUMBA_DISABLE_JIT, under
    which numba compiles nothing. The pass is then run on small caches of
    each piece width and compared with the PyTorch path (numba_path.
    self_check); if they differ or it raises, it is compiled afresh,
    without numba's disk cache, and checked again (one warning either way).
    False as well once the pass was switched off after raising in a step
    (switch_numba_off).
    """
    if _numba_off is not None:
        return False
    if not _imports("numba"):
        return False
    import numba
    if numba.config.DISABLE_JIT:
        logger.warning("KV checksums: NUMBA_DISABLE_JIT is set, so numba compiles nothing and the compiled CPU pass "
                       "cannot run; CPU caches are checksummed on the slower PyTorch path (the same values). Unset "
                       "NUMBA_DISABLE_JIT (a debugging setting) in the workers' environment to use the compiled pass.")
        return False
    try:
        numba_path = importlib.import_module("vllm_kvchecksum.core.kernels.numba_path")
    except Exception as exc:
        logger.warning("KV checksums: numba imports but the compiled CPU pass does not (%s: %s); "
                       "CPU caches are checksummed on the slower PyTorch path", type(exc).__name__, exc)
        return False
    try:
        problem = numba_path.self_check()
    except Exception as exc:  # the PyTorch side of the check: no reason to stop a worker either
        problem = f"{type(exc).__name__}: {exc}"
    if problem is None:
        return True
    try:
        numba_path.rebuild()
        again = numba_path.self_check()
    except Exception as exc:
        again = f"compiling it afresh failed: {type(exc).__name__}: {exc}"
    if again is None:
        folder = numba_path.cache_folder()
        logger.warning("KV checksums: the compiled CPU pass failed its start-up check (%s); compiled afresh, "
                       "without numba's disk cache, it passes%s.", problem,
                       f" (its cache is in {folder})" if folder else "")
        return True
    logger.warning("KV checksums: the compiled CPU pass fails its start-up check (%s), also when compiled afresh "
                   "(%s); CPU caches are checksummed on the slower PyTorch path (the same values). Please report "
                   "it, with numba's version (%s) and the CPU.", problem, again, numba.__version__)
    return False


def numba_switched_off() -> str | None:
    """Why the compiled pass was switched off in this process, or None."""
    return _numba_off


def switch_numba_off(exc: BaseException) -> None:
    """The compiled pass raised in a step: from now on this process
    checksums CPU caches on the PyTorch path (views that chose the pass
    switch at their next call, new ones never choose it). Logs one warning,
    the first time."""
    global _numba_off
    if _numba_off is None:
        folder = None
        try:
            from vllm_kvchecksum.core.kernels import numba_path
            folder = numba_path.cache_folder()
        except Exception:
            pass
        where = f" (numba's disk cache of it is in {folder})" if folder else ""
        logger.warning("KV checksums: the compiled CPU pass failed in a step (%s: %s); this process checksums CPU "
                       "caches on the slower PyTorch path from now on (the same values). If it happens again after "
                       "a restart, delete numba's cache of the pass%s, which the next start rebuilds, and report "
                       "it.", type(exc).__name__, exc, where)
        logger.debug("KV checksums: the compiled CPU pass's error", exc_info=exc)
    _numba_off = f"{type(exc).__name__}: {exc}"
    numba_available.cache_clear()
