"""The Numba path of LayerView.accumulate: one compiled pass on CPU caches.

Used for KV caches in host memory (CPU workers, offloaded KV read on the
host, tests) when numba imports; vLLM installs it (n-gram speculative
decoding), so this adds no dependency and no build step. The PyTorch path
stays the fallback and gives the same integers bit for bit.

Where the PyTorch path gathers a chunk of blocks into a buffer and reduces
it twice, this pass reads each block in place, in the rows' order, once.
For one block, head and piece column p it keeps two running sums over the
block's tokens: Y[p] = sum_tau x and W[p] = sum_tau (Y[p] after token tau).
Then sum_tau tau * x = n * Y[p] - W[p] for the n tokens read, so the pass
over the data only adds, and the definition's weights

    m_h * (2 * ((t0 + tau) * P + o + p) + 1)
      = m_h * [(2 * (t0 * P + o + p) + 1) + 2 * P * tau]

are applied to Y and W, 1/n of the data. Tokens at or past a row's valid
count are simply not read, so partial blocks need no mask. All arithmetic
is int64, whose wrap-around is the definition's mod 2**64; 16- and 32-bit
pieces come from an unsigned view, so widening them zero-extends.

Threads: none. The pass is single-threaded per worker (no parallel=True),
so numba's threading layers, which vLLM pins to `workqueue` because the
OpenMP one aborts after fork, never start; one core already reads near
memory speed (docs/performance.md). The compiled code is cached on disk
(numba's cache=True: next to this file, or in the user's cache folder when
that is not writable), and LayerView.warm_up compiles or loads it at worker
start, so no request pays for compilation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numba
import numpy as np
import torch
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

if TYPE_CHECKING:
    from vllm_kvchecksum.layer_view import CachePieces, LayerView

# Calls so far; lets tests prove this path ran rather than a fallback.
call_count = 0

_UNSIGNED = {torch.int64: np.int64, torch.int32: np.uint32, torch.int16: np.uint16}

# While a row's block is read, the same bytes of the block this many rows
# ahead are prefetched: shuffled block ids jump between pages, where the
# hardware prefetcher stops. 0 turns it off. Read at call time (benchmarks
# vary it).
PREFETCH_ROWS_AHEAD = 2
# Bytes per prefetch: one cache line.
_LINE_BYTES = 64


@intrinsic
def _prefetch(typingctx, array, index):  # pragma: no cover (compiled)
    """Hint the CPU to bring array[index]'s cache line in (llvm.prefetch:
    read, keep in all levels). It never faults, and reads nothing."""
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
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return sig, codegen


@numba.njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _add_token(x, y, w):  # pragma: no cover (compiled)
    """Y += x and W += Y over one token's pieces x (zero-extended if narrow)."""
    for p in range(x.shape[0]):
        y[p] += np.int64(x[p])
        w[p] += y[p]


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _cache_rows(flat, num_blocks, block_stride, kernel_blocks, kernel_tokens, heads,
                pieces, head_stride, token_stride, piece_stride, block_ids,
                first_tokens, valid_tokens, factor_base, pieces_per_token,
                piece_offset, out, column, rows_ahead, line_elements):  # pragma: no cover (compiled)
    """Add one cache tensor's share of each row's checksum to out[:, column].

    flat is the tensor's storage from its first element (int64 for 64-bit
    pieces, uint16/uint32 for narrower ones); the strides are in elements.
    Returns the index of the first row whose block id is out of range, or
    -1; rows before it have been added.
    """
    # Allocated here, not passed in: LLVM then knows they alias nothing.
    y = np.empty(pieces, dtype=np.int64)
    w = np.empty(pieces, dtype=np.int64)
    block_tokens = kernel_blocks * kernel_tokens
    two_p = 2 * pieces_per_token
    for r in range(block_ids.shape[0]):
        n = min(valid_tokens[r], block_tokens)
        if n <= 0:
            continue  # nothing of the request: the id is not read
        b = block_ids[r]
        if b < 0 or b >= num_blocks:
            return r
        ahead = b
        if r + rows_ahead < block_ids.shape[0]:
            ahead = block_ids[r + rows_ahead]
            if ahead < 0 or ahead >= num_blocks:
                ahead = b
        shift = (ahead - b) * kernel_blocks * block_stride  # to the same bytes there
        row_first = 2 * (first_tokens[r] * pieces_per_token + piece_offset) + 1
        acc = np.int64(0)
        for h in range(heads):
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
                    # leaves it scalar, about 4x slower), and a slice with
                    # no step stays contiguous in numba's types.
                    if piece_stride == 1:
                        if rows_ahead > 0:
                            for e in range(0, pieces, line_elements):
                                _prefetch(flat, base + shift + e)
                        _add_token(flat[base:base + pieces], y, w)
                    else:
                        _add_token(flat[base:base + (pieces - 1) * piece_stride + 1:piece_stride],
                                   y, w)
                read += min(kernel_tokens, n - read)
            s = np.int64(0)
            for p in range(pieces):
                s += (row_first + 2 * p) * y[p] + two_p * (n * y[p] - w[p])
            acc += (2 * (factor_base + h) + 1) * s
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

    def __init__(self, cache: "CachePieces", view: "LayerView"):
        self.flat = _storage_from(cache.pieces)
        self.fixed = (view.num_blocks, cache.block_stride, view.kernel_blocks_per_block,
                      view.kernel_tokens, view.num_heads, cache.num_pieces,
                      cache.head_stride, cache.token_stride, cache.piece_stride)
        self.layer = (view.factor_base, view.pieces_per_token, cache.piece_offset)
        self.line_elements = max(1, _LINE_BYTES // cache.pieces.element_size())


class NumbaLayerPath:
    """LayerView.accumulate compiled with numba; built on a view's first use."""

    def __init__(self, view: "LayerView"):
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
        ids = block_ids.numpy()
        t0 = first_tokens.numpy()
        valid = valid_tokens.numpy()
        # Add into a copy, so a bad id leaves out as it was (like the
        # PyTorch path, which raises before it adds).
        work = out_np[:, column:column + 1].copy()
        for cache in self.caches:
            bad = _cache_rows(cache.flat, *cache.fixed, ids, t0, valid, *cache.layer,
                              work, 0, PREFETCH_ROWS_AHEAD, cache.line_elements)
            if bad >= 0:
                raise IndexError(
                    f"block id {int(ids[bad])} of row {bad} is outside the layer's "
                    f"{self.view.num_blocks} blocks")
        out_np[:, column] = work[:, 0]
