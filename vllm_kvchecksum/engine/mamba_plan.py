"""How a worker checksums one Mamba (SSM) layer's state, from its spec and page view.

A Mamba layer's cache is an int8 page view [blocks, 1, 1, bytes]: each
block's page packs the layer's states from its start (conv, ssm, then extra
states such as a ReplaySSM ring), then padding. The checksum covers the first
two states (or the only one): those are what NIXL transfers; extra states may
never be.

A layer whose spec describes its TP split (MambaSpec.state_splits, from the
layer itself) is checksummed TP-independently: each global row of its states
(a conv channel, a temporal head or channel) is one slice, numbered across the
layer's states in global order, and its pieces are the row's elements read as
unsigned 2- or 4-byte integers. A rank holds, of each segment (x, B, C; Q, K,
V; heads), the rows of its shard; segments every rank holds whole (Mamba2's B
and C with one group at TP > 1) are TP replicas, under the replica keys
attention uses for replicated heads. So the ranks' parts add up to the TP=1
checksum whatever the TP size or conv layout.

A layer without a described split keeps one slice per TP shard over its
covered bytes, as 8-byte pieces: its sums are comparable only between equal
TP sizes (`PlannedLayer.tp_local`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from math import prod

import torch

from vllm_kvchecksum.core.definition import MAX_KV_HEADS_PER_LAYER, PIECE_BYTES
from vllm_kvchecksum.core.layer_view import LayerView, PlannedCache

# The states a checksum covers, from the page's start.
COVERED_STATES = 2
# Element sizes read as pieces of their own width.
STATE_ELEMENT_BYTES = (2, 4)


@dataclass
class PlannedLayer:
    caches: list[PlannedCache]
    fingerprint: int
    tp_local: bool
    rows: int  # the global rows (slices) it numbers, from its first_row on


def fingerprint64(text: str) -> int:
    """The 64-bit hash layer fingerprints are made of (group_plan uses it too)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def covered_state_bytes(spec) -> list[int]:
    """Bytes of each covered state, in page order."""
    states = list(zip(spec.shapes, spec.dtypes))[:COVERED_STATES]
    return [prod(shape) * dtype.itemsize for shape, dtype in states]


def plan_state_layer(name: str, layer: int, spec, tensor: torch.Tensor, pos, num_blocks: int,
                     path: str = "auto", first_row: int = 0) -> PlannedLayer | str:
    """The views, fingerprint and TP dependence of one Mamba layer, or why it is skipped.

    first_row: the layer's first global row (slice) number; several layers
    of one module (same layer number) number their rows one after another.
    """
    if not spec.shapes or len(spec.shapes) != len(spec.dtypes):
        return f"its spec lists {len(spec.shapes)} state shapes and {len(spec.dtypes)} dtypes"
    if tensor.dtype != torch.int8 or tensor.dim() != 4 or tuple(tensor.shape[1:3]) != (1, 1):
        return (f"cache is {tensor.dtype} of shape {tuple(tensor.shape)}, not an int8 page view "
                "[blocks, 1, 1, bytes]")
    if tensor.shape[0] != num_blocks:
        return f"cache holds {tensor.shape[0]} blocks, not {num_blocks}"
    sizes = covered_state_bytes(spec)
    if tensor.shape[3] < sum(sizes):
        return f"its pages hold {tensor.shape[3]} bytes, its first {len(sizes)} states need {sum(sizes)}"
    splits = getattr(spec, "state_splits", None)
    if splits is None:
        return _plan_unsplit(name, layer, spec, tensor, pos, sum(sizes), path, first_row)
    return _plan_split(name, layer, spec, tensor[:, 0, 0, :], pos, sizes, splits, path, first_row)


def _plan_split(name, layer, spec, pages, pos, sizes, splits, path, first_row) -> PlannedLayer | str:
    if len(splits) < len(sizes):
        return f"state_splits describe {len(splits)} states, {len(sizes)} are checksummed"
    num_blocks = pages.shape[0]
    caches, described, row_base, offset = [], [], first_row, 0
    for i, (size, shape, dtype, split) in enumerate(zip(sizes, spec.shapes, spec.dtypes, splits)):
        elem = dtype.itemsize
        if elem not in STATE_ELEMENT_BYTES:
            return (f"state {i} has {elem}-byte elements ({dtype}); only 2- and 4-byte elements are "
                    "checksummed")
        axis, segments = split.axis, tuple(split.segments)
        if not 0 <= axis < len(shape):
            return f"state_splits[{i}].axis {axis} is outside its state shape {tuple(shape)}"
        if sum(local for local, _ in segments) != shape[axis] or any(
                local <= 0 or replicas < 1 or pos.tp_size % replicas for local, replicas in segments):
            return (f"state_splits[{i}] segments {segments} do not match state shape {tuple(shape)} "
                    f"along axis {axis} at TP size {pos.tp_size}")
        try:
            state = pages[:, offset:offset + size].view(dtype).view(num_blocks, *shape)
            rows = state.movedim(axis + 1, 1).view(num_blocks, shape[axis], -1)
        except RuntimeError as exc:  # a view would need a copy
            return f"state {i} cannot be viewed as rows without a copy: {exc}"
        global_start, local_start = 0, 0
        for local, replicas in segments:
            first = row_base + global_start + (pos.tp_rank // replicas) * local
            try:
                view = LayerView(rows[:, local_start:local_start + local].unsqueeze(2), block_size=1, layer=layer,
                                 first_head=first, layout="HND", path=path, piece_bits=8 * elem)
            except ValueError as exc:
                return f"state {i}: {exc}"
            caches.append(PlannedCache(name, layer, first, replicas, pos.tp_rank % replicas, view))
            global_start += local * (pos.tp_size // replicas)
            local_start += local
        global_sizes = [local * (pos.tp_size // replicas) for local, replicas in segments]
        others = [d for k, d in enumerate(shape) if k != axis]
        described.append(f"{global_sizes}:{others}:{dtype}")
        row_base += global_start
        offset += size
    if row_base > MAX_KV_HEADS_PER_LAYER:
        return (f"its states' rows end at {row_base}, past MAX_KV_HEADS_PER_LAYER={MAX_KV_HEADS_PER_LAYER} "
                "(with the layers numbered before it in its module)")
    text = "\0".join([name, "MambaState", *described])
    return PlannedLayer(caches, fingerprint64(text), tp_local=False, rows=row_base - first_row)


def _plan_unsplit(name, layer, spec, tensor, pos, covered, path, first_row) -> PlannedLayer | str:
    if covered % PIECE_BYTES:
        return (f"its states' {covered} bytes are not whole {PIECE_BYTES}-byte pieces (and its layer does not "
                "describe a TP split: MambaBase.get_state_splits)")
    replicated = bool(getattr(spec, "tp_replicated", False))
    replicas = pos.tp_size if replicated else 1
    first = first_row + (0 if replicated else pos.tp_rank)
    try:
        view = LayerView(tensor[:, :, :, :covered], block_size=1, layer=layer, first_head=first, layout="HND",
                         path=path)
    except ValueError as exc:
        return str(exc)
    states = list(zip(spec.shapes, spec.dtypes))[:COVERED_STATES]
    text = "\0".join([name, "MambaLocal", *(f"{list(shape)}:{dtype}" for shape, dtype in states)])
    cache = PlannedCache(name, layer, first, replicas, pos.tp_rank % replicas, view)
    return PlannedLayer([cache], fingerprint64(text), tp_local=not replicated, rows=1 if replicated else pos.tp_size)
