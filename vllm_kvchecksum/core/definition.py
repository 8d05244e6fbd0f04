"""The KV checksum definition: constants and small pure helpers.

A checksum covers one block position of one KV cache group over the
unsharded model. Each *slice* (one layer's one KV head in the block) is laid
out token by token, split into little-endian 8-byte pieces x_j, and summed
with odd weights; slices are combined with odd per-(layer, head) factors:

    c = sum_{layer, head} m(layer, head) * sum_j x_j * (2 * j + 1)  mod 2**64
    m(layer, head) = 2 * (layer * MAX_KV_HEADS_PER_LAYER + head) + 1

j counts pieces from the request's first token (j = t * P + p for piece p of
the token at request position t, P pieces per token), so block checksums add
up over consecutive blocks whatever the block size. docs/definition.md has the
full text and a worked example.

Attention KV always uses 8-byte pieces. A Mamba (SSM) state is checksummed
per *row* (a channel or head of the state, in place of a KV head, with its
global row number in place of the head in m) whose pieces are its elements,
read as unsigned 2- or 4-byte integers and zero-extended to 64 bits; with
one token per block, j is the element's index in its row.

Everything here is plain Python ints and numpy, shared by the PyTorch path,
the Triton kernel's launcher and the row builder, so they agree on one
definition. The independent test reference (tests/unit/reference.py) does not
import this module.
"""

from __future__ import annotations

import numpy as np

# A fixed bound on any layer's KV heads. Factors depend only on (layer,
# global head) through it, never on the model's head counts or its TP/PP
# split, so every rank of a producer and a consumer agrees on them.
MAX_KV_HEADS_PER_LAYER = 2**16

# Bytes of one piece. Attention KV is always checksummed in 8-byte pieces
# (PIECE_BYTES, PIECE_BITS: the defaults, and what pieces_per_cell counts).
# PIECE_BITS_SUPPORTED lists the piece widths the code paths implement: 16-
# and 32-bit pieces are the elements of a Mamba (SSM) state row (bf16/fp16,
# fp32), read as unsigned integers and zero-extended to 64 bits, so x_j is
# in [0, 2**16) or [0, 2**32) and the sums below are unchanged.
PIECE_BYTES = 8
PIECE_BITS = 8 * PIECE_BYTES
PIECE_BITS_SUPPORTED = (16, 32, 64)

MOD = 2**64
MASK64 = MOD - 1


def slice_factor(layer: int, head: int) -> int:
    """The odd factor m of the slice of (layer, global KV head), mod 2**64."""
    if layer < 0:
        raise ValueError(f"layer must be >= 0, got {layer}")
    if not 0 <= head < MAX_KV_HEADS_PER_LAYER:
        raise ValueError(
            f"KV head {head} is outside [0, {MAX_KV_HEADS_PER_LAYER}); "
            "layers with more KV heads cannot be checksummed")
    return (2 * (layer * MAX_KV_HEADS_PER_LAYER + head) + 1) & MASK64


def slice_factor_base(layer: int, first_head: int) -> int:
    """layer * H + first_head: the factor of local head h is 2 * (base + h) + 1.

    Passed to the Triton kernel as a run-time value, so one compiled variant
    serves every layer of a shape.
    """
    return layer * MAX_KV_HEADS_PER_LAYER + first_head


def piece_weight(j: int) -> int:
    """The weight 2 * j + 1 of piece j (counted from the request's start)."""
    return (2 * j + 1) & MASK64


def pieces_per_cell(cell_bytes: int) -> int:
    """Pieces in a cell of cell_bytes; raises if it is not whole pieces."""
    if cell_bytes <= 0 or cell_bytes % PIECE_BYTES:
        raise ValueError(
            f"a cell of {cell_bytes} bytes is not a whole number of "
            f"{PIECE_BYTES}-byte pieces")
    return cell_bytes // PIECE_BYTES


def to_int64(value: int) -> int:
    """Map an int mod 2**64 to the int64 with the same bits (two's complement)."""
    value &= MASK64
    return value - MOD if value >= 2**63 else value


def as_uint64(values) -> np.ndarray:
    """Reinterpret int64 values (array-like) as uint64 checksums, bit for bit."""
    return np.ascontiguousarray(np.asarray(values, dtype=np.int64)).view(np.uint64)


def block_first_token(position: int, block_size: int) -> int:
    """Request position of the first token of the block at `position`."""
    return position * block_size


def valid_token_slots(first_token: int, num_tokens: int, block_size: int) -> int:
    """Slots of a block starting at first_token that hold the request's tokens.

    Slots at or past num_tokens are excluded: later decode or draft tokens may
    write them, and the producer's value must not depend on when it is taken.
    """
    return max(0, min(block_size, num_tokens - first_token))
