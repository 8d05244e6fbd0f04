"""LayerView and both CPU paths (Numba, PyTorch) against the independent reference.

Every value must be the definition's, whatever the memory layout, the TP
or PP split, or the block size; misplaced data must change it.
"""

import numpy as np
import pytest
import torch

import reference
from kvcaches import DTYPES, random_cache, split_heads, to_layout
from vllm_kvchecksum import layer_block_checksums
from vllm_kvchecksum.core.kernels import torch_path
from vllm_kvchecksum.core.layer_view import LayerView

MOD = 2**64

# Every test runs on the Numba path and on the PyTorch fallback (conftest).
pytestmark = pytest.mark.usefixtures("cpu_path")


def values(caches, ids, num_tokens, **kw):
    return [int(v) for v in layer_block_checksums(caches, ids, num_tokens, **kw)]


def add(*lists):
    return [sum(vals) % MOD for vals in zip(*lists)]


@pytest.fixture
def kv():
    """A logical K and V: 6 blocks of 4 heads x 8 tokens, 32-byte cells."""
    return random_cache(6, 4, 8, 32, seed=1), random_cache(6, 4, 8, 32, seed=2)


IDS, NUM_TOKENS, FIRST = [4, 0, 5, 2], 8 * 4 + 3, 1  # positions 1..4, last partial


def test_matches_reference(kv):
    got = values(kv, IDS, NUM_TOKENS, first_block_position=FIRST, layer=3, first_head=8)
    ref = reference.layer_checksums(list(kv), IDS, NUM_TOKENS, first_block_position=FIRST,
                                    layer=3, first_head=8)
    assert got == ref
    # A block listed past the request's last token holds nothing of it.
    past = values(kv, IDS + [1], NUM_TOKENS, first_block_position=FIRST, layer=3, first_head=8)
    assert past == got + [0]


@pytest.mark.parametrize("layout,kernel_tokens,padded", [
    ("HND", 8, False), ("NHD", 8, False), ("HND", 4, False), ("NHD", 2, False),
    ("HND", 8, True), ("NHD", 4, True)])
def test_layouts_agree(kv, layout, kernel_tokens, padded):
    expected = values(kv, IDS, NUM_TOKENS, first_block_position=FIRST, layer=2)
    caches = [to_layout(c, layout, kernel_tokens, padded) for c in kv]
    got = values(caches, IDS, NUM_TOKENS, first_block_position=FIRST, layer=2,
                 layout=layout, block_size=8)
    assert got == expected
    assert got == reference.layer_checksums(caches, IDS, NUM_TOKENS, first_block_position=FIRST,
                                            layer=2, layout=layout, block_size=8)


def test_kv_split_equals_combined_cache(kv):
    combined = torch.cat([c.view(torch.uint8) for c in kv], dim=-1)  # K cell, V cell
    assert values(kv, IDS, NUM_TOKENS) == values(combined, IDS, NUM_TOKENS)
    swapped = values((kv[1], kv[0]), IDS, NUM_TOKENS)
    assert swapped != values(kv, IDS, NUM_TOKENS)  # K and V are not interchangeable


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_tp2_shards_sum_to_whole(kv, layout):
    caches = [to_layout(c, layout) for c in kv]
    whole = values(caches, IDS, NUM_TOKENS, layer=1, layout=layout)
    k_parts, v_parts = (split_heads(c, layout, 2) for c in caches)
    shards = [values((k_parts[r], v_parts[r]), IDS, NUM_TOKENS, layer=1,
                     first_head=2 * r, layout=layout) for r in range(2)]
    assert add(*shards) == whole
    # A shard that claims the wrong heads does not.
    wrong = values((k_parts[1], v_parts[1]), IDS, NUM_TOKENS, layer=1, layout=layout)
    assert add(shards[0], wrong) != whole


def test_pp2_stages_sum_to_whole():
    layers = [(l, (random_cache(4, 2, 4, 16, seed=10 + l), random_cache(4, 2, 4, 16, seed=20 + l)))
              for l in range(4)]
    ids, n = [3, 1, 2], 11
    stage = lambda ls: add(*[values(c, ids, n, layer=l) for l, c in ls])  # noqa: E731
    whole = reference.model_checksums(layers, ids, n)
    assert add(stage(layers[:2]), stage(layers[2:])) == whole
    assert add(stage(layers[:1]), stage(layers[1:])) == whole


def test_swaps_change_the_value(kv):
    k, v = (c.clone() for c in kv)
    base = values((k, v), IDS, NUM_TOKENS)

    def changed(k2, v2, ids=IDS, **kw):
        return values((k2, v2), ids, NUM_TOKENS, **kw) != base

    tok = k.clone()
    tok[4, :, [0, 1]] = k[4, :, [1, 0]]  # two tokens of block 4
    assert changed(tok, v)
    head = k.clone()
    head[0, [0, 1]] = k[0, [1, 0]]  # two heads of block 0
    assert changed(head, v)
    assert changed(k, v, ids=[0, 4, 5, 2])  # two blocks swapped
    assert values((k, v), IDS, NUM_TOKENS, layer=1) != base  # another layer's slot


def test_swapped_layers_change_the_model_value():
    a = (random_cache(2, 2, 4, 16, seed=1), random_cache(2, 2, 4, 16, seed=2))
    b = (random_cache(2, 2, 4, 16, seed=3), random_cache(2, 2, 4, 16, seed=4))
    ids = [0, 1]
    straight = add(values(a, ids, 8, layer=0), values(b, ids, 8, layer=1))
    swapped = add(values(b, ids, 8, layer=0), values(a, ids, 8, layer=1))
    assert straight != swapped


def test_single_piece_change_is_detected(kv):
    k, v = (c.clone() for c in kv)
    base = values((k, v), IDS, NUM_TOKENS)
    k.view(torch.uint8)[2, 3, 7, 31] ^= 0x80  # the top bit of one piece
    got = values((k, v), IDS, NUM_TOKENS)
    assert [g != b for g, b in zip(got, base)] == [False, False, False, True]  # block 2


def test_slots_past_num_tokens_are_excluded(kv):
    k, v = (c.clone() for c in kv)
    base = values((k, v), IDS, NUM_TOKENS, first_block_position=FIRST)
    # Position 4 holds tokens 32..39; only 32..34 are the request's.
    k[2, :, 3:] = 0
    v[2, :, 3:] = 0
    assert values((k, v), IDS, NUM_TOKENS, first_block_position=FIRST) == base
    k[2, :, 2] = 0
    assert values((k, v), IDS, NUM_TOKENS, first_block_position=FIRST)[-1] != base[-1]


@pytest.mark.parametrize("num_tokens", [64, 61, 50, 48])
def test_small_blocks_sum_to_the_large_block(num_tokens):
    """Two 16-token blocks == the 32-token block holding the same tokens."""
    big_k, big_v = random_cache(3, 2, 32, 16, seed=5), random_cache(3, 2, 32, 16, seed=6)
    # The same tokens in 16-token blocks: big block b = small blocks 2b, 2b+1.
    small_k, small_v = (c.reshape(3, 2, 2, 16, -1).permute(0, 2, 1, 3, 4)
                        .reshape(6, 2, 16, -1).contiguous() for c in (big_k, big_v))
    big = values((big_k, big_v), [2, 0], num_tokens)  # positions 0, 1
    small = values((small_k, small_v), [4, 5, 0, 1], num_tokens)
    assert big == [(small[0] + small[1]) % MOD, (small[2] + small[3]) % MOD]
    # Also from the middle of a request: position 1 of 32 = positions 2, 3 of 16.
    big1 = values((big_k, big_v), [0], num_tokens, first_block_position=1)
    small1 = values((small_k, small_v), [0, 1], num_tokens, first_block_position=2)
    assert big1 == [sum(small1) % MOD]


def test_chunked_gathers(kv, monkeypatch):
    expected = values(kv, IDS, NUM_TOKENS, first_block_position=FIRST, layer=4)
    row_bytes = 4 * 8 * 32  # one block of one tensor
    for limit in (1, row_bytes, 3 * row_bytes):
        monkeypatch.setattr(torch_path, "GATHER_CHUNK_BYTES", limit)
        assert values(kv, IDS, NUM_TOKENS, first_block_position=FIRST, layer=4) == expected
    monkeypatch.setattr(torch_path, "GATHER_CHUNK_BYTES", row_bytes)
    ids = list(range(6)) * 3  # 17 full rows and a partial one, in chunks of 1
    assert values(kv, ids, 8 * 17 + 5) == reference.layer_checksums(list(kv), ids, 8 * 17 + 5)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_dtypes(dtype):
    elem = torch.tensor([], dtype=DTYPES[dtype]).element_size()
    k = random_cache(3, 2, 4, 16, seed=7).view(DTYPES[dtype])
    v = random_cache(3, 2, 4, 16, seed=8).view(DTYPES[dtype])
    assert k.shape[-1] == 16 // elem
    ids = [2, 0, 1]
    assert values((k, v), ids, 10, layer=1) == reference.layer_checksums([k, v], ids, 10, layer=1)
    # The value depends on the bytes only, not on how they are typed.
    as_bytes = (k.view(torch.uint8), v.view(torch.uint8))
    assert values(as_bytes, ids, 10, layer=1) == values((k, v), ids, 10, layer=1)


def test_accumulate_adds_into_one_column(kv):
    view = LayerView(list(kv), block_size=8, layer=0)
    out = torch.full((3, 4), 7, dtype=torch.int64)
    out[:, 2] = -1  # 2**64 - 1: adding wraps around
    ids = torch.tensor([1, 3, 5])
    t0 = torch.tensor([0, 8, 16])
    valid = torch.tensor([8, 8, 0])
    view.accumulate(out, 2, ids, t0, valid)
    ref = reference.layer_checksums(list(kv), [1, 3, 5], 16)
    got = out[:, 2].numpy().view(np.uint64).tolist()
    assert got == [(r - 1) % MOD for r in ref]
    assert got[2] == 2**64 - 1  # valid 0 adds 0
    assert (out[:, [0, 1, 3]] == 7).all()


def test_empty_rows_do_not_read_their_block_id(kv):
    view = LayerView(list(kv), block_size=8, layer=0)
    out = torch.zeros(2, 1, dtype=torch.int64)
    view.accumulate(out, 0, torch.tensor([10**9, 1]), torch.tensor([0, 8]), torch.tensor([0, 8]))
    assert out[0, 0] == 0 and out[1, 0] != 0


def test_view_properties(kv, cpu_path):
    caches = [to_layout(c, "NHD", 2) for c in kv]
    view = LayerView(caches, block_size=8, layer=0, layout="NHD")
    assert (view.num_blocks, view.pieces_per_token, view.kernel_blocks_per_block) == (6, 8, 4)
    assert view.path == cpu_path and view.piece_bits == 64
    assert view.block_bytes == 4 * 8 * 64
    view.warm_up()  # compiles (or loads) the Numba pass; a no-op on the PyTorch path


def test_no_copy_of_the_cache(kv):
    k = to_layout(kv[0], "NHD", 4, padded=True)
    view = LayerView([k], block_size=8, layer=0, layout="NHD")
    assert view.caches[0].pieces.data_ptr() == k.data_ptr()
    assert view.caches[0].pieces.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
