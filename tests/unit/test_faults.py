"""Fault kinds (vllm_kvchecksum.drills.faults): each changes the bytes it reports,
and the checksum changes exactly at the positions it calls detectable."""

import random

import numpy as np
import pytest
import torch

from kvcaches import random_cache, to_layout
from vllm_kvchecksum.core.api import layer_block_checksums
from vllm_kvchecksum.drills.faults import FAULT_KINDS, Injection, inject

NUM_BLOCKS = 12
SOURCE = 11  # a block of "another request" for misplace_block
HEADS = 2


def layer_name(i):
    return f"model.layers.{i}.self_attn.attn"


def make_caches(num_layers, block_size, dtype, layout="HND", kernel_tokens=None,
                cell_bytes=32, seed=0):
    return {layer_name(i): to_layout(random_cache(NUM_BLOCKS, HEADS, block_size, cell_bytes,
                                                  dtype, seed=seed + i), layout, kernel_tokens)
            for i in range(num_layers)}


def checksums(caches, req, layout):
    total = np.zeros(len(req["block_ids"]), dtype=np.uint64)
    for i, name in enumerate(caches):
        assert name == layer_name(i)
        total = total + layer_block_checksums(
            caches[name], req["block_ids"], req["num_tokens"],
            first_block_position=req["first_position"], layer=i, first_head=0,
            layout=layout, block_size=req["block_size"])
    return total


def raw(caches):
    return {n: t.contiguous().view(torch.uint8).clone() for n, t in caches.items()}


def changed_blocks(before, after, kernel_per_block):
    out = set()
    for n in before:
        diff = (before[n] != after[n]).reshape(before[n].shape[0], -1).any(dim=1)
        out |= {int(k) // kernel_per_block for k in torch.nonzero(diff).flatten()}
    return out


def request(block_size, first_position):
    ids = [5, 7, 2, 9, 4][first_position:]
    return dict(block_ids=ids, first_position=first_position, block_size=block_size,
                num_tokens=4 * block_size + 3)  # positions 0..4, the last partial


def run_and_check(kind, caches, req, layout, kernel_per_block=1, seed=0, **choices):
    """Inject, and assert the checksum and byte invariants; returns the Injection."""
    if kind == "misplace_block":
        choices.setdefault("source_block_id", SOURCE)
    sums0, raw0 = checksums(caches, req, layout), raw(caches)
    injs = inject(kind, caches, req["block_ids"], num_tokens=req["num_tokens"],
                  block_size=req["block_size"], first_position=req["first_position"],
                  rng=random.Random(seed), layout=layout, **choices)
    assert len(injs) == 1 and isinstance(injs[0], Injection)
    inj = injs[0]
    assert inj.kind == kind
    sums1, raw1 = checksums(caches, req, layout), raw(caches)
    mismatched = {req["first_position"] + int(i) for i in np.nonzero(sums0 != sums1)[0]}
    if inj.detectable:
        assert mismatched == set(inj.positions)
    else:
        assert mismatched == set()
    # Only the reported blocks' bytes changed (the source block too stays intact).
    assert changed_blocks(raw0, raw1, kernel_per_block) == set(inj.block_ids)
    ids = req["block_ids"]
    assert inj.block_ids == tuple(ids[p - req["first_position"]] for p in inj.positions)
    return inj


KINDS = sorted(FAULT_KINDS)
CASES = [  # dtype, block size, first position, layout, kernel tokens
    (torch.bfloat16, 4, 0, "HND", None),
    (torch.float32, 16, 1, "HND", None),
    (torch.uint8, 4, 1, "HND", None),
    (torch.bfloat16, 16, 0, "NHD", 8),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-bs{c[1]}-first{c[2]}-{c[3]}")
@pytest.mark.parametrize("kind", KINDS)
def test_checksum_changes_exactly_at_reported_positions(kind, case):
    dtype, bs, first, layout, kt = case
    for seed in range(4):
        caches = make_caches(2 + seed % 2, bs, dtype, layout, kt, seed=10 * seed)
        inj = run_and_check(kind, caches, request(bs, first), layout,
                            kernel_per_block=bs // (kt or bs), seed=seed)
        assert inj.detectable == (kind != "change_tail")
        assert all(p >= first for p in inj.positions)


def test_positions_reported_per_kind():
    req = request(4, 0)
    caches = make_caches(3, 4, torch.bfloat16)
    assert len(run_and_check("swap_blocks", caches, req, "HND", position=1,
                             other_position=4).positions) == 2
    inj = run_and_check("swap_layers", caches, req, "HND", position=2)
    assert inj.positions == (2,) and inj.other_layer != inj.layer
    inj = run_and_check("swap_heads", caches, req, "HND", position=3)
    assert inj.positions == (3,) and {inj.head, inj.other_head} == {0, 1}
    inj = run_and_check("swap_tokens", caches, req, "HND", position=0, token=1,
                        other_position=3, other_token=2)
    assert inj.positions == (0, 3) and (inj.token, inj.other_token) == (1, 2)
    inj = run_and_check("misplace_block", caches, req, "HND", position=4)
    assert inj.positions == (4,) and inj.source_block_id == SOURCE
    inj = run_and_check("change_tail", caches, req, "HND")
    assert inj.positions == (4,) and not inj.detectable and inj.token == 3


def test_flip_bit_flips_the_chosen_bit():
    req = request(4, 1)
    caches = make_caches(2, 4, torch.bfloat16)
    before = raw(caches)
    inj = run_and_check("flip_bit", caches, req, "HND", layer=layer_name(1), position=2,
                        token=3, head=1, byte=5, bit=7)
    assert (inj.layer, inj.positions, inj.token, inj.head, inj.byte, inj.bit) == \
        (layer_name(1), (2,), 3, 1, 5, 7)
    after = raw(caches)[layer_name(1)]
    b = req["block_ids"][2 - 1]
    assert after[b, 1, 3, 5] == before[layer_name(1)][b, 1, 3, 5] ^ 128
    assert (after != before[layer_name(1)]).sum() == 1


def test_overwrite_piece_is_one_aligned_piece():
    req = request(16, 0)
    caches = make_caches(2, 16, torch.float32)
    before = raw(caches)
    inj = run_and_check("overwrite_piece", caches, req, "HND", seed=3)
    assert inj.byte % 8 == 0
    diff = before[inj.layer] != raw(caches)[inj.layer]
    assert 1 <= diff.sum() <= 8
    b = inj.block_ids[0]
    assert diff[b, inj.head, inj.token, inj.byte:inj.byte + 8].sum() == diff.sum()
    with pytest.raises(ValueError, match="changes no byte"):
        same = bytes(raw(caches)[inj.layer][b, inj.head, inj.token, inj.byte:inj.byte + 8].tolist())
        inject("overwrite_piece", caches, req["block_ids"], num_tokens=req["num_tokens"],
               block_size=16, rng=random.Random(0), layer=inj.layer, position=inj.positions[0],
               token=inj.token, head=inj.head, byte=inj.byte, value=same)


def test_seeded_rng_is_deterministic():
    for kind in KINDS:
        results = []
        for _ in range(2):
            caches = make_caches(3, 4, torch.bfloat16, seed=5)
            req = request(4, 1)
            extra = {"source_block_id": SOURCE} if kind == "misplace_block" else {}
            injs = inject(kind, caches, req["block_ids"], num_tokens=req["num_tokens"],
                          block_size=4, first_position=1, rng=random.Random(42), **extra)
            results.append((injs, raw(caches)))
        assert results[0][0] == results[1][0]
        assert all(torch.equal(results[0][1][n], results[1][1][n]) for n in results[0][1])


def test_tail_fault_needs_a_partial_last_block():
    caches = make_caches(2, 4, torch.bfloat16)
    with pytest.raises(ValueError, match="last block is full"):
        inject("change_tail", caches, [5, 7, 2], num_tokens=12, block_size=4,
               rng=random.Random(0))
    with pytest.raises(ValueError, match="not loaded"):  # the load ends before it
        inject("change_tail", caches, [5, 7], num_tokens=11, block_size=4,
               rng=random.Random(0))


def test_swaps_of_equal_data_are_refused():
    req = request(4, 0)
    caches = make_caches(2, 4, torch.bfloat16)
    ids = req["block_ids"]
    kw = dict(num_tokens=req["num_tokens"], block_size=4, rng=random.Random(0))
    c = caches[layer_name(0)]
    c[ids[1], 0, 2] = c[ids[1], 0, 0]
    with pytest.raises(ValueError, match="changes no byte"):
        inject("swap_tokens", caches, ids, layer=layer_name(0), head=0, position=1,
               token=0, other_token=2, **kw)
    c[ids[2], 1] = c[ids[2], 0]
    with pytest.raises(ValueError, match="changes no byte"):
        inject("swap_heads", caches, ids, layer=layer_name(0), position=2, head=0,
               other_head=1, **kw)
    with pytest.raises(ValueError, match="changes no byte"):
        inject("misplace_block", caches, ids, position=3, source_block_id=ids[3], **kw)
    for t in caches.values():  # another block holding the very same data
        t[SOURCE] = t[ids[3]]
    with pytest.raises(ValueError, match="changes no byte"):
        inject("misplace_block", caches, ids, position=3, source_block_id=SOURCE, **kw)
    # Two names for one tensor: a layer swap changes nothing.
    shared = {"model.layers.0.a": c, "model.layers.1.a": c}
    with pytest.raises(ValueError, match="changes no byte"):
        inject("swap_layers", shared, ids, layer="model.layers.0.a",
               other_layer="model.layers.1.a", **kw)
    with pytest.raises(ValueError, match="do not share memory"):
        inject("swap_layers", shared, ids, **kw)
    # Every block equal: no block swap changes anything.
    flat = {layer_name(0): torch.zeros(NUM_BLOCKS, HEADS, 4, 16, dtype=torch.bfloat16)}
    with pytest.raises(ValueError, match="changed the bytes"):
        inject("swap_blocks", flat, ids, **kw)


def test_shared_tensor_is_corrupted_once():
    """Layers sharing a tensor: a block-wide fault applied per name would undo itself."""
    req = request(4, 0)
    c = make_caches(1, 4, torch.bfloat16)[layer_name(0)]
    shared = {layer_name(0): c, layer_name(1): c}
    before = c.clone()
    injs = inject("swap_blocks", shared, req["block_ids"], num_tokens=req["num_tokens"],
                  block_size=4, rng=random.Random(1))
    assert not torch.equal(before, c)
    p1, p2 = injs[0].block_ids
    assert torch.equal(c[p1], before[p2]) and torch.equal(c[p2], before[p1])


def test_token_swap_whose_pieces_cancel_is_reported_undetectable():
    """Two tokens of one block whose pieces are a permutation of each other's:
    the bytes differ, but the block's sum cannot change; the Injection says so."""
    req = request(4, 0)
    caches = make_caches(2, 4, torch.bfloat16)
    c = caches[layer_name(0)].view(torch.uint8)
    b = req["block_ids"][1]
    c[b, 0, 2] = torch.cat([c[b, 0, 0, 8:16], c[b, 0, 0, 0:8], c[b, 0, 0, 16:]])
    inj = run_and_check("swap_tokens", caches, req, "HND", layer=layer_name(0), head=0,
                        position=1, token=0, other_token=2)
    assert not inj.detectable
    # Random choices are retried until detectable.
    for seed in range(20):
        assert run_and_check("swap_tokens", caches, req, "HND", seed=seed).detectable


def test_unknown_kind_and_bad_choices():
    req = request(4, 0)
    caches = make_caches(2, 4, torch.bfloat16)
    kw = dict(num_tokens=req["num_tokens"], block_size=4, rng=random.Random(0))
    with pytest.raises(ValueError, match="unknown fault kind"):
        inject("melt", caches, req["block_ids"], **kw)
    with pytest.raises(ValueError, match="not a token"):  # slot past num_tokens
        inject("flip_bit", caches, req["block_ids"], position=4, token=3, **kw)
    with pytest.raises(ValueError, match="not a loaded block"):
        inject("flip_bit", caches, req["block_ids"][1:], first_position=1, position=0, **kw)


def test_change_tail_writes_real_kv_values_not_random_bytes():
    """The tail gets copies of the block's own token cells: values a model
    writes. Random bytes would hold NaN/Inf patterns that some attention
    kernels do not mask (0 * NaN), so the drill would test the kernel."""
    bs, n = 8, 8 * 4 + 3
    caches = make_caches(2, bs, torch.bfloat16, seed=5)
    block_ids = [3, 9, 4, 11, 6]
    inj = inject("change_tail", caches, block_ids, num_tokens=n, block_size=bs, rng=random.Random(1))[0]
    t = caches[inj.layer]
    block = t[block_ids[-1]]  # [heads, tokens, cell]
    valid = {tuple(block[h, tok].view(torch.uint8).tolist()) for h in range(block.shape[0]) for tok in range(3)}
    for h in range(block.shape[0]):
        for tok in range(3, bs):
            assert tuple(block[h, tok].view(torch.uint8).tolist()) in valid
