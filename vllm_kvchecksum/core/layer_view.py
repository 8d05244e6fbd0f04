"""LayerView: one layer's KV cache seen as pieces, ready to checksum.

The worker builds one LayerView per layer of every checksummed KV cache
group at startup, and calls accumulate() in the steps where requests finish
their prefill (producer) or their load (consumer). The public
layer_block_checksums() uses the same class, so a user debugging a transfer
gets exactly the values the worker computes.

A view never copies the cache: it keeps an int64 view of each cache tensor
in its own memory order, plus the strides the code paths need to walk it as
[kernel block, head, token, piece].

Attention KV is read in 8-byte pieces (piece_bits=64). A Mamba (SSM) state
segment is read with piece_bits=16 or 32: the caller passes a view
[blocks, rows, 1, elements] (HND, block_size=1) whose elements are 2- or
4-byte (bf16/fp16, fp32, ...); each element is one piece, read unsigned and
zero-extended to 64 bits by the code paths, and the element dimension may
have any stride (a (len, dim) conv state read per channel). The view keeps
an int16/int32 view of the tensor then, and the pieces' stride.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from vllm_kvchecksum.core.definition import (MAX_KV_HEADS_PER_LAYER, PIECE_BITS,
                                             PIECE_BITS_SUPPORTED, slice_factor_base)
from vllm_kvchecksum.core.pieces import CachePieces

LAYOUTS = ("HND", "NHD")
PATHS = ("auto", "torch", "triton", "numba")

# Layers are numbered from their names; the bound keeps layer * H + head,
# which the kernel takes as a run-time integer, far from int64 overflow.
MAX_LAYER = 2**32


_NARROW_PIECES = {16: torch.int16, 32: torch.int32}


def _as_pieces(cache: torch.Tensor, name: str, piece_bits: int) -> torch.Tensor:
    """Reinterpret a 4-D cache's cells as pieces of piece_bits, without a copy:
    int64 pieces of whole cells for 64, the elements themselves as int16 or
    int32 (any strides) for 16 and 32."""
    if cache.dim() != 4:
        raise ValueError(
            f"{name} must be 4-D ([kernel_blocks, heads, tokens, cell] or "
            f"[kernel_blocks, tokens, heads, cell]), got shape "
            f"{tuple(cache.shape)}")
    piece_bytes = piece_bits // 8
    if piece_bits in _NARROW_PIECES:
        # One element is one piece, so no piece can straddle anything:
        # strides and the storage offset may be anything.
        if cache.element_size() != piece_bytes:
            raise ValueError(
                f"{name} is {cache.dtype} ({cache.element_size()}-byte "
                f"elements), but piece_bits={piece_bits} reads each element "
                f"as one {piece_bytes}-byte piece; pass a tensor of "
                f"{piece_bytes}-byte elements")
        return cache.view(_NARROW_PIECES[piece_bits])
    elem = cache.element_size()
    cell_bytes = cache.shape[-1] * elem
    if cell_bytes % piece_bytes:
        raise ValueError(
            f"{name} has cells of {cell_bytes} bytes ({cache.shape[-1]} x "
            f"{cache.dtype}), not a multiple of {piece_bytes}-byte pieces; "
            "such caches cannot be checksummed")
    if cache.shape[-1] > 1 and cache.stride(-1) != 1:
        raise ValueError(
            f"{name}'s cell dimension is not contiguous (stride "
            f"{cache.stride(-1)} elements); pass a view whose last dimension "
            "is contiguous")
    for dim in range(3):
        if (cache.stride(dim) * elem) % piece_bytes:
            raise ValueError(
                f"{name}'s stride of dimension {dim} is "
                f"{cache.stride(dim) * elem} bytes, not a multiple of "
                f"{piece_bytes}; pieces would straddle cells")
    if cache.data_ptr() % piece_bytes:
        raise ValueError(
            f"{name} does not start on a {piece_bytes}-byte boundary "
            "(storage offset); pieces would straddle cells")
    try:
        return cache.view(torch.int64)
    except RuntimeError as exc:  # shapes torch cannot reinterpret
        raise ValueError(f"{name} cannot be viewed as int64 pieces: {exc}") from exc


class LayerView:
    """One layer's KV cache, checksummed per logical block.

    caches: the layer's cache tensors, [K, V] or [combined], each 4-D in
      `layout` ("HND": [kernel_blocks, heads, tokens, cell], "NHD":
      [kernel_blocks, tokens, heads, cell]), any dtype and strides. Cells
      must be whole 8-byte pieces (with piece_bits=64). For each token of a
      head, the pieces of caches[0]'s cell come before those of caches[1]'s.
    block_size: tokens per logical block. The cache's token dimension may be
      a kernel block size that divides it: logical block b is kernel blocks
      b*KB .. b*KB+KB-1, KB = block_size / kernel_tokens.
    layer: the layer number (from the layer's name).
    first_head: the global index of this rank's first KV head; the rank
      holds heads first_head .. first_head + heads - 1.
    path: "auto" (Triton on CUDA when it imports, the Numba pass on CPU
      when numba imports and the pass runs (kernels.numba_available), else
      PyTorch; a Numba pass that raises gives way to PyTorch, see
      _accumulate_compiled), "torch", "numba" (CPU tensors
      only) or "triton" (forcing one is for tests and benchmarks; on CPU
      tensors the kernel runs only under TRITON_INTERPRET=1). The chosen
      path is the `path` attribute, which may also be reassigned.
    piece_bits: the piece width. 64 (the default, and always for attention
      KV): cells are split into little-endian 8-byte pieces, so the cell
      dimension must be contiguous and cells 8-byte aligned. 16 or 32 (Mamba
      state rows): each element of the cell dimension is one piece, read as
      an unsigned integer; the tensor's element size must be piece_bits / 8
      (bf16/fp16/int16 for 16, fp32/int32 for 32), and any strides and
      storage offset are accepted. A state segment is passed as
      [blocks, rows, 1, elements] with layout="HND", block_size=1 and
      first_head = the segment's first global row.
    """

    def __init__(self,
                 caches: Sequence[torch.Tensor] | torch.Tensor,
                 *,
                 block_size: int,
                 layer: int,
                 first_head: int = 0,
                 layout: str = "HND",
                 path: str = "auto",
                 piece_bits: int = PIECE_BITS):
        if isinstance(caches, torch.Tensor):
            caches = [caches]
        caches = list(caches)
        if not 1 <= len(caches) <= 2:
            raise ValueError(
                f"a layer has 1 (combined) or 2 (K, V) cache tensors, got "
                f"{len(caches)}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {path!r}")
        if piece_bits not in PIECE_BITS_SUPPORTED:
            raise ValueError(
                f"piece_bits={piece_bits} is not implemented; supported: "
                f"{PIECE_BITS_SUPPORTED}")
        if not 0 <= layer < MAX_LAYER:
            raise ValueError(f"layer must be in [0, {MAX_LAYER}), got {layer}")

        names = ["cache"] if len(caches) == 1 else ["K cache", "V cache"]
        head_dim, token_dim = (1, 2) if layout == "HND" else (2, 1)
        pieces = [_as_pieces(c, n, piece_bits) for c, n in zip(caches, names)]
        shape0 = tuple(pieces[0].shape[:3])
        for c, p, n in zip(caches, pieces, names):
            if tuple(p.shape[:3]) != shape0:
                raise ValueError(
                    f"{n} has {tuple(p.shape[:3])} (kernel blocks, "
                    f"{'heads, tokens' if layout == 'HND' else 'tokens, heads'}"
                    f"), but {names[0]} has {shape0}; a layer's caches must "
                    "agree on them")
            if c.device != caches[0].device:
                raise ValueError(
                    f"{n} is on {c.device}, {names[0]} on {caches[0].device}")

        kernel_blocks = shape0[0]
        heads = shape0[head_dim]
        kernel_tokens = shape0[token_dim]
        if block_size <= 0 or kernel_tokens <= 0 or block_size % kernel_tokens:
            raise ValueError(
                f"kernel blocks of {kernel_tokens} tokens do not tile the "
                f"block size {block_size}")
        per_block = block_size // kernel_tokens
        if kernel_blocks % per_block:
            raise ValueError(
                f"{kernel_blocks} kernel blocks of {kernel_tokens} tokens are "
                f"not a whole number of {block_size}-token blocks")
        if first_head < 0 or first_head + heads > MAX_KV_HEADS_PER_LAYER:
            raise ValueError(
                f"heads {first_head}..{first_head + heads - 1} exceed "
                f"MAX_KV_HEADS_PER_LAYER={MAX_KV_HEADS_PER_LAYER}; such layers "
                "cannot be checksummed")

        self.layout = layout
        self.layer = layer
        self.first_head = first_head
        self.block_size = block_size
        self.kernel_tokens = kernel_tokens
        self.kernel_blocks_per_block = per_block
        self.num_blocks = kernel_blocks // per_block
        self.num_heads = heads
        self.piece_bits = piece_bits
        self.device = caches[0].device
        offset = 0
        self.caches: list[CachePieces] = []
        for p in pieces:
            piece_stride = 1 if piece_bits == 64 else p.stride(-1)
            self.caches.append(CachePieces(p, head_dim, token_dim, p.shape[-1],
                                           offset, piece_stride))
            offset += p.shape[-1]
        self.pieces_per_token = offset
        self.factor_base = slice_factor_base(layer, first_head)
        self.path = self._choose_path(path)
        self._path_impl = None  # set up on first use, for the path then chosen
        self._path_impl_for = None

    def _choose_path(self, path: str) -> str:
        from vllm_kvchecksum.core import kernels
        if path == "auto":
            if self.device.type == "cuda" and kernels.triton_available():
                return "triton"
            if self.device.type == "cpu" and kernels.numba_available():
                return "numba"
            return "torch"
        if path == "triton" and not kernels.triton_available():
            raise ValueError("path='triton' was forced but triton does not import")
        if path == "numba":
            if not kernels.numba_available():
                raise ValueError("path='numba' was forced but numba does not import, or the compiled "
                                 "pass cannot run here (see the warning logged)")
            if self.device.type != "cpu":
                raise ValueError(
                    f"path='numba' reads host memory; the cache is on {self.device}")
        return path

    @property
    def block_bytes(self) -> int:
        """Bytes of KV one logical block holds in this layer (this rank's heads)."""
        return (self.kernel_blocks_per_block * self.num_heads *
                self.kernel_tokens * self.pieces_per_token * self.piece_bits // 8)

    def accumulate(self, out: torch.Tensor, column: int,
                   block_ids: torch.Tensor, first_tokens: torch.Tensor,
                   valid_tokens: torch.Tensor) -> None:
        """Add this layer's contribution for each row into out[:, column].

        out: int64 [rows, cols] on the cache's device; additions wrap mod
          2**64 like the definition.
        block_ids: int64 [rows], logical block ids (< num_blocks).
        first_tokens: int64 [rows], the request position of each block's
          first token.
        valid_tokens: int64 [rows], token slots of each block to include
          (0 .. block_size); rows with 0 add 0, and their block id is not
          read.
        Runs without a host sync when the tensors are on the device.
        """
        self._check_rows(out, column, block_ids, first_tokens, valid_tokens)
        if out.shape[0] == 0:
            return
        if self.path == "triton":
            from vllm_kvchecksum.core.kernels import triton_kernel
            triton_kernel.accumulate(self, out, column, block_ids,
                                     first_tokens, valid_tokens)
        else:
            if self.path == "numba" and self.device.type == "cpu" and self._accumulate_compiled(
                    out, column, block_ids, first_tokens, valid_tokens):
                return
            if self._path_impl_for != self.path:
                self._path_impl = self._make_path_impl()
                self._path_impl_for = self.path
            self._path_impl.accumulate(out, column, block_ids, first_tokens,
                                       valid_tokens)

    def _accumulate_compiled(self, out, column, block_ids, first_tokens,
                             valid_tokens) -> bool:
        """Run the Numba pass, which never stops the caller: True if it ran.
        If it raises (anything but a bad block id, the caller's error), out
        is put back as it was, and this view and every later one take the
        PyTorch path (kernels.switch_numba_off, one warning): False, and
        the caller computes this call there."""
        from vllm_kvchecksum.core import kernels
        if kernels.numba_switched_off() is None:
            before = out[:, column].clone()
            try:
                if self._path_impl_for != "numba":
                    self._path_impl = self._make_path_impl()
                    self._path_impl_for = "numba"
                self._path_impl.accumulate(out, column, block_ids, first_tokens,
                                           valid_tokens)
                return True
            except kernels.BlockIdOutOfRange:
                raise
            except Exception as exc:
                out[:, column] = before
                kernels.switch_numba_off(exc)
        self.path = "torch"
        return False

    def _make_path_impl(self):
        if self.path == "numba":
            from vllm_kvchecksum.core.kernels.numba_path import NumbaLayerPath
            return NumbaLayerPath(self)
        from vllm_kvchecksum.core.kernels.torch_path import TorchLayerPath
        return TorchLayerPath(self)

    def warm_up(self) -> None:
        """Compile the path's code for this layer with one all-masked row.

        Runs at startup so Triton's compilation (per shape) does not land
        in the first step that checksums; a no-op on the CPU paths (the
        Numba pass is compiled, or loaded from its disk cache, when a view
        first chooses it, at worker start too).
        """
        if self.path != "triton":
            return
        out = torch.zeros(1, 1, dtype=torch.int64, device=self.device)
        rows = torch.zeros(3, 2, dtype=torch.int64, device=self.device)
        self.accumulate(out, 0, rows[0, :1], rows[1, :1], rows[2, :1])

    def _check_rows(self, out, column, block_ids, first_tokens,
                    valid_tokens) -> None:
        if out.dtype != torch.int64 or out.dim() != 2:
            raise ValueError(
                f"out must be an int64 [rows, cols] tensor, got {out.dtype} "
                f"of shape {tuple(out.shape)}")
        if out.device != self.device:
            raise ValueError(
                f"out is on {out.device}, the cache on {self.device}")
        if out.shape[0] > 1 and out.stride(0) == 0:
            raise ValueError(
                "out's rows share memory (row stride 0, e.g. from expand()); pass a tensor "
                "with one row per block")
        if not 0 <= column < out.shape[1]:
            raise ValueError(
                f"column {column} is outside out's {out.shape[1]} columns")
        for name, t in (("block_ids", block_ids), ("first_tokens", first_tokens),
                        ("valid_tokens", valid_tokens)):
            if t.dtype != torch.int64 or t.dim() != 1:
                raise ValueError(f"{name} must be a 1-D int64 tensor")
            if t.shape[0] != out.shape[0]:
                raise ValueError(
                    f"{name} has {t.shape[0]} rows, out has {out.shape[0]}")
            if t.device != self.device:
                raise ValueError(
                    f"{name} is on {t.device}, the cache on {self.device}")


@dataclass
class PlannedCache:
    """One cache tensor of a layer as a worker checksums it: its view, and
    which TP replica of its heads (or state slices) this rank holds."""
    name: str
    layer: int
    first_head: int
    replicas: int
    replica_index: int
    view: LayerView

    @property
    def key(self) -> tuple[int, int]:
        return (self.replicas, self.replica_index)
