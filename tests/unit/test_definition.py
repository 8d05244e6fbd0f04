"""The definition's example (docs/definition.md) and its helpers."""

import numpy as np
import pytest
import torch

import reference
from vllm_kvchecksum import layer_block_checksums
from vllm_kvchecksum.core.definition import (MAX_KV_HEADS_PER_LAYER, PIECE_BYTES,
                                             as_uint64, piece_weight,
                                             pieces_per_cell, slice_factor,
                                             slice_factor_base, to_int64,
                                             valid_token_slots)

# docs/definition.md's worked example: 2 layers, 2 KV heads, 2 tokens per
# block, 16-byte cells (2 pieces per token and head). Piece j of the slice
# (layer, head) holds the integer 1 + j + 4 * head + 8 * layer.
EXAMPLE_VALUE = 55051536
EXAMPLE_VALUE_AT_POSITION_1 = 159911568


def example_layer(layer: int) -> torch.Tensor:
    pieces = np.zeros((1, 2, 2, 2), dtype="<u8")  # HND [block, head, token, piece]
    for head in range(2):
        for token in range(2):
            for piece in range(2):
                pieces[0, head, token, piece] = 1 + 2 * token + piece + 4 * head + 8 * layer
    return torch.from_numpy(pieces.view(np.uint8))  # 16 bytes per cell


def test_constants():
    assert MAX_KV_HEADS_PER_LAYER == 2**16
    assert PIECE_BYTES == 8


def test_example_factors():
    assert [slice_factor(l, h) for l in (0, 1) for h in (0, 1)] == [1, 3, 131073, 131075]
    assert [reference.factor(l, h) for l in (0, 1) for h in (0, 1)] == [1, 3, 131073, 131075]


def test_example_value():
    # The slices' sums, as the document lists them.
    s = [50, 114, 178, 242]
    assert (1 * s[0] + 3 * s[1] + 131073 * s[2] + 131075 * s[3]) % 2**64 == EXAMPLE_VALUE
    per_layer = [int(layer_block_checksums(example_layer(l), [0], 2, layer=l)[0])
                 for l in (0, 1)]
    assert per_layer == [1 * 50 + 3 * 114, 131073 * 178 + 131075 * 242]
    assert sum(per_layer) % 2**64 == EXAMPLE_VALUE
    assert reference.model_checksums([(l, example_layer(l)) for l in (0, 1)],
                                     [0], 2)[0] == EXAMPLE_VALUE


def test_example_value_at_block_position_1():
    # The same bytes one block later: j starts at 1 * 2 tokens * 2 pieces.
    total = sum(int(layer_block_checksums(example_layer(l), [0], 4,
                                          first_block_position=1, layer=l)[0])
                for l in (0, 1)) % 2**64
    assert total == EXAMPLE_VALUE_AT_POSITION_1
    assert reference.model_checksums([(l, example_layer(l)) for l in (0, 1)],
                                     [0], 4, first_block_position=1)[0] == total


def test_slice_factor_bounds():
    assert slice_factor(3, MAX_KV_HEADS_PER_LAYER - 1) == 2 * (4 * 2**16 - 1) + 1
    with pytest.raises(ValueError, match="KV head"):
        slice_factor(0, MAX_KV_HEADS_PER_LAYER)
    with pytest.raises(ValueError, match="layer"):
        slice_factor(-1, 0)
    assert slice_factor_base(2, 5) == 2 * 2**16 + 5


def test_helpers():
    assert piece_weight(0) == 1 and piece_weight(2**63) == 1
    assert pieces_per_cell(256) == 32
    with pytest.raises(ValueError, match="8-byte pieces"):
        pieces_per_cell(12)
    assert to_int64(2**64 - 1) == -1 and to_int64(5) == 5
    assert as_uint64([-1]).tolist() == [2**64 - 1]
    assert [valid_token_slots(f, 20, 16) for f in (0, 16, 32)] == [16, 4, 0]
