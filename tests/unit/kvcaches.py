"""Test helpers: random KV caches, and the same cache in other layouts.

A *logical* cache is HND with one kernel block per block:
[num_blocks, heads, block_size, cell]. to_layout() returns the same bytes
as another layout, kernel-block split or strided view, without changing
what any (block, head, token) holds, so checksums must not change.
"""

from __future__ import annotations

import torch

DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp8": torch.float8_e4m3fn,
    "uint8": torch.uint8,  # how vLLM stores fp8 caches
    "int8": torch.int8,
}


def random_cache(num_blocks: int, heads: int, block_size: int, cell_bytes: int,
                 dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.Tensor:
    """A logical HND cache of random bytes (any bit pattern, NaNs included)."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (num_blocks, heads, block_size, cell_bytes),
                        dtype=torch.uint8, generator=gen)
    return raw.view(dtype)


def to_layout(logical: torch.Tensor, layout: str = "HND",
              kernel_tokens: int | None = None, padded: bool = False) -> torch.Tensor:
    """The logical cache's bytes as `layout` with kernel blocks of
    kernel_tokens tokens; padded=True returns a strided view into a larger
    buffer (block and cell padding) instead of a contiguous tensor."""
    nb, heads, bs, cell = logical.shape
    kt = kernel_tokens or bs
    kb = bs // kt
    t = logical.reshape(nb, heads, kb, kt, cell).permute(0, 2, 1, 3, 4)
    t = t.reshape(nb * kb, heads, kt, cell)  # HND kernel blocks
    if layout == "NHD":
        t = t.permute(0, 2, 1, 3)
    t = t.contiguous()
    if padded:
        # Room after each block and after each cell, as a backend that
        # interleaves K and V or pads its rows would leave.
        pad = 8 // t.element_size()
        big = torch.zeros(t.shape[0], 2, t.shape[1], t.shape[2], t.shape[3] + pad,
                          dtype=t.dtype, device=t.device)
        big[:, 1, :, :, :cell] = t
        t = big[:, 1, :, :, :cell]
    return t


def split_heads(cache: torch.Tensor, layout: str, parts: int) -> list[torch.Tensor]:
    """TP shards of a cache along its head dimension."""
    dim = 1 if layout == "HND" else 2
    return list(torch.chunk(cache, parts, dim=dim))
