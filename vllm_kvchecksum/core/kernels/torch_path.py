"""The PyTorch path of LayerView.accumulate: CPU, fallback, and reference.

It serves CPU caches (tests, CPU workers) and devices without Triton, and is
the implementation the Triton kernel is checked against bit for bit.

How it avoids multiplying every piece by its weight. For a block starting
at request token t0, with l = tau * P + o + p the block-local index of piece
p (of a cache tensor whose pieces start at offset o in the token) of token
tau of head h:

    sum_l x_l * m_h * (2 * (t0 * P + l) + 1)
      = m_h * [ sum_tau 2 P tau Z[h, tau] + sum_p (2 (o + p) + 1) Y[h, p]
                + 2 P t0 * sum_p Y[h, p] ]

with Z[h, tau] = sum_p x (the pieces of a token) and Y[h, p] = sum_tau x
(each piece column over the block's tokens). So each gathered block is read
by two plain integer sums, which run near memory speed, and the remaining
weighted sums act on Z and Y, which are 1/P and 1/tokens the size of the
data. The weight tables depend on the layer, never on the block's position:
the block start enters only through t0. All arithmetic is int64, whose
wrap-around is the definition's mod 2**64.

16- and 32-bit pieces (Mamba state rows: a view's elements, int16/int32, at
any stride) are gathered in their own dtype and zero-extended to int64
(`& 0xFFFF` / `& 0xFFFFFFFF` after the widening, which sign-extends) before
the two sums; 64-bit pieces are summed as gathered.

Rows are gathered in chunks, so transient memory stays bounded
(GATHER_CHUNK_BYTES), and on CPU chunks are kept cache-sized
(CPU_CHUNK_BYTES) so the two sums read the gathered data from cache. On CPU
the few partial blocks (one per request at most) are masked separately;
on other devices every row is masked, which keeps the path free of host
syncs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from vllm_kvchecksum.core.pieces import CachePieces, PieceGeometry

# Upper bound on the KV gathered at once, per cache tensor, on any device.
# Read at call time, so tests can shrink it.
GATHER_CHUNK_BYTES = 64 << 20
# On CPU, a chunk this size stays in the last-level cache between the
# gather and the two sums. On the 2-core EPYC this was tuned on (32 MB L3),
# 4-8 MB read 10.7-11.2 GB/s, 1 MB 8.9 (per-op overhead), 16 MB 9.6 (out
# of cache).
CPU_CHUNK_BYTES = 8 << 20


def _u64(values) -> np.ndarray:
    return np.asarray(values, dtype=np.uint64)


class _CacheSums:
    """The weight tables of one cache tensor of a layer, in its memory order."""

    def __init__(self, cache: "CachePieces", view: "PieceGeometry"):
        kb = view.kernel_blocks_per_block
        kt = view.kernel_tokens
        heads = view.num_heads
        p_total = view.pieces_per_token
        pk = cache.num_pieces
        self.row_elems = kb * heads * kt * pk
        # 16/32-bit pieces: the mask that zero-extends them once widened.
        bits = view.piece_bits
        self.zext_mask = None if bits == 64 else (1 << bits) - 1
        # The token dim of a gathered chunk [rows, kb, d1, d2, pieces].
        self.token_gdim = cache.token_dim + 1
        # [logical blocks, kb, d1, d2, pieces], still a view of the cache.
        self.blocked = cache.pieces.unflatten(0, (view.num_blocks, kb))

        with np.errstate(over="ignore"):
            factors = 2 * (_u64(view.factor_base) + np.arange(heads, dtype=np.uint64)) + 1
            tau = (np.arange(kb, dtype=np.uint64)[:, None] * kt +
                   np.arange(kt, dtype=np.uint64)[None, :])  # [kb, kt]
            # Weight of Z[kb, head, token] (HND order; transposed for NHD).
            wz = factors[None, :, None] * (_u64(2 * p_total) * tau)[:, None, :]
            if cache.head_dim == 2:
                wz = wz.transpose(0, 2, 1)
            pieces = np.arange(pk, dtype=np.uint64) + _u64(cache.piece_offset)
            wy = factors[:, None] * (2 * pieces + 1)[None, :]  # [heads, pk]
        device = view.device
        self.wz = torch.from_numpy(np.ascontiguousarray(wz).reshape(-1).view(np.int64)).to(device)
        self.wy = torch.from_numpy(np.ascontiguousarray(wy).reshape(-1).view(np.int64)).to(device)
        self.factors = torch.from_numpy(factors.view(np.int64)).to(device)
        # Token index of each (kb, d1, d2) position with 1 on the head dim,
        # for masking slots at or past a row's valid count.
        tau_shape = [kb, 1, 1]
        tau_shape[cache.token_dim] = kt
        self.tau = torch.from_numpy(tau.view(np.int64).reshape(tau_shape)).to(device)
        self.block_start_scale = 2 * p_total

    def gather(self, block_ids: torch.Tensor, buf: torch.Tensor,
               first_of_run: int | None = None) -> torch.Tensor:
        """The rows' blocks, [rows, kb, d1, d2, pieces]: a view of the cache
        when they are the consecutive blocks from first_of_run, else copied
        into buf."""
        n = block_ids.shape[0]
        if first_of_run is not None:
            return self.blocked[first_of_run:first_of_run + n]
        shape = (n, *self.blocked.shape[1:])
        return torch.index_select(self.blocked, 0, block_ids,
                                  out=buf[:n * self.row_elems].view(shape))

    def row_sums(self, gathered: torch.Tensor, first_tokens: torch.Tensor,
                 valid_tokens: torch.Tensor | None) -> torch.Tensor:
        """This tensor's contribution to each gathered row (int64 [rows])."""
        n = gathered.shape[0]
        if self.zext_mask is not None:
            gathered = gathered.to(torch.int64)
            gathered.bitwise_and_(self.zext_mask)
        if valid_tokens is not None:
            mask = self.tau.unsqueeze(0) < valid_tokens.view(n, 1, 1, 1)
            gathered = gathered * mask.unsqueeze(-1)
        z = gathered.sum(dim=-1)  # [rows, kb, d1, d2]
        y = gathered.sum(dim=(1, self.token_gdim))  # [rows, heads, pieces]
        within = torch.mv(z.view(n, -1), self.wz) + torch.mv(y.view(n, -1), self.wy)
        totals = torch.mv(y.sum(dim=-1), self.factors)
        return within + (first_tokens * self.block_start_scale) * totals


def _consecutive_run(block_ids: torch.Tensor) -> int | None:
    """The first id if the (host) ids are consecutive ascending, else None.

    Freshly allocated blocks often are; their chunk is then summed in place,
    which saves the gather's copy.
    """
    n = block_ids.shape[0]
    first = int(block_ids[0])
    if int(block_ids[-1]) - first != n - 1:
        return None
    if n > 2 and not bool((block_ids[1:] - block_ids[:-1] == 1).all()):
        return None
    return first


class TorchLayerPath:
    """LayerView.accumulate in PyTorch; built on a view's first use."""

    def __init__(self, view: "PieceGeometry"):
        self.view = view
        self.caches = [_CacheSums(c, view) for c in view.caches]
        # Pieces are summed as int64 (narrower ones once widened), so a
        # row's transient bytes are 8 per piece whatever the width.
        self.max_row_bytes = max(c.row_elems for c in self.caches) * 8
        self.buf_dtype = view.caches[0].pieces.dtype

    def _rows_per_chunk(self) -> int:
        limit = GATHER_CHUNK_BYTES
        if self.view.device.type == "cpu":
            limit = min(limit, CPU_CHUNK_BYTES)
        return max(1, limit // self.max_row_bytes)

    def accumulate(self, out: torch.Tensor, column: int,
                   block_ids: torch.Tensor, first_tokens: torch.Tensor,
                   valid_tokens: torch.Tensor) -> None:
        view = self.view
        rows = out.shape[0]
        per_chunk = self._rows_per_chunk()
        n_buf = min(rows, per_chunk) * max(c.row_elems for c in self.caches)
        buf = torch.empty(n_buf, dtype=self.buf_dtype, device=view.device)
        sums = torch.zeros(rows, dtype=torch.int64, device=view.device)

        on_host = view.device.type == "cpu"
        if on_host:
            # Host tensors: split full blocks from partial ones, skip empty.
            full = torch.nonzero(valid_tokens >= view.block_size).view(-1)
            partial = torch.nonzero((valid_tokens > 0) &
                                    (valid_tokens < view.block_size)).view(-1)
            batches = [(full, False), (partial, True)]
        else:
            # Device tensors: no host sync, so mask every row, and read
            # block 0 for empty rows rather than whatever id they carry.
            every = torch.arange(rows, device=view.device)
            batches = [(every, True)]
            block_ids = torch.where(valid_tokens > 0, block_ids, 0)

        for row_index, masked in batches:
            for start in range(0, row_index.shape[0], per_chunk):
                idx = row_index[start:start + per_chunk]
                ids = block_ids[idx]
                t0 = first_tokens[idx]
                valid = valid_tokens[idx] if masked else None
                run = _consecutive_run(ids) if on_host else None
                for cache in self.caches:
                    gathered = cache.gather(ids, buf, run)
                    sums.index_add_(0, idx, cache.row_sums(gathered, t0, valid))
        out[:, column] += sums

