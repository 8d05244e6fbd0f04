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
so no request pays for compilation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import logging

import numba
import numpy as np
import torch
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

if TYPE_CHECKING:
    from vllm_kvchecksum.core.pieces import CachePieces, PieceGeometry

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
# an index naming the wrong file for a signature, and every later start
# fails until the cache is deleted).
_SIGNATURES = [_rows_signature(t) for t in (numba.int64, numba.uint16, numba.uint32)]


def _compiled(fn):
    """fn compiled for _SIGNATURES, cached on disk where a folder is writable
    (next to this file, else the user's cache folder; NUMBA_CACHE_DIR first):
    without one it is compiled in each process, with a warning, rather than
    not at all."""
    options = dict(nogil=True, boundscheck=False)
    try:
        return numba.njit(_SIGNATURES, cache=True, **options)(fn)
    except RuntimeError as exc:  # numba: "cannot cache function ...: no locator available"
        logger.warning("KV checksums: the compiled CPU pass cannot be cached on disk (%s); each worker "
                       "compiles it at start-up. Set NUMBA_CACHE_DIR to a writable folder to avoid that.",
                       exc)
        return numba.njit(_SIGNATURES, cache=False, **options)(fn)


@_compiled
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
                raise IndexError(
                    f"block id {int(ids[bad])} of row {bad} is outside the layer's "
                    f"{self.view.num_blocks} blocks")
        if target is not out_np:
            out_np[:, column] = target[:, column]
