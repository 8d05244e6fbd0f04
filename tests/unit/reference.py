"""An independent NumPy/Python implementation of the KV checksum definition.

It shares no code with vllm_kvchecksum: it walks the cache's raw bytes
block by block, head by head, token by token, builds each slice's bytes
explicitly (K cell then V cell for every token), splits them into
little-endian 8-byte pieces with np.frombuffer, and sums with Python ints
mod 2**64. Slow on purpose; tests use small shapes.
"""

from __future__ import annotations

import numpy as np
import torch

H = 2**16
MOD = 2**64


def raw_bytes(cache) -> np.ndarray:
    """A cache (torch tensor of any dtype, or numpy array) as uint8
    [d0, d1, d2, cell_bytes], in logical (not memory) order."""
    if isinstance(cache, torch.Tensor):
        t = cache.detach().cpu().contiguous()
        return t.view(torch.uint8).numpy().reshape(*t.shape[:3], -1)
    a = np.ascontiguousarray(cache)
    return a.view(np.uint8).reshape(*a.shape[:3], -1)


def factor(layer: int, head: int) -> int:
    return 2 * (layer * H + head) + 1


def slice_checksum(slice_bytes: bytes, first_piece: int) -> int:
    """sum_j x_j * (2 j + 1) mod 2**64, j counted from first_piece."""
    x = np.frombuffer(slice_bytes, dtype="<u8")
    total = 0
    for i, v in enumerate(x.tolist()):
        total += int(v) * (2 * (first_piece + i) + 1)
    return total % MOD


def layer_checksums(caches, block_ids, num_tokens, *, first_block_position=0,
                    layer=0, first_head=0, layout="HND", block_size=None):
    """One layer's contribution to each listed block's checksum (Python ints)."""
    if not isinstance(caches, (list, tuple)):
        caches = [caches]
    arrays = [raw_bytes(c) for c in caches]
    if layout == "HND":
        kernel_blocks, heads, kernel_tokens = arrays[0].shape[:3]
        cell = lambda a, kb, h, t: a[kb, h, t].tobytes()  # noqa: E731
    else:
        kernel_blocks, kernel_tokens, heads = arrays[0].shape[:3]
        cell = lambda a, kb, h, t: a[kb, t, h].tobytes()  # noqa: E731
    block_size = block_size or kernel_tokens
    per_block = block_size // kernel_tokens
    token_bytes = sum(a.shape[3] for a in arrays)
    assert token_bytes % 8 == 0
    pieces_per_token = token_bytes // 8

    values = []
    for i, block in enumerate(block_ids):
        first_token = (first_block_position + i) * block_size
        valid = max(0, min(block_size, num_tokens - first_token))
        value = 0
        for h in range(heads):
            chunks = []
            for tau in range(valid):
                kb = block * per_block + tau // kernel_tokens
                t = tau % kernel_tokens
                for a in arrays:  # K's cell, then V's
                    chunks.append(cell(a, kb, h, t))
            s = slice_checksum(b"".join(chunks), first_token * pieces_per_token)
            value += factor(layer, first_head + h) * s
        values.append(value % MOD)
    return values


def model_checksums(layers, block_ids, num_tokens, **kwargs):
    """Sum of layer_checksums over (layer number, caches) pairs."""
    total = [0] * len(block_ids)
    for layer, caches in layers:
        vals = layer_checksums(caches, block_ids, num_tokens, layer=layer, **kwargs)
        total = [(a + b) % MOD for a, b in zip(total, vals)]
    return total


def state_checksum(layer: int, rows) -> int:
    """One block of a Mamba (SSM) state: sum over its rows of
    m(layer, global_row) * sum_j zext(x_j) * (2 j + 1) mod 2**64.

    rows: (global_row, elements) pairs, elements a 1-D NumPy array of a 2- or
    4-byte dtype (any, signed or float; views of bf16 as int16 or uint16 are
    fine) in the row's element order. Each element's bytes are read as a
    little-endian unsigned integer, so it is zero-extended whatever its dtype.
    """
    total = 0
    for row, elements in rows:
        a = np.asarray(elements)
        assert a.ndim == 1 and a.dtype.itemsize in (2, 4), (a.shape, a.dtype)
        data = np.ascontiguousarray(a).tobytes()  # native order: little-endian
        values = np.frombuffer(data, dtype=f"<u{a.dtype.itemsize}").tolist()
        s = sum(int(v) * (2 * j + 1) for j, v in enumerate(values))
        total += factor(layer, row) * s
    return total % MOD
