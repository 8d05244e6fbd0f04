"""Caches and rows that cannot be checksummed are refused with a clear error."""

import pytest
import torch

from vllm_kvchecksum import layer_block_checksums
from vllm_kvchecksum.core.definition import MAX_KV_HEADS_PER_LAYER
from vllm_kvchecksum.core.layer_view import LayerView


def cache(*shape, dtype=torch.bfloat16):
    return torch.zeros(shape, dtype=dtype)


@pytest.mark.parametrize("caches,kwargs,match", [
    ([cache(4, 2, 4, 6)], {}, "12 bytes.*not a multiple of 8"),
    ([cache(4, 2, 4, 16)[..., ::2]], {}, "cell dimension is not contiguous"),
    ([cache(4, 2, 5, 8)[:, :, :4]], {}, None),  # strided tokens of 16 bytes: fine
    ([cache(4, 2, 4, 12)[..., :8]], {}, None),  # padded cells of 24 bytes: fine
    ([cache(4, 2, 4, 10)[..., :8]], {}, "stride of dimension 2 is 20 bytes"),
    ([cache(4, 2, 4, 4)], {"block_size": 6}, "do not tile the block size 6"),
    ([cache(5, 2, 4, 4)], {"block_size": 8}, "5 kernel blocks.*not a whole number"),
    ([cache(4, 2, 4, 4)], {"first_head": MAX_KV_HEADS_PER_LAYER - 1}, "exceed MAX_KV_HEADS"),
    ([cache(4, 2, 4, 4)], {"first_head": -1}, "exceed MAX_KV_HEADS"),
    ([cache(4, 2, 4, 4), cache(4, 3, 4, 4)], {}, "V cache has .*K cache has"),
    ([cache(4, 2, 4, 4), cache(8, 2, 4, 4)], {}, "agree"),
    ([cache(4, 2, 4)], {}, "must be 4-D"),
    ([cache(4, 2, 4, 4)] * 3, {}, "1 \\(combined\\) or 2"),
    ([cache(4, 2, 4, 4)], {"layout": "HDN"}, "layout must be"),
    ([cache(4, 2, 4, 4)], {"path": "cuda"}, "path must be"),
    ([cache(4, 2, 4, 4)], {"piece_bits": 8}, "piece_bits=8 is not implemented"),
    ([cache(4, 2, 4, 4)], {"piece_bits": 32}, "bfloat16 \\(2-byte elements\\), but piece_bits=32"),
    ([cache(4, 2, 4, 4)], {"layer": -1}, "layer must be"),
])
def test_layer_view_validation(caches, kwargs, match):
    kwargs = {"block_size": 4, "layer": 0, **kwargs}
    if match is None:
        LayerView(caches, **kwargs)
        return
    with pytest.raises(ValueError, match=match):
        LayerView(caches, **kwargs)


def test_misaligned_start():
    flat = torch.zeros(4 * 2 * 4 * 4 + 1, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="8-byte boundary"):
        LayerView([flat[1:].view(4, 2, 4, 4)], block_size=4, layer=0)


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(out=torch.zeros(2, 1, dtype=torch.int32)), "int64"),
    (lambda a: a.update(column=1), "column 1"),
    (lambda a: a.update(block_ids=torch.zeros(3, dtype=torch.int64)), "block_ids has 3 rows"),
    (lambda a: a.update(valid_tokens=torch.zeros(2, dtype=torch.int32)), "valid_tokens must be"),
])
def test_accumulate_validation(change, match):
    view = LayerView([cache(4, 2, 4, 4)], block_size=4, layer=0)
    args = dict(out=torch.zeros(2, 1, dtype=torch.int64), column=0,
                block_ids=torch.zeros(2, dtype=torch.int64),
                first_tokens=torch.zeros(2, dtype=torch.int64),
                valid_tokens=torch.zeros(2, dtype=torch.int64))
    change(args)
    with pytest.raises(ValueError, match=match):
        view.accumulate(**args)


def test_public_function_validation():
    c = cache(4, 2, 4, 4)
    with pytest.raises(ValueError, match=r"block ids must be in \[0, 4\)"):
        layer_block_checksums(c, [0, 4], 8)
    with pytest.raises(ValueError, match="first_block_position"):
        layer_block_checksums(c, [0], 8, first_block_position=-1)
    with pytest.raises(ValueError, match="tensor or a \\(K, V\\) pair"):
        layer_block_checksums([], [0], 8)
