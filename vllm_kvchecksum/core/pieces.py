"""What the checksum code paths read: a cache tensor as pieces, and a layer's geometry.

The shared vocabulary of LayerView (which builds and validates them) and the
kernels (which walk them), in a module below both: the kernels name these
types, never LayerView, and LayerView picks a kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch


@dataclass(frozen=True)
class CachePieces:
    """One cache tensor of a layer (K, V, or a combined cache) as pieces.

    pieces is a view of the tensor, never a copy, shaped like the tensor with
    the cell replaced by its pieces: [kernel_blocks, heads, tokens, P_t] for
    HND, [kernel_blocks, tokens, heads, P_t] for NHD. Within a token of a
    head, this tensor's pieces come at piece_offset (K before V). Its dtype
    is int64 for 64-bit pieces (then consecutive pieces are adjacent, and
    piece_stride is 1), int16 or int32 for 16- or 32-bit pieces, which are
    piece_stride elements apart (any stride).
    """

    pieces: torch.Tensor
    head_dim: int
    token_dim: int
    num_pieces: int
    piece_offset: int
    piece_stride: int = 1

    @property
    def block_stride(self) -> int:
        return self.pieces.stride(0)

    @property
    def head_stride(self) -> int:
        return self.pieces.stride(self.head_dim)

    @property
    def token_stride(self) -> int:
        return self.pieces.stride(self.token_dim)


class PieceGeometry(Protocol):
    """A layer's cache tensors as a code path walks them: [kernel block,
    head, token, piece], blocks of block_size tokens made of
    kernel_blocks_per_block kernel blocks (LayerView is the one there is)."""

    caches: Sequence[CachePieces]
    device: torch.device
    block_size: int
    kernel_tokens: int
    kernel_blocks_per_block: int
    num_blocks: int
    num_heads: int
    piece_bits: int
    pieces_per_token: int
    factor_base: int
