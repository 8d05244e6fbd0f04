"""Build the per-block rows that LayerView.accumulate takes, for many requests.

Each step that checksums, the worker turns every request's blocks (per KV
cache group) into rows: the block id, the request position of its first
token, and its number of valid token slots. This module does that with
numpy, vectorized across requests, and packs every group's rows into ONE
int64 host array [3, total_rows] (pinned when CUDA is available), so one
non-blocking host-to-device copy serves the whole call.

Each group starts at an even row, padded with an all-masked row (block 0,
0 valid tokens): the slices of the device array that the kernel reads then
stay 16-byte aligned, like the ones LayerView.warm_up compiles for, and
Triton does not compile another variant while serving.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np
import torch

BLOCK_IDS, FIRST_TOKENS, VALID_TOKENS = 0, 1, 2


class RequestBlocks(NamedTuple):
    """The blocks of one request in one KV cache group to checksum.

    block_ids: the listed blocks' ids, in request order.
    first_block_position: the request block position of block_ids[0]
      (e.g. the first block a consumer loaded after a local prefix hit).
    num_tokens: the request's token count; slots at or past it are excluded.
    """

    block_ids: Sequence[int] | np.ndarray
    first_block_position: int
    num_tokens: int


@dataclass
class BlockRows:
    """Rows of every group, packed for one host-to-device copy.

    table: int64 [3, total_rows] host tensor (rows: block ids, first tokens,
      valid tokens); pinned when CUDA is available.
    groups: per group, (row_start, row_count); row_start is even.
    requests: per group, per request, (row_start, row_count) in table.
    """

    table: torch.Tensor
    groups: list[tuple[int, int]]
    requests: list[list[tuple[int, int]]]

    def to_device(self, device: torch.device | str) -> torch.Tensor:
        """The table on device, by one non-blocking copy (from pinned memory)."""
        return self.table.to(device, non_blocking=True)

    def group_rows(self, table: torch.Tensor, group: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(block_ids, first_tokens, valid_tokens) of one group, as views of
        table (this host table or its device copy)."""
        start, count = self.groups[group]
        rows = table[:, start:start + count]
        return rows[BLOCK_IDS], rows[FIRST_TOKENS], rows[VALID_TOKENS]


def _clip_valid(valid: np.ndarray, block_size: int) -> None:
    # Two ufuncs: np.clip's Python-level dispatch costs more than the work
    # for the few rows of a typical call.
    np.minimum(valid, block_size, out=valid)
    np.maximum(valid, 0, out=valid)


def _fill_request(dest: np.ndarray, request: RequestBlocks,
                  block_size: int) -> None:
    """Write one request's rows into dest [3, n] (fewer numpy calls than the
    general path: a prefill step usually checksums one request)."""
    block_ids, first_position, num_tokens = request
    dest[BLOCK_IDS] = block_ids
    first_tokens = dest[FIRST_TOKENS]
    first_tokens[:] = np.arange(first_position * block_size,
                                (first_position + dest.shape[1]) * block_size,
                                block_size)
    _clip_valid(np.subtract(num_tokens, first_tokens, out=dest[VALID_TOKENS]),
                block_size)


def _fill_group(dest: np.ndarray, requests: Sequence[RequestBlocks],
                block_size: int) -> np.ndarray:
    """Write one group's rows into dest [3, n]; returns request row starts."""
    if len(requests) == 1:
        _fill_request(dest, requests[0], block_size)
        return np.zeros(1, dtype=np.int64)
    ids_list = [r[0] for r in requests]
    lengths = np.fromiter((len(b) for b in ids_list), dtype=np.int64,
                          count=len(ids_list))
    firsts = np.fromiter((r[1] for r in requests), dtype=np.int64,
                         count=len(requests))
    num_tokens = np.fromiter((r[2] for r in requests), dtype=np.int64,
                             count=len(requests))
    starts = np.cumsum(lengths) - lengths
    n = dest.shape[1]
    # Straight into the table: converting each request's list in place is
    # as fast as any concatenation and saves a copy.
    block_ids = dest[BLOCK_IDS]
    for ids, start, length in zip(ids_list, starts.tolist(), lengths.tolist()):
        block_ids[start:start + length] = ids
    # Row i of request r sits at block position firsts[r] + (i - starts[r]).
    first_tokens = dest[FIRST_TOKENS]
    np.subtract(np.arange(n, dtype=np.int64),
                np.repeat(starts - firsts, lengths), out=first_tokens)
    first_tokens *= block_size
    valid = dest[VALID_TOKENS]
    np.subtract(np.repeat(num_tokens, lengths), first_tokens, out=valid)
    _clip_valid(valid, block_size)
    return starts


def build_rows(groups: Sequence[Sequence[RequestBlocks]],
               block_sizes: int | Sequence[int],
               *,
               pin_memory: bool | None = None) -> BlockRows:
    """Rows for the requests of several KV cache groups, in one host array.

    groups: per group, the requests' RequestBlocks (or equal 3-tuples).
    block_sizes: the block size of every group, or one per group.
    pin_memory: pin the table; default: when CUDA is available.
    """
    if isinstance(block_sizes, int):
        block_sizes = [block_sizes] * len(groups)
    if len(block_sizes) != len(groups):
        raise ValueError(
            f"{len(block_sizes)} block sizes given for {len(groups)} groups")
    counts = [sum(len(r[0]) for r in reqs) for reqs in groups]
    starts, total = [], 0
    for count in counts:
        starts.append(total)
        total += count + (count & 1)  # the next group starts on an even row
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    table = torch.empty((3, total), dtype=torch.int64, pin_memory=pin_memory)
    host = table.numpy()
    request_rows = []
    for reqs, start, count, block_size in zip(groups, starts, counts, block_sizes):
        req_starts = _fill_group(host[:, start:start + count], reqs, block_size)
        request_rows.append([(start + int(s), len(r[0]))
                             for s, r in zip(req_starts.tolist(), reqs)])
        if count & 1:
            host[:, start + count] = 0  # padding: block 0, nothing valid
    return BlockRows(table, list(zip(starts, counts)), request_rows)
