"""How a worker plans Mamba state in the cases test_mamba_worker does not cover.

Real KVChecksumWorkers over caches from vLLM's allocate_kv_cache (kv_setup),
the Mamba2 layers of hybrid_harness, as in test_mamba_worker: splits whose
replicas do not divide the TP size, a state every TP rank holds whole
(MambaSpec.tp_replicated) without a described split, several layers of one
module without a described split, and a PP stage that holds none of a state
group's layers.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from hybrid_harness import Mamba2Layer, mamba_layer_name
from kv_setup import build_caches
from test_mamba_worker import BLOCK, LAYERS, MAMBA_GID, NUM_BLOCKS, PAGE, TOKENS, Rank, consumer_checks, producer_value
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

from vllm_kvchecksum.core.records import GroupBlocks, KVChecksumBlocks
from vllm_kvchecksum.engine.worker import KVChecksumWorker


def test_split_whose_replicas_do_not_divide_the_tp_size_skips_the_group():
    """B and C said to be held whole by 4 ranks at TP 2: the ranks' rows
    cannot be numbered (a segment's global size is local * tp / replicas),
    so the group is skipped rather than checksummed with made-up rows."""
    model = Mamba2Layer(n_groups=1)
    spec = model.spec(2, 16, PAGE)
    conv = spec.state_splits[0]
    (x, _), (b, _), (c, _) = conv.segments
    bad = replace(spec, state_splits=(replace(conv, segments=((x, 1), (b, 4), (c, 4))), spec.state_splits[1]))
    for rank in range(2):
        worker = Rank(model, 2, rank, spec=bad).worker
        assert MAMBA_GID in worker.skipped_groups, worker.skipped_groups
        assert "do not match state shape" in worker.skipped_groups[MAMBA_GID]
        assert "at TP size 2" in worker.skipped_groups[MAMBA_GID]
    # The same segments with replicas 2 (every rank of TP 2) are planned.
    assert not Rank(model, 2, 0, spec=spec).worker.skipped_groups


def replicated_ranks(tp: int) -> list[Rank]:
    """Ranks of a layer whose state every rank holds whole, without a described split."""
    model = Mamba2Layer(n_groups=1)
    spec = replace(model.spec(1, 16, PAGE), state_splits=None, tp_replicated=True)
    ranks = [Rank(model, tp, r, spec=spec, write=False) for r in range(tp)]
    for r in ranks:
        for layer in LAYERS:
            data = model.local_page(layer, TOKENS, 1, 0)  # the whole (TP=1) state, on every rank
            r.page(layer)[:len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    return ranks


def test_state_every_rank_holds_whole_is_checked_per_replica_at_any_tp():
    """MambaSpec.tp_replicated without a split: each rank holds the TP=1
    state, so the producer's value does not depend on the TP size, and a
    consumer at TP 2 checks each rank's copy against it."""
    one, two = replicated_ranks(1), replicated_ranks(2)
    assert all(r.worker.tp_local_groups == frozenset() for r in one + two)
    expected = producer_value(one)
    assert producer_value(two) == expected
    assert consumer_checks(two) == [expected, expected]
    two[1].page()[5] ^= 0x10  # rank 1's copy only
    checks = consumer_checks(two)
    assert checks[0] == expected and checks[1] != expected


def unsplit_module_ranks(tp: int) -> list[tuple[KVChecksumWorker, dict]]:
    """TP ranks of two Mamba layers of one module (layer number 3) whose
    spec describes no split: each rank checksums its own shard's bytes."""
    model = Mamba2Layer(split=False)
    spec = model.spec(tp, 16, PAGE)
    names = ["model.layers.3.mixer_a", "model.layers.3.mixer_b"]
    out = []
    for rank in range(tp):
        config, caches = build_caches([KVCacheGroupSpec(names, spec)], NUM_BLOCKS, seed=rank)
        for i, name in enumerate(names):
            data = model.local_page(i, TOKENS, tp, rank)
            caches[name][BLOCK, 0, 0].view(torch.uint8)[:len(data)].copy_(
                torch.frombuffer(bytearray(data), dtype=torch.uint8))
        out.append((KVChecksumWorker(config, caches, tp_rank=rank, tp_size=tp, model_kv_heads=None), caches))
    return out


def module_value(ranks) -> int:
    blocks = KVChecksumBlocks(TOKENS, {0: GroupBlocks(0, (BLOCK,))})
    total = 0
    for worker, _ in ranks:
        record, = worker.compute({"r": blocks}, replica_zero_only=True).finalize()
        total += sum(int(v[0]) for v in record.requests["r"][0].partials.values())
    return total % 2**64


def test_unsplit_layers_of_one_module_number_every_ranks_row_apart():
    """Without a split each rank's shard is one row of its layer, numbered
    by rank: the module's second layer starts after the first layer's rows
    of every rank. So moving rank 1's state of one layer into rank 0's slot
    of the other (a transfer mixing up ranks and layers) changes the sum."""
    ranks = unsplit_module_ranks(2)
    assert all(not w.skipped_groups and w.tp_local_groups == {0} for w, _ in ranks)
    rows = [c.first_head for w, _ in ranks for c in w.plans[0].caches]
    assert sorted(rows) == [0, 1, 2, 3]
    before = module_value(ranks)
    (_, caches0), (_, caches1) = ranks
    a1 = caches1["model.layers.3.mixer_a"][BLOCK, 0, 0].view(torch.uint8)
    b0 = caches0["model.layers.3.mixer_b"][BLOCK, 0, 0].view(torch.uint8)
    saved = a1.clone()
    a1.copy_(b0)
    b0.copy_(saved)
    assert module_value(ranks) != before


def test_pp_stage_without_the_groups_layers_does_not_make_it_tp_local():
    """A PP stage holding none of a state group's layers has no layer whose
    checksum depends on the TP size: it must not report the group TP-local
    (the scheduler takes the union of the workers' reports, so one such
    stage would leave a TP-split state out of every comparison between TP
    sizes)."""
    model = Mamba2Layer()
    attention = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    groups = [KVCacheGroupSpec(["model.layers.0.self_attn.attn"], attention),
              KVCacheGroupSpec([], model.spec(2, 16, PAGE))]
    config, caches = build_caches(groups, NUM_BLOCKS)
    worker = KVChecksumWorker(config, caches, tp_rank=0, tp_size=2, pp_rank=1, pp_size=2, model_kv_heads=4)
    assert MAMBA_GID not in worker.skipped_groups, worker.skipped_groups
    assert worker.tp_local_groups == frozenset()
    # The stage that holds the layers (split): not TP-local either; unsplit: TP-local.
    assert Rank(model, 2, 0).worker.tp_local_groups == frozenset()
    assert Rank(Mamba2Layer(split=False), 2, 0).worker.tp_local_groups == {MAMBA_GID}
    assert mamba_layer_name(LAYERS[0]) not in caches
