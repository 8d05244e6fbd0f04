"""The public function: one layer's contribution to block checksums.

For users debugging a KV transfer (checksum the blocks on both sides and
find the first that differs) and for connector authors checking that their
connector moves the bytes it should. It runs the same LayerView code path
as the worker, so its values are the worker's.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from vllm_kvchecksum.core.definition import as_uint64
from vllm_kvchecksum.core.layer_view import LayerView
from vllm_kvchecksum.core.rows import RequestBlocks, build_rows


def layer_block_checksums(kv_cache: torch.Tensor | Sequence[torch.Tensor],
                          block_ids: Sequence[int] | np.ndarray | torch.Tensor,
                          num_tokens: int,
                          *,
                          first_block_position: int = 0,
                          layer: int = 0,
                          first_head: int = 0,
                          layout: str = "HND",
                          block_size: int | None = None) -> np.ndarray:
    """Checksum one layer's KV in the listed blocks of one request.

    Returns one uint64 per listed block: this layer's (and these KV heads')
    contribution to the block's checksum. A block's full checksum, as the
    worker and the scheduler compare it, is the sum mod 2**64 of these
    values over every layer of the KV cache group and every TP rank's heads.

    The definition (docs/definition.md): each slice, one layer's one KV head
    in the block, is laid out token by token (K cell then V cell when they
    are stored apart) and split into little-endian 8-byte pieces; piece p of
    the token at request position t has index j = t * P + p (P pieces per
    token and head). The block's value is

        sum over slices of m * sum_j x_j * (2 * j + 1)  mod 2**64,
        m = 2 * (layer * 2**16 + head) + 1, head the global KV head index.

    Slots at or past num_tokens are excluded, and j counts from the
    request's first token, so two 16-token blocks sum to the 32-token block
    holding the same tokens.

    kv_cache: one layer's cache, a 4-D tensor or a (K, V) pair, in `layout`
      ("HND": [kernel_blocks, heads, tokens, cell]; "NHD": [kernel_blocks,
      tokens, heads, cell]); any dtype and strides, on any device.
    block_ids: the request's blocks to checksum; block i sits at request
      block position first_block_position + i.
    num_tokens: the request's number of tokens.
    first_block_position: block position of block_ids[0], e.g. after a
      local prefix-cache hit.
    layer: the layer number in the layer's name ("model.layers.3" -> 3).
    first_head: global index of the cache's first KV head (rank r of TP
      holding n heads each: r * n).
    block_size: tokens per block; default: the cache's token dimension.
      A larger multiple treats consecutive kernel blocks as one block.

    Example: checksum a request's blocks of one layer on both sides of a
    transfer (the producer's and the consumer's block ids differ, the
    values must not), and find the blocks that differ:

        k, v = kv_caches["model.layers.0.self_attn.attn"]  # NHD caches
        mine = layer_block_checksums((k, v), [7, 2, 9], num_tokens=40,
                                     layer=0, layout="NHD")
        bad_positions = np.nonzero(mine != theirs)[0]
    """
    if isinstance(kv_cache, torch.Tensor):
        caches = [kv_cache]
    else:
        caches = list(kv_cache)
    if not caches or not all(isinstance(c, torch.Tensor) for c in caches):
        raise ValueError("kv_cache must be a tensor or a (K, V) pair of tensors")
    if isinstance(block_ids, torch.Tensor):
        block_ids = block_ids.cpu().numpy()
    ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    token_dim = 2 if layout == "HND" else 1
    if block_size is None:
        block_size = caches[0].shape[token_dim] if caches[0].dim() == 4 else 0
    view = LayerView(caches, block_size=block_size, layer=layer,
                     first_head=first_head, layout=layout)
    if ids.size and (ids.min() < 0 or ids.max() >= view.num_blocks):
        raise ValueError(
            f"block ids must be in [0, {view.num_blocks}), got "
            f"{ids.min()}..{ids.max()}")
    if first_block_position < 0:
        raise ValueError(
            f"first_block_position must be >= 0, got {first_block_position}")

    rows = build_rows([[RequestBlocks(ids, first_block_position, num_tokens)]],
                      block_size, pin_memory=False)
    table = rows.table.to(view.device)
    out = torch.zeros(ids.size, 1, dtype=torch.int64, device=view.device)
    view.accumulate(out, 0, *rows.group_rows(table, 0))
    return as_uint64(out[:, 0].cpu().numpy())
