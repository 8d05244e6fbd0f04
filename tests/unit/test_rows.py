"""The vectorized row builder against a per-block loop, and end to end."""

import numpy as np
import torch

import reference
from kvcaches import random_cache
from vllm_kvchecksum.core.layer_view import LayerView
from vllm_kvchecksum.core.rows import BlockRows, RequestBlocks, build_rows


def rows_by_loop(requests, block_size):
    """The rows of one group, one block at a time."""
    rows = []
    for ids, first_position, num_tokens in requests:
        for i, block in enumerate(ids):
            first = (first_position + i) * block_size
            rows.append((block, first, max(0, min(block_size, num_tokens - first))))
    return rows


# Group 0 (block size 4): two requests, the second loaded after a 2-block
# prefix hit; 3 + 2 = 5 rows, odd. Group 1 (block size 8), e.g. a window.
GROUPS = [
    [RequestBlocks([7, 3, 9], 0, 10), RequestBlocks(np.array([4, 1]), 2, 15)],
    [RequestBlocks([2, 5], 1, 21), RequestBlocks([0], 3, 30)],
]
BLOCK_SIZES = [4, 8]


def test_matches_a_per_block_loop():
    rows = build_rows(GROUPS, BLOCK_SIZES)
    assert isinstance(rows, BlockRows)
    assert rows.table.dtype == torch.int64 and rows.table.shape == (3, 6 + 4)
    assert rows.groups == [(0, 5), (6, 3)]  # group 1 starts at an even row
    assert rows.requests == [[(0, 3), (3, 2)], [(6, 2), (8, 1)]]
    for g, (reqs, bs) in enumerate(zip(GROUPS, BLOCK_SIZES)):
        got = list(zip(*(t.tolist() for t in rows.group_rows(rows.table, g))))
        assert got == rows_by_loop(reqs, bs)
    assert rows.table[:, 5].tolist() == [0, 0, 0]  # padding: nothing valid
    assert rows.table[2].tolist() == [4, 4, 2, 4, 3, 0, 8, 5, 6, 0]


def test_empty_and_single_block_size():
    rows = build_rows([[], [RequestBlocks([], 0, 0)], [RequestBlocks([1], 0, 3)]], 16)
    assert rows.groups == [(0, 0), (0, 0), (0, 1)]
    assert rows.table.tolist() == [[1, 0], [0, 0], [3, 0]]


def test_one_copy_serves_every_group():
    rows = build_rows(GROUPS, BLOCK_SIZES, pin_memory=False)
    device_table = rows.to_device("cpu")
    for g in range(2):
        for a, b in zip(rows.group_rows(device_table, g), rows.group_rows(rows.table, g)):
            assert torch.equal(a, b)


def test_end_to_end_two_groups():
    """Rows for two requests in two groups give the definition's values."""
    caches = [[random_cache(10, 2, bs, 16, seed=3 * g + i) for i in range(2)]
              for g, bs in enumerate(BLOCK_SIZES)]
    rows = build_rows(GROUPS, BLOCK_SIZES)
    table = rows.to_device("cpu")
    out = torch.zeros(table.shape[1], 2, dtype=torch.int64)
    for g, bs in enumerate(BLOCK_SIZES):
        start, count = rows.groups[g]
        view = LayerView(caches[g], block_size=bs, layer=1, first_head=2)
        view.accumulate(out[start:start + count], g, *rows.group_rows(table, g))
    for g, bs in enumerate(BLOCK_SIZES):
        for (ids, first, num_tokens), (start, count) in zip(GROUPS[g], rows.requests[g]):
            want = reference.layer_checksums(caches[g], list(ids), num_tokens,
                                             first_block_position=first, layer=1,
                                             first_head=2, block_size=bs)
            assert out[start:start + count, g].numpy().view(np.uint64).tolist() == want
