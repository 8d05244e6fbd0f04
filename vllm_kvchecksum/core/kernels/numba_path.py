"""The Numba path of LayerView.accumulate: one compiled pass on CPU caches.

Used for KV caches in host memory (CPU workers, offloaded KV read on the
host, tests) when numba imports; vLLM installs it (n-gram speculative
decoding), so this adds no dependency and no build step. The PyTorch path
stays the fallback and gives the same integers bit for bit.

Where the PyTorch path gathers a chunk of blocks into a buffer and reduces
it twice, this pass reads each block in place, in the rows' order, once.
The definition's weight of piece p of token tau of a block at request
position t0 (P pieces per token, this tensor's at offset o) is

    m_h * (2 * ((t0 + tau) * P + o + p) + 1)
      = m_h * [row_first + 2 * (tau * P + p)],  row_first = 2 * (t0 * P + o) + 1

so only the in-block part 2 * (tau * P + p) varies within a block, and it
is the same for every block and head. Two ways to sum:

- A head's tokens back to back (piece stride 1, token stride = pieces: the
  HND caches vLLM's CPU backend and the worker use, and Mamba rows of
  contiguous elements): one loop over the head's run of pieces with two
  reductions, sum x and sum x * weights[e], against a table of the in-block
  weights (uint32, made once per view). LLVM keeps both in vector registers.
  Full blocks go four at a time, read side by side: with shuffled block ids
  that hides more of memory's latency than one block after another.
- Otherwise (NHD, padded cells, strided Mamba elements): for each head and
  piece column two running sums over the tokens, Y[p] = sum_tau x and
  W[p] = sum_tau (Y[p] after token tau); then sum_tau tau * x = n * Y[p] -
  W[p] for the n tokens read, so the pass only adds and the weights act on
  Y and W.

Tokens at or past a row's valid count are not read, so partial blocks need
no mask. All arithmetic is int64, whose wrap-around is the definition's mod
2**64; 16- and 32-bit pieces come from an unsigned view, so widening them
zero-extends. The first lines of the blocks a few rows ahead are
prefetched.

Threads: none. The pass is single-threaded per worker (no parallel=True),
so no numba threading layer starts (vLLM switches numba to `workqueue`
around its own parallel regions, because the OpenMP layer aborts after
fork); one core already reads at about a numpy sum's speed
(docs/performance.md). The pass is compiled when this module is imported
(kernels.numba_available imports it: a view choosing its path, at worker
start), for one signature per piece width, and cached on disk (numba's
cache=True: NUMBA_CACHE_DIR, else next to this file, else the user's cache
folder; with none writable it compiles in each process, with a warning),
so no request pays for compilation. A cache built beforehand in one of
those folders that is read-only here (a read-only image) is loaded too
(_DiskCache); a damaged one is compiled afresh and saved anew (_build).
kernels.numba_available then runs self_check, and LayerView gives way to
the PyTorch path if the pass raises in a step: no error of the pass stops
a worker.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import logging
import os
import tempfile
from dataclasses import dataclass

import numba
import numpy as np
import torch
from llvmlite import ir
from numba.core import cgutils, typeinfer, types
from numba.core.caching import (CompileResultCacheImpl, FunctionCache, InTreeCacheLocator, UserProvidedCacheLocator,
                                UserWideCacheLocator, _Cache)
from numba.extending import intrinsic

from vllm_kvchecksum.core.kernels import BlockIdOutOfRange
from vllm_kvchecksum.core.pieces import CachePieces

if TYPE_CHECKING:
    from vllm_kvchecksum.core.pieces import PieceGeometry

logger = logging.getLogger(__name__)

# Calls so far; lets tests prove this path ran rather than a fallback.
call_count = 0

_UNSIGNED = {torch.int64: np.int64, torch.int32: np.uint32, torch.int16: np.uint16}

# When a row's block is read (or a group of four full ones), the first
# PREFETCH_LINES cache lines of each head's run in the blocks of the rows
# PREFETCH_ROWS_AHEAD further on are prefetched: shuffled block ids jump
# between pages, where the hardware prefetcher stops, and those lines start
# its streams. 0 turns it off. Read at call time (benchmarks vary them).
# On scripts/bench_checksum.py's layer, 3-12 rows and 1-4 lines were within
# noise of each other, all 10-15 % faster than none.
PREFETCH_ROWS_AHEAD = 4
PREFETCH_LINES = 2
# Bytes per prefetch: one cache line.
_LINE_BYTES = 64


@intrinsic
def _prefetch(typingctx, array, index):  # pragma: no cover (compiled)
    """Hint the CPU to bring array[index]'s cache line in (llvm.prefetch:
    read, moderate locality: into the outer caches). It never faults, and
    reads nothing."""
    sig = types.void(array, index)

    def codegen(context, builder, signature, args):
        array_type = signature.args[0]
        ary = context.make_array(array_type)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, array_type, ary, [args[1]],
                                       wraparound=False)
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
            "llvm.prefetch.p0")
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(2), i32(1)])
        return context.get_dummy_value()

    return sig, codegen


@numba.njit(nogil=True, boundscheck=False, inline="always")
def _first_weight(first_token, pieces_per_token, piece_offset):  # pragma: no cover (compiled)
    """row_first: the weight 2 * (t0 * P + o) + 1 of this tensor's first piece
    of a block whose first token is at request position t0."""
    return 2 * (first_token * pieces_per_token + piece_offset) + 1


@numba.njit(nogil=True, boundscheck=False, inline="always")
def _head_factor(factor_base, head):  # pragma: no cover (compiled)
    """m: the odd factor 2 * (layer * H + first_head + head) + 1 of a head
    (definition.slice_factor, with factor_base = layer * H + first_head)."""
    return 2 * (factor_base + head) + 1


@numba.njit(nogil=True, boundscheck=False, inline="always")
def _add_token(x, y, w):  # pragma: no cover (compiled)
    """Y += x and W += Y over one token's pieces x (zero-extended if narrow)."""
    for p in range(x.shape[0]):
        y[p] += np.int64(x[p])
        w[p] += y[p]


@numba.njit(nogil=True, boundscheck=False, inline="always")
def _dot_region(x, weights):  # pragma: no cover (compiled)
    """(sum of x, sum of x[e] * weights[e]) over a contiguous run of pieces:
    two reductions in one loop, which LLVM vectorizes with accumulators in
    registers (zero-extended if narrow; weights are uint32)."""
    s0 = np.int64(0)
    s1 = np.int64(0)
    for e in range(x.shape[0]):
        v = np.int64(x[e])
        s0 += v
        s1 += v * np.int64(weights[e])
    return s0, s1


@numba.njit(nogil=True, boundscheck=False, inline="always")
def _dot_regions4(x1, x2, x3, x4, weights):  # pragma: no cover (compiled)
    """_dot_region of four runs of one length at once: four blocks read side
    by side keep more of memory's latency hidden than one after another
    when block ids are shuffled."""
    a0 = np.int64(0)
    a1 = np.int64(0)
    b0 = np.int64(0)
    b1 = np.int64(0)
    c0 = np.int64(0)
    c1 = np.int64(0)
    d0 = np.int64(0)
    d1 = np.int64(0)
    for e in range(x1.shape[0]):
        t = np.int64(weights[e])
        v = np.int64(x1[e])
        a0 += v
        a1 += v * t
        v = np.int64(x2[e])
        b0 += v
        b1 += v * t
        v = np.int64(x3[e])
        c0 += v
        c1 += v * t
        v = np.int64(x4[e])
        d0 += v
        d1 += v * t
    return a0, a1, b0, b1, c0, c1, d0, d1


@numba.njit(nogil=True, boundscheck=False, inline="always")
def _prefetch_block(flat, block, kernel_blocks, block_stride, heads, head_stride, lines,
                    line_elements):  # pragma: no cover (compiled)
    """Prefetch the first lines of each head's run of a block: enough to
    start the hardware prefetcher's streams before the block is read."""
    for kb in range(kernel_blocks):
        for h in range(heads):
            start = (block * kernel_blocks + kb) * block_stride + h * head_stride
            for q in range(lines):
                _prefetch(flat, start + q * line_elements)


def _rows_signature(piece_type):
    """The one type signature of _cache_rows for pieces of piece_type (the
    wrapper passes C-contiguous arrays and Python ints, nothing else)."""
    i64 = numba.int64
    return i64(piece_type[::1], i64, i64, i64, i64, i64, i64, i64, i64, i64,
               i64[::1], i64[::1], i64[::1], i64, i64, i64, i64[:, ::1], i64,
               numba.uint32[::1], i64, i64, i64)


# Compiled when this module is imported, in this order, for the three piece
# widths: every process then writes numba's cache index the same way (lazy
# compilation in different orders by processes starting together can leave
# an index naming the wrong file for a signature, and every later start fails
# until the cache is deleted; _build now also repairs such an index).
_SIGNATURES = [_rows_signature(t) for t in (numba.int64, numba.uint16, numba.uint32)]


def _writable(folder: str) -> bool:
    """Whether this process can write in folder: numba's own test of a cache
    folder (_CacheLocator.ensure_cache_path), without creating it."""
    try:
        tempfile.TemporaryFile(dir=folder).close()
    except OSError:
        return False
    return True


class _ReadOnlyLocator(InTreeCacheLocator):
    """The first folder numba would cache a function in (NUMBA_CACHE_DIR's,
    the __pycache__ next to its module, the user's cache folder, in numba's
    order) that exists but this process cannot write: one a cache was built
    in beforehand (at image build time, by root, before the install was made
    read-only). numba skips such folders; this one is only read."""

    def __init__(self, py_func, py_file, folder):
        super().__init__(py_func, py_file)
        self._cache_path = folder

    def ensure_cache_path(self):
        raise OSError(f"{self._cache_path} is read-only here")

    @classmethod
    def from_function(cls, py_func, py_file):
        if not os.path.exists(py_file):
            return None
        kinds = [InTreeCacheLocator, UserWideCacheLocator]
        if numba.config.CACHE_DIR:
            kinds.insert(0, UserProvidedCacheLocator)
        for kind in kinds:
            folder = kind(py_func, py_file).get_cache_path()
            if os.path.isdir(folder) and not _writable(folder):
                return cls(py_func, py_file, folder)
        return None


class _ReadOnlyCacheImpl(CompileResultCacheImpl):
    _locator_classes = [_ReadOnlyLocator]


class _ReadOnlyCache(FunctionCache):
    """numba's cache of a function in the folder _ReadOnlyLocator finds,
    which _DiskCache only loads from."""
    _impl_class = _ReadOnlyCacheImpl


def _cache_or_none(kind, py_func):
    try:
        return kind(py_func)
    except RuntimeError:  # numba: "cannot cache function ...: no locator available"
        return None


class _DiskCache(_Cache):
    """Where the pass is cached: numba's own cache in the first folder this
    process can write (the one cache=True picks), and behind it a cache
    built beforehand in a folder it cannot write (_ReadOnlyCache), loaded
    from where the writable one has no build; what is compiled is saved in
    the writable one. load=False (a rebuild): nothing is loaded, and the
    writable cache's index is emptied first, so the builds saved there
    replace whatever it held."""

    def __init__(self, py_func, *, load: bool = True):
        self.writable = _cache_or_none(FunctionCache, py_func)
        self.read_only = _cache_or_none(_ReadOnlyCache, py_func)
        self.layers = [c for c in (self.writable, self.read_only) if c is not None]
        if not self.layers:
            raise RuntimeError(f"cannot cache function {py_func.__qualname__!r}: no folder to cache it in")
        self.load = load
        if not load and self.writable is not None:
            self.writable.flush()

    @property
    def cache_path(self):
        return self.layers[0].cache_path

    def load_overload(self, sig, target_context):
        if not self.load:
            return None
        for layer in self.layers:
            data = layer.load_overload(sig, target_context)
            if data is not None:
                return data
        return None

    def save_overload(self, sig, data):
        if self.writable is not None:
            self.writable.save_overload(sig, data)

    def enable(self):
        for layer in self.layers:
            layer.enable()

    def disable(self):
        for layer in self.layers:
            layer.disable()

    def flush(self):
        if self.writable is not None:
            self.writable.flush()


def _compiled(fn, *, load: bool = True):
    """fn compiled for _SIGNATURES and cached on disk: by numba's cache=True
    (NUMBA_CACHE_DIR, else next to this file, else the user's cache folder:
    the first writable one) unless one of those folders is read-only here,
    then by _DiskCache, which also loads a build from the read-only one. With
    no folder at all it is compiled in each process, with a warning, rather
    than not at all. load=False: compiled afresh, replacing the writable
    cache's builds (see _DiskCache)."""
    options = dict(nogil=True, boundscheck=False)
    try:
        cache = _DiskCache(fn, load=load)
    except RuntimeError as exc:
        logger.warning("KV checksums: the compiled CPU pass cannot be cached on disk (%s); each worker "
                       "compiles it at start-up. Set NUMBA_CACHE_DIR to a writable folder to avoid that.",
                       exc)
        return numba.njit(_SIGNATURES, cache=False, **options)(fn)
    if load and cache.read_only is None:
        # numba's own cache does all that is needed.
        return numba.njit(_SIGNATURES, cache=True, **options)(fn)
    dispatcher = numba.njit(**options)(fn)
    dispatcher._cache = cache  # what enable_caching() sets, with numba's own cache in it
    with typeinfer.register_dispatcher(dispatcher):
        for sig in _SIGNATURES:
            dispatcher.compile(sig)
    dispatcher.disable_compile()
    if load and cache.writable is None and dispatcher.stats.cache_misses:
        logger.warning("KV checksums: the cache of the compiled CPU pass in %s is read-only here and holds no "
                       "build of it for this numba (%s), Python and CPU, and no cache folder is writable: each "
                       "worker compiles the pass at start-up. Rebuild that cache where it is made (see "
                       "docs/performance.md, Startup) or set NUMBA_CACHE_DIR to a writable folder.",
                       cache.read_only.cache_path, numba.__version__)
    return dispatcher


def _missing_signatures(dispatcher) -> str | None:
    """None if dispatcher holds a build for each of _SIGNATURES and no
    other; else which are missing (a disk cache whose index names another
    signature's build for one: every call of that width would fail)."""
    held = set(dispatcher.overloads)
    missing = [str(s.args[0]) for s in _SIGNATURES if tuple(s.args) not in held]
    if not missing and len(held) == len(_SIGNATURES):
        return None
    return f"its index gives no build for the pieces {', '.join(missing)}"


def _build(fn):
    """_compiled(fn), checked: if loading from numba's disk cache raises (a
    truncated or garbage index or build) or leaves a signature without its
    build (an index naming another's file), the pass is compiled afresh and
    saved anew where the cache is writable, with one warning. Under
    NUMBA_DISABLE_JIT, fn itself: the pass runs as Python (to debug it,
    with PREFETCH_ROWS_AHEAD = 0: its prefetch cannot run as Python), and
    kernels.numba_available refuses it."""
    if numba.config.DISABLE_JIT:
        return fn
    try:
        dispatcher = _compiled(fn)
        problem = _missing_signatures(dispatcher)
    except Exception as exc:
        problem = f"{type(exc).__name__}: {exc}"
    if problem is None:
        return dispatcher
    dispatcher = _compiled(fn, load=False)
    cache = dispatcher._cache
    if isinstance(cache, _DiskCache) and cache.writable is not None:
        done = f"compiled afresh and saved anew in {cache.writable.cache_path}"
    else:
        done = "compiled afresh (nothing saved: no cache folder is writable)"
    advice = ""
    if isinstance(cache, _DiskCache) and cache.read_only is not None:
        advice = (f" {cache.read_only.cache_path} is read-only here: if this warning comes at every start, rebuild "
                  f"the cache there (see docs/performance.md, Startup) or delete its {fn.__name__} files.")
    logger.warning("KV checksums: numba's disk cache of the compiled CPU pass is damaged (%s); the pass was %s.%s",
                   problem, done, advice)
    return dispatcher


def _cache_rows(flat, num_blocks, block_stride, kernel_blocks, kernel_tokens, heads,
                pieces, head_stride, token_stride, piece_stride, block_ids,
                first_tokens, valid_tokens, factor_base, pieces_per_token,
                piece_offset, out, column, weights, rows_ahead, prefetch_lines,
                line_elements):  # pragma: no cover (compiled)
    """Add one cache tensor's share of each row's checksum to out[:, column].

    flat is the tensor's storage from its first element (int64 for 64-bit
    pieces, uint16/uint32 for narrower ones); the strides are in elements.
    weights: for a tensor whose tokens of a head lie back to back (piece
    stride 1, token stride = pieces), the in-block weight 2 * (tau * P + p)
    of each piece of a kernel block's head run, uint32; empty otherwise.
    Returns the index of the first row (with valid tokens) whose block id
    is out of range, having added nothing; else -1.
    """
    rows = block_ids.shape[0]
    block_tokens = kernel_blocks * kernel_tokens
    for r in range(rows):
        if min(valid_tokens[r], block_tokens) > 0 and not 0 <= block_ids[r] < num_blocks:
            return r  # an empty row's id is never read, whatever it holds
    contiguous = weights.shape[0] > 0
    two_p = 2 * pieces_per_token
    done = np.zeros(rows, dtype=np.bool_)
    if contiguous:
        # Full blocks four at a time, in the rows' order.
        full = np.empty(rows, dtype=np.int64)
        num_full = 0
        for r in range(rows):
            if valid_tokens[r] >= block_tokens:
                full[num_full] = r
                num_full += 1
        run = kernel_tokens * pieces
        for g in range(0, num_full - 3, 4):
            if rows_ahead > 0:
                for q in range(g + rows_ahead, min(g + rows_ahead + 4, num_full)):
                    _prefetch_block(flat, block_ids[full[q]], kernel_blocks, block_stride, heads,
                                    head_stride, prefetch_lines, line_elements)
            r1, r2, r3, r4 = full[g], full[g + 1], full[g + 2], full[g + 3]
            base1 = block_ids[r1] * kernel_blocks * block_stride
            base2 = block_ids[r2] * kernel_blocks * block_stride
            base3 = block_ids[r3] * kernel_blocks * block_stride
            base4 = block_ids[r4] * kernel_blocks * block_stride
            first1 = _first_weight(first_tokens[r1], pieces_per_token, piece_offset)
            first2 = _first_weight(first_tokens[r2], pieces_per_token, piece_offset)
            first3 = _first_weight(first_tokens[r3], pieces_per_token, piece_offset)
            first4 = _first_weight(first_tokens[r4], pieces_per_token, piece_offset)
            acc1 = np.int64(0)
            acc2 = np.int64(0)
            acc3 = np.int64(0)
            acc4 = np.int64(0)
            for kb in range(kernel_blocks):
                lead = two_p * kb * kernel_tokens  # the weight of the tokens before
                for h in range(heads):
                    o = kb * block_stride + h * head_stride
                    a0, a1, b0, b1, c0, c1, d0, d1 = _dot_regions4(
                        flat[base1 + o:base1 + o + run], flat[base2 + o:base2 + o + run],
                        flat[base3 + o:base3 + o + run], flat[base4 + o:base4 + o + run], weights)
                    m = _head_factor(factor_base, h)
                    acc1 += m * ((first1 + lead) * a0 + a1)
                    acc2 += m * ((first2 + lead) * b0 + b1)
                    acc3 += m * ((first3 + lead) * c0 + c1)
                    acc4 += m * ((first4 + lead) * d0 + d1)
            out[r1, column] += acc1
            out[r2, column] += acc2
            out[r3, column] += acc3
            out[r4, column] += acc4
            done[r1] = done[r2] = done[r3] = done[r4] = True
    # The other rows one at a time: partial blocks, the last full ones, and
    # every row of a tensor whose head runs are not back to back.
    # Allocated here, not passed in: LLVM then knows they alias nothing.
    y = np.empty(pieces, dtype=np.int64)
    w = np.empty(pieces, dtype=np.int64)
    for r in range(rows):
        n = min(valid_tokens[r], block_tokens)
        if n <= 0 or done[r]:
            continue  # nothing of the request: the id is not read
        b = block_ids[r]
        if rows_ahead > 0 and r + rows_ahead < rows:
            ahead = block_ids[r + rows_ahead]
            if 0 <= ahead < num_blocks:
                _prefetch_block(flat, ahead, kernel_blocks, block_stride, heads, head_stride,
                                prefetch_lines, line_elements)
        row_first = _first_weight(first_tokens[r], pieces_per_token, piece_offset)
        acc = np.int64(0)
        for h in range(heads):
            s = np.int64(0)
            if contiguous:
                # weight of piece p of token tau (of kernel block kb) is
                # row_first + 2 * kb * kernel_tokens * P + weights[tau * pieces + p]
                read = 0
                for kb in range(kernel_blocks):
                    tokens = min(kernel_tokens, n - read)
                    if tokens <= 0:
                        break
                    base = (b * kernel_blocks + kb) * block_stride + h * head_stride
                    s0, s1 = _dot_region(flat[base:base + tokens * pieces], weights)
                    s += (row_first + two_p * read) * s0 + s1
                    read += tokens
            else:
                for p in range(pieces):
                    y[p] = 0
                    w[p] = 0
                read = 0
                for kb in range(kernel_blocks):
                    head_base = (b * kernel_blocks + kb) * block_stride + h * head_stride
                    for t in range(min(kernel_tokens, n - read)):
                        base = head_base + t * token_stride
                        # A slice per token: LLVM vectorizes the loop over a
                        # view that starts at 0 (indexing flat at base + p
                        # leaves it scalar, about 4x slower), and a slice
                        # with no step stays contiguous in numba's types.
                        if piece_stride == 1:
                            _add_token(flat[base:base + pieces], y, w)
                        elif piece_stride == 0:  # one element read as every piece (expand())
                            v = np.int64(flat[base])
                            for p in range(pieces):
                                y[p] += v
                                w[p] += y[p]
                        else:
                            _add_token(flat[base:base + (pieces - 1) * piece_stride + 1:piece_stride],
                                       y, w)
                    read += min(kernel_tokens, n - read)
                for p in range(pieces):
                    s += (row_first + 2 * p) * y[p] + two_p * (n * y[p] - w[p])
            acc += _head_factor(factor_base, h) * s
        out[r, column] += acc
    return -1


# The pass in Python, kept to compile it afresh (rebuild); _cache_rows is the
# compiled pass (the Python function itself under NUMBA_DISABLE_JIT).
_cache_rows_py = _cache_rows
_cache_rows = _build(_cache_rows_py)


def _storage_from(pieces: torch.Tensor) -> np.ndarray:
    """A flat numpy view of the tensor's storage from its first element to
    its last (strides are never negative in torch), unsigned for 16/32-bit
    pieces."""
    extent = 0 if pieces.numel() == 0 else 1 + sum(
        (size - 1) * stride for size, stride in zip(pieces.shape, pieces.stride()))
    flat = torch.as_strided(pieces, (extent,), (1,), pieces.storage_offset())
    return flat.numpy().view(_UNSIGNED[pieces.dtype])


class _CacheArgs:
    """One cache tensor's arguments to the compiled pass, made once per view."""

    def __init__(self, cache: "CachePieces", view: "PieceGeometry"):
        self.flat = _storage_from(cache.pieces)
        self.fixed = (view.num_blocks, cache.block_stride, view.kernel_blocks_per_block,
                      view.kernel_tokens, view.num_heads, cache.num_pieces,
                      cache.head_stride, cache.token_stride, cache.piece_stride)
        self.layer = (view.factor_base, view.pieces_per_token, cache.piece_offset)
        self.line_elements = max(1, _LINE_BYTES // cache.pieces.element_size())
        self.weights = _run_weights(cache, view)


def _run_weights(cache: "CachePieces", view: "PieceGeometry") -> np.ndarray:
    """The in-block weights 2 * (tau * P + p) of a kernel block's run of one
    head, for the one-loop sums; empty (the per-token path) when a head's
    tokens are not back to back or a weight would not fit in 32 bits."""
    kt, pk = view.kernel_tokens, cache.num_pieces
    back_to_back = cache.piece_stride == 1 and (kt == 1 or cache.token_stride == pk)
    if not back_to_back or 2 * (kt * view.pieces_per_token + pk) >= 2**32:
        return np.empty(0, dtype=np.uint32)
    tau = np.arange(kt, dtype=np.int64)[:, None]
    p = np.arange(pk, dtype=np.int64)[None, :]
    return (2 * (tau * view.pieces_per_token + p)).reshape(-1).astype(np.uint32)


class NumbaLayerPath:
    """LayerView.accumulate compiled with numba; built on a view's first use."""

    def __init__(self, view: "PieceGeometry"):
        if view.device.type != "cpu":
            raise ValueError(f"the Numba path reads host memory; the cache is on {view.device}")
        self.view = view
        self.caches = [_CacheArgs(c, view) for c in view.caches]

    def accumulate(self, out: torch.Tensor, column: int,
                   block_ids: torch.Tensor, first_tokens: torch.Tensor,
                   valid_tokens: torch.Tensor) -> None:
        global call_count
        call_count += 1
        out_np = out.numpy()
        # The compiled pass takes C-contiguous arrays only (one signature
        # per piece width, compiled at import): others are copied here.
        ids = np.ascontiguousarray(block_ids.numpy())
        t0 = np.ascontiguousarray(first_tokens.numpy())
        valid = np.ascontiguousarray(valid_tokens.numpy())
        target = out_np if out_np.flags.c_contiguous else np.ascontiguousarray(out_np)
        for cache in self.caches:
            # Every id is checked before anything is added, so a bad one
            # leaves out as it was (like the PyTorch path, which raises
            # before it adds); the first tensor finds it.
            bad = _cache_rows(cache.flat, *cache.fixed, ids, t0, valid, *cache.layer,
                              target, column, cache.weights, PREFETCH_ROWS_AHEAD, PREFETCH_LINES,
                              cache.line_elements)
            if bad >= 0:
                raise BlockIdOutOfRange(
                    f"block id {int(ids[bad])} of row {bad} is outside the layer's "
                    f"{self.view.num_blocks} blocks")
        if target is not out_np:
            out_np[:, column] = target[:, column]


# -- the start-up check and what repairs the pass ---------------------------

@dataclass
class _Geometry:
    """A PieceGeometry for self_check's small caches."""
    caches: list
    block_size: int
    kernel_tokens: int
    num_blocks: int
    num_heads: int
    piece_bits: int
    pieces_per_token: int
    factor_base: int = 77
    kernel_blocks_per_block: int = 1
    device: torch.device = torch.device("cpu")


def _check_cases():
    """(geometry, block_ids, first_tokens, valid_tokens) covering each piece
    width and both ways of summing: 64-bit HND K and V read a head's run at
    once, full blocks four at a time with prefetches ahead (ten rows: eight
    full, a partial one, an empty one); 16-bit elements at stride 2 token by
    token; 32-bit contiguous elements."""
    gen = torch.Generator().manual_seed(24)

    def ints(shape, dtype):
        bits = torch.iinfo(dtype).bits
        return torch.randint(-2**(bits - 1), 2**(bits - 1) - 1, shape, generator=gen, dtype=dtype)

    kv = [ints((8, 2, 4, 3), torch.int64) for _ in range(2)]
    attention = _Geometry([CachePieces(t, 1, 2, 3, 3 * i) for i, t in enumerate(kv)],
                          block_size=4, kernel_tokens=4, num_blocks=8, num_heads=2, piece_bits=64, pieces_per_token=6)
    rows = (torch.tensor([5, 2, 7, 0, 3, 6, 1, 4, 2, 9]), torch.arange(10) * 4,
            torch.tensor([4, 4, 4, 4, 4, 4, 4, 4, 3, 0]))
    strided = ints((6, 3, 1, 10), torch.int16)[..., ::2]
    contiguous = ints((6, 3, 1, 5), torch.int32)
    state_rows = (torch.tensor([4, 0, 5, 2]), torch.zeros(4, dtype=torch.int64), torch.tensor([1, 1, 1, 0]))
    cases = [(attention, *rows)]
    for bits, t in ((16, strided), (32, contiguous)):
        state = _Geometry([CachePieces(t, 1, 2, 5, 0, t.stride(-1))], block_size=1, kernel_tokens=1, num_blocks=6,
                          num_heads=3, piece_bits=bits, pieces_per_token=5)
        cases.append((state, *state_rows))
    return cases


def self_check() -> str | None:
    """None if the compiled pass gives the PyTorch path's sums on small
    caches (_check_cases); else what went wrong. kernels.numba_available
    runs it when a process first chooses the pass, so that a pass which
    cannot run here (a build from numba's disk cache that is not this
    pass, a pass numba did not compile) is found at start-up, never in a
    worker's step. It does not count as calls (call_count)."""
    from vllm_kvchecksum.core.kernels.torch_path import TorchLayerPath

    global call_count
    calls = call_count
    try:
        for geometry, *rows in _check_cases():
            got = torch.zeros(rows[0].shape[0], 1, dtype=torch.int64)
            want = torch.zeros_like(got)
            try:
                NumbaLayerPath(geometry).accumulate(got, 0, *rows)
            except Exception as exc:
                return f"{type(exc).__name__}: {exc}"
            TorchLayerPath(geometry).accumulate(want, 0, *rows)
            if not torch.equal(got, want):
                return f"its sums of {geometry.piece_bits}-bit pieces differ from the PyTorch path's"
    finally:
        call_count = calls
    return None


def rebuild() -> None:
    """Compile the pass afresh, loading nothing from numba's disk cache and
    replacing what the writable one held (after self_check failed)."""
    global _cache_rows
    _cache_rows = _compiled(_cache_rows_py, load=False)


def cache_folder() -> str | None:
    """The folder numba's disk cache of the pass is in (None if none)."""
    stats = getattr(_cache_rows, "stats", None)
    return None if stats is None else stats.cache_path
