"""A worker's checksums of Mamba2 state, against the independent NumPy reference.

Each rank's cache comes from vLLM's allocate_kv_cache (kv_setup), with the
Mamba layers' pages padded, behind another group's bytes (a nonzero offset),
and in a layer-major or a block-major layout (the two Mamba layers
interleaved per block). Each rank writes the rows of a global (TP=1) state
its shard holds (hybrid_harness.Mamba2Layer); the reference sums the global
state's rows, numbered conv rows first (x, B, C), then the temporal heads.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hybrid_harness import Mamba2Layer, mamba_layer_name
from kv_setup import build_caches
from reference import MOD, state_checksum
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from vllm.v1.kv_cache_layout import KVCacheLayout

from vllm_kvchecksum.core.compare import _replica_checks
from vllm_kvchecksum.core.records import GroupBlocks, KVChecksumBlocks
from vllm_kvchecksum.engine.worker import KVChecksumWorker

LAYERS = [1, 3]
NUM_BLOCKS = 6
BLOCK = 4
TOKENS = 21
PAGE = 1024  # the attention group's page; the Mamba pages are padded to it
MAMBA_GID = 1


def reference(model: Mamba2Layer, tokens: int = TOKENS) -> int:
    """The definition over the global state of every Mamba layer."""
    total = 0
    for layer in LAYERS:
        conv, temporal = model.global_state(layer, tokens)
        rows = [(r, conv[r]) for r in range(model.conv_rows)]
        rows += [(model.conv_rows + h, temporal[h]) for h in range(model.heads)]
        total += state_checksum(layer, rows)
    return total % MOD


class Rank:
    def __init__(self, model: Mamba2Layer, tp: int, rank: int, layout: KVCacheLayout = KVCacheLayout.LBHNC,
                 extra_state: bool = False, spec=None, write: bool = True):
        spec = spec or model.spec(tp, 16, PAGE)
        if extra_state:  # e.g. a ReplaySSM ring after the two states
            spec = replace(spec, shapes=(*spec.shapes, (2, 3)), dtypes=(*spec.dtypes, torch.float32))
        attention = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
        groups = [KVCacheGroupSpec(["model.layers.0.self_attn.attn"], attention),
                  KVCacheGroupSpec([mamba_layer_name(l) for l in LAYERS], spec)]
        self.config, self.caches = build_caches(groups, NUM_BLOCKS, layout=layout, seed=rank)
        self.model, self.tp, self.rank, self.spec = model, tp, rank, spec
        for layer in LAYERS if write else ():
            data = model.local_page(layer, TOKENS, tp, rank)
            self.page(layer)[:len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.worker = KVChecksumWorker(self.config, self.caches, tp_rank=rank, tp_size=tp, model_kv_heads=None)

    def page(self, layer: int = LAYERS[0]) -> torch.Tensor:
        """The layer's page view of the block: its states, not the padding."""
        return self.caches[mamba_layer_name(layer)][BLOCK, 0, 0].view(torch.uint8)

    def padding(self, layer: int = LAYERS[0]) -> torch.Tensor:
        """The bytes after the page view, up to the padded page size."""
        view = self.caches[mamba_layer_name(layer)]
        raw = torch.empty(0, dtype=torch.uint8).set_(view.untyped_storage())
        start = view.storage_offset() + BLOCK * view.stride(0) + view.shape[3]
        return raw[start:start + PAGE - view.shape[3]]

    def group(self, replica_zero_only: bool):
        blocks = KVChecksumBlocks(TOKENS, {MAMBA_GID: GroupBlocks(0, (BLOCK,))})
        record = self.worker.compute({"r": blocks}, replica_zero_only=replica_zero_only).records[0]
        return record.requests["r"][MAMBA_GID]


def ranks(model: Mamba2Layer, tp: int, **kw) -> list[Rank]:
    return [Rank(model, tp, r, **kw) for r in range(tp)]


def producer_value(rs: list[Rank]) -> int:
    """What a producer sends: every rank's replica-0 partials, summed."""
    total = 0
    for r in rs:
        for (_, index), values in r.group(replica_zero_only=True).partials.items():
            assert index == 0
            total += int(values[0])
    return total % MOD


def consumer_checks(rs: list[Rank]) -> list[int]:
    """The consumer's checks: one per replica of the replicated rows."""
    checks = _replica_checks([r.group(replica_zero_only=False) for r in rs], 1)
    return [int(v) for v in checks[:, 0]]


CASES = [(tp, n_groups, dim_first, conv_bytes, KVCacheLayout.LBHNC)
         for tp in (1, 2, 4) for n_groups in (1, 4) for dim_first in (True, False) for conv_bytes in (2, 4)]
# The two Mamba layers interleaved per block.
CASES += [(2, 1, False, 2, KVCacheLayout.BLHNC), (4, 4, True, 4, KVCacheLayout.BLHNC)]


@pytest.mark.parametrize("tp,n_groups,dim_first,conv_bytes,layout", CASES,
                         ids=lambda v: getattr(v, "name", str(v)))
def test_tp_shards_sum_to_the_definition(tp, n_groups, dim_first, conv_bytes, layout):
    model = Mamba2Layer(n_groups=n_groups, dim_first=dim_first, conv_bytes=conv_bytes)
    rs = ranks(model, tp, layout=layout)
    assert all(not r.worker.skipped_groups for r in rs), rs[0].worker.skipped_groups
    assert producer_value(rs) == reference(model)
    assert consumer_checks(rs) == [reference(model)] * (tp if n_groups == 1 and tp > 1 else 1)


def test_corrupting_one_ranks_b_fails_that_replica_only():
    model = Mamba2Layer(n_groups=1)
    rs = ranks(model, 2)
    rs[1].page()[rs[1].model.x_rows // 2 * model.conv_len * 2 + 1] ^= 0x04  # rank 1's first B row
    # The producer sends replica 0, which rank 0 holds: unaffected.
    assert producer_value(rs) == reference(model)
    checks = consumer_checks(rs)
    assert checks[0] == reference(model) and checks[1] != reference(model)


def test_only_the_covered_states_count():
    model = Mamba2Layer(n_groups=1)
    r = Rank(model, 1, 0, extra_state=True)
    before = producer_value([r])
    assert before == reference(model)
    covered = len(model.local_page(LAYERS[0], TOKENS, 1, 0))
    page = r.page()
    assert page.shape[0] == covered + 24
    page[covered:] ^= 0xFF  # the extra state
    r.padding()[:] ^= 0xFF  # padding up to the page size
    assert producer_value([r]) == before
    page[covered - 1] ^= 0x80  # the last temporal element's sign bit
    assert producer_value([r]) != before
    page[covered - 1] ^= 0x80
    page[0] ^= 0x01  # the first conv element
    assert producer_value([r]) != before


def fingerprint(model: Mamba2Layer, tp: int) -> int:
    return Rank(model, tp, 0).worker.fingerprints[MAMBA_GID]


def test_fingerprint_is_the_same_across_tp_sizes_and_conv_layouts_only():
    base = fingerprint(Mamba2Layer(), 1)
    for tp in (1, 2, 4):
        for dim_first in (True, False):
            assert fingerprint(Mamba2Layer(dim_first=dim_first), tp) == base
    assert fingerprint(Mamba2Layer(conv_len=4), 1) != base  # another conv width (or speculative count)
    assert fingerprint(Mamba2Layer(conv_bytes=4), 1) != base
    # Without a split the fingerprint follows the local shapes.
    assert fingerprint(Mamba2Layer(split=False), 1) != fingerprint(Mamba2Layer(split=False), 2)


def test_unsplit_state_is_one_slice_per_rank_and_tp_local():
    model = Mamba2Layer(split=False)
    rs = ranks(model, 2)
    assert all(r.worker.tp_local_groups == {MAMBA_GID} for r in rs)
    assert Rank(Mamba2Layer(), 2, 0).worker.tp_local_groups == frozenset()
    # Equal TP sizes: the ranks' parts are stable and a flipped bit changes them.
    before = producer_value(rs)
    rs[1].page()[3] ^= 0x10
    assert producer_value(rs) != before


@pytest.mark.parametrize("case,reason", [
    ("one-byte-elements", "only 2- and 4-byte elements"),
    ("not-whole-pieces", "not whole 8-byte pieces"),
    ("splits-disagree", "do not match state shape"),
    ("too-few-splits", "state_splits describe 1 states, 2 are checksummed"),
    ("malformed-segments", "ValueError"),
])
def test_state_that_cannot_be_read_skips_the_group(case, reason):
    model = Mamba2Layer()
    spec = model.spec(1, 16, PAGE)
    if case == "one-byte-elements":
        spec = replace(spec, dtypes=(torch.int8, torch.float32))
    elif case == "not-whole-pieces":
        spec = replace(spec, shapes=((24, 3), (3,)), dtypes=(torch.bfloat16, torch.bfloat16), state_splits=None)  # 150 bytes
    elif case == "splits-disagree":
        split = spec.state_splits[0]
        spec = replace(spec, state_splits=(replace(split, segments=((16, 1), (4, 1), (3, 1))), spec.state_splits[1]))
    elif case == "too-few-splits":
        spec = replace(spec, state_splits=spec.state_splits[:1])
    else:  # a layer's bug: segments that are not (size, replicas) pairs
        spec = replace(spec, state_splits=(replace(spec.state_splits[0], segments=((16,),)), spec.state_splits[1]))
    r = Rank(model, 1, 0, spec=spec, write=False)
    assert MAMBA_GID in r.worker.skipped_groups and reason in r.worker.skipped_groups[MAMBA_GID], \
        r.worker.skipped_groups


def test_state_layers_of_one_module_number_their_rows_one_after_another():
    # Two Mamba layers with the same layer number (one module): swapping
    # their states must change the block's value.
    model = Mamba2Layer()
    spec = model.spec(1, 16, PAGE)
    names = ["model.layers.3.mixer_a", "model.layers.3.mixer_b"]
    config, caches = build_caches([KVCacheGroupSpec(names, spec)], NUM_BLOCKS)
    for i, name in enumerate(names):
        data = model.local_page(i, TOKENS, 1, 0)
        caches[name][BLOCK, 0, 0].view(torch.uint8)[:len(data)].copy_(
            torch.frombuffer(bytearray(data), dtype=torch.uint8))
    worker = KVChecksumWorker(config, caches, tp_rank=0, tp_size=1, model_kv_heads=None)
    assert not worker.skipped_groups, worker.skipped_groups
    firsts = sorted(c.first_head for c in worker.plans[0].caches)
    assert len(set(firsts)) == len(firsts) == 8  # 4 segments per layer, none shared

    def value():
        blocks = KVChecksumBlocks(TOKENS, {0: GroupBlocks(0, (BLOCK,))})
        return int(worker.compute({"r": blocks}, replica_zero_only=True).records[0].requests["r"][0].partials[(1, 0)][0])

    before = value()
    a, b = (caches[n][BLOCK, 0, 0].view(torch.uint8) for n in names)
    saved = a.clone()
    a.copy_(b)
    b.copy_(saved)
    assert value() != before
