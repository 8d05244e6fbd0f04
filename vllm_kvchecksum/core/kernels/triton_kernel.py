"""The Triton path of LayerView.accumulate: one kernel launch per cache tensor.

Used on CUDA when triton imports. It reads each piece once and computes its
weight in place, where the PyTorch path gathers blocks and reduces them in
several passes. The sums are the same integers, so the two paths agree bit
for bit (tests/unit/test_triton_kernel*.py, and the benchmark asserts it).

One program handles one (row, chunk of up to CHUNK_PIECES pieces). A block
of attention KV is usually one program; a multi-megabyte row (a Mamba state)
spreads over many. The program walks its chunk in one flat loop over
[kernel block, head, token, piece] in tiles, so loads can be pipelined,
and adds its sum to the row's output column with an int64 atomic add:
integer addition is exact, so the order of the programs does not matter.

PIECE_BITS selects the piece width at compile time. 64 (attention KV): the
cache is read as int64 pieces, adjacent within a cell (address + p).
16 and 32 (Mamba state rows): the cache is the int16/int32 view of the
state's elements, piece p of a row is at + p * stride_piece (the element
dimension may be strided, e.g. a (len, dim) conv state read per channel),
and each loaded value is zero-extended: bitcast to uint16/uint32, then
widened to uint64. The 64-bit variant does not use stride_piece (the
launcher passes 1).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from vllm_kvchecksum.core.pieces import PieceGeometry

CHUNK_PIECES = 16 * 1024
MAX_TILE = 1024

# Launches so far; lets tests prove the kernel ran rather than a fallback.
launch_count = 0


@triton.jit(do_not_specialize=["out_row_stride", "column", "factor_base"])
def _layer_checksum_kernel(
    cache_ptr,  # pieces of one cache tensor: int64, or int16/int32 elements
    stride_block,  # strides in pieces of kernel block, head, token
    stride_head,
    stride_token,
    stride_piece,  # stride between 16/32-bit pieces (unused for 64)
    block_ids_ptr,  # int64 [rows]: logical block ids
    first_tokens_ptr,  # int64 [rows]: request position of the first token
    valid_tokens_ptr,  # int64 [rows]: token slots to include
    out_ptr,  # int64 [rows, cols]
    out_row_stride,
    column,
    factor_base,  # layer * H + first_head: head h's factor is 2*(base+h)+1
    KERNEL_BLOCKS: tl.constexpr,  # kernel blocks per logical block
    HEADS: tl.constexpr,
    KERNEL_TOKENS: tl.constexpr,
    PIECES: tl.constexpr,  # this tensor's pieces per token and head
    PIECES_PER_TOKEN: tl.constexpr,  # all tensors' pieces per token and head
    PIECE_OFFSET: tl.constexpr,  # where this tensor's pieces start
    PIECE_BITS: tl.constexpr,  # 64, or 16/32 (zero-extended elements)
    CHUNK: tl.constexpr,
    TILE: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    block_id = tl.load(block_ids_ptr + row)
    first_token = tl.load(first_tokens_ptr + row)
    valid = tl.load(valid_tokens_ptr + row)
    total: tl.constexpr = KERNEL_BLOCKS * HEADS * KERNEL_TOKENS * PIECES
    block_ptr = cache_ptr + block_id.to(tl.int64) * KERNEL_BLOCKS * stride_block
    base = factor_base.to(tl.int64)
    chunk_start = chunk.to(tl.int64) * CHUNK
    acc = tl.zeros([TILE], dtype=tl.uint64)
    for tile_start in tl.range(0, CHUNK, TILE):
        e = chunk_start + tile_start + tl.arange(0, TILE).to(tl.int64)
        p = e % PIECES
        rest = e // PIECES
        t = rest % KERNEL_TOKENS
        rest = rest // KERNEL_TOKENS
        h = rest % HEADS
        kb = rest // HEADS
        tau = kb * KERNEL_TOKENS + t
        mask = (e < total) & (tau < valid)
        if PIECE_BITS == 64:
            x = tl.load(block_ptr + kb * stride_block + h * stride_head +
                        t * stride_token + p, mask=mask, other=0)
        elif PIECE_BITS == 32:
            x = tl.load(block_ptr + kb * stride_block + h * stride_head +
                        t * stride_token + p * stride_piece, mask=mask, other=0)
            x = x.to(tl.uint32, bitcast=True).to(tl.uint64)
        else:
            x = tl.load(block_ptr + kb * stride_block + h * stride_head +
                        t * stride_token + p * stride_piece, mask=mask, other=0)
            x = x.to(tl.uint16, bitcast=True).to(tl.uint64)
        j = (first_token + tau) * PIECES_PER_TOKEN + PIECE_OFFSET + p
        # uint64 wraps like the definition's mod 2**64, and unsigned
        # overflow is not flagged by Triton's debug-mode checks.
        factor = (2 * (base + h) + 1).to(tl.uint64, bitcast=True)
        weight = (2 * j + 1).to(tl.uint64, bitcast=True)
        # (a no-op bitcast for 16/32-bit pieces, already zero-extended)
        acc += x.to(tl.uint64, bitcast=True) * (factor * weight)
    chunk_sum = tl.sum(acc, axis=0)
    tl.atomic_add(out_ptr + row.to(tl.int64) * out_row_stride + column,
                  chunk_sum.to(tl.int64, bitcast=True))


def launch_shape(pieces_per_row: int) -> tuple[int, int, int]:
    """(tile, chunk, chunks per row) for a row of pieces_per_row pieces."""
    tile = min(MAX_TILE, triton.next_power_of_2(pieces_per_row))
    chunk = min(CHUNK_PIECES, triton.cdiv(pieces_per_row, tile) * tile)
    return tile, chunk, triton.cdiv(pieces_per_row, chunk)


def accumulate(view: "PieceGeometry", out: torch.Tensor, column: int,
               block_ids: torch.Tensor, first_tokens: torch.Tensor,
               valid_tokens: torch.Tensor) -> None:
    """LayerView.accumulate on the kernel: one launch per cache tensor."""
    global launch_count
    rows = out.shape[0]
    block_ids = block_ids.contiguous()
    first_tokens = first_tokens.contiguous()
    valid_tokens = valid_tokens.contiguous()
    for cache in view.caches:
        pieces_per_row = (view.kernel_blocks_per_block * view.num_heads *
                          view.kernel_tokens * cache.num_pieces)
        tile, chunk, chunks = launch_shape(pieces_per_row)
        _layer_checksum_kernel[(rows, chunks)](
            cache.pieces, cache.block_stride, cache.head_stride,
            cache.token_stride, cache.piece_stride, block_ids, first_tokens,
            valid_tokens, out,
            out.stride(0), column, view.factor_base,
            KERNEL_BLOCKS=view.kernel_blocks_per_block,
            HEADS=view.num_heads,
            KERNEL_TOKENS=view.kernel_tokens,
            PIECES=cache.num_pieces,
            PIECES_PER_TOKEN=view.pieces_per_token,
            PIECE_OFFSET=cache.piece_offset,
            PIECE_BITS=view.piece_bits,
            CHUNK=chunk,
            TILE=tile,
        )
        launch_count += 1
