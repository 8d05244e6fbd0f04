"""KVChecksumWorker on real vLLM KV cache views (CPU), against the NumPy reference."""

from __future__ import annotations

import logging
import pickle
import threading

import pytest
import torch
from kv_setup import build_caches
from reference import MOD, layer_checksums
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheGroupSpec, MambaSpec, MLAAttentionSpec,
                                        UniformTypeKVCacheSpecs)
from vllm.v1.kv_cache_layout import KVCacheLayout

from vllm_kvchecksum.engine import group_plan
from vllm_kvchecksum.core.records import GroupBlocks, KVChecksumBlocks, KVChecksumOutput
from vllm_kvchecksum.engine.worker import KVChecksumWorker

BS = 16
NUM_BLOCKS = 8
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]


def attn(heads=4, head_size=8, dtype=torch.bfloat16, **kw):
    return FullAttentionSpec(block_size=BS, num_kv_heads=heads, head_size=head_size, dtype=dtype, **kw)


def mla(heads=1, head_size=16, **kw):
    return MLAAttentionSpec(block_size=BS, num_kv_heads=heads, head_size=head_size, dtype=torch.bfloat16, **kw)


def worker(config, caches, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, model_kv_heads=None):
    return KVChecksumWorker(config, caches, tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size,
                            model_kv_heads=model_kv_heads)


def blocks(num_tokens, groups):
    return KVChecksumBlocks(num_tokens, {g: GroupBlocks(start, tuple(ids)) for g, (start, ids) in groups.items()})


REQ = {"r": blocks(3 * BS + 5, {0: (0, [5, 2, 7, 1])})}


def values(outputs, req="r", gid=0, check=None):
    """Scheduler-style sum of the workers' partials of one request and group.

    check=None sums every partial once per key (what a single-copy model has);
    check=k sums copy k % R of every layer replicated R times.
    """
    total = None
    for out in outputs:
        for rec in out.finalize():
            g = rec.requests[req].get(gid)
            if g is None:
                continue
            for (replicas, index), vals in g.partials.items():
                if check is not None and index != check % replicas:
                    continue
                total = vals.copy() if total is None else total + vals
    return [int(v) for v in total]


def reference(caches, names, req=REQ["r"], gid=0, first_heads=None, layout="HND"):
    g = req.groups[gid]
    total = [0] * len(g.block_ids)
    for i, name in enumerate(names):
        layer = group_plan.layer_number(name)[0]
        head = (first_heads or {}).get(name, 0)
        vals = layer_checksums(caches[name], g.block_ids, req.num_tokens, first_block_position=g.start,
                               layer=layer, first_head=head, block_size=BS)
        total = [(a + b) % MOD for a, b in zip(total, vals)]
    return total


def shard(caches_tp1, spec_of, tp_size, model_heads, groups_of, layout=KVCacheLayout.LBHNC):
    """Per-rank configs and caches holding each rank's heads of the TP1 caches."""
    ranks = []
    for rank in range(tp_size):
        groups = groups_of(rank)
        config, caches = build_caches(groups, NUM_BLOCKS, layout, seed=100 + rank)
        for name, cache in caches.items():
            spec = spec_of(name)
            total = caches_tp1[name].shape[1]
            local = cache.shape[1]
            if isinstance(spec, MLAAttentionSpec) or local == total:
                first = 0
            else:
                replicas = max(1, tp_size // total)
                first = (rank // replicas) * local
            cache.copy_(caches_tp1[name][:, first:first + local])
        ranks.append((config, caches))
    return ranks


def test_tp1_matches_reference_all_layouts_and_kernel_splits():
    groups = [KVCacheGroupSpec(LAYERS, attn())]
    config, base = build_caches(groups, NUM_BLOCKS, KVCacheLayout.LBHNC)
    expected = reference(base, LAYERS)
    assert values([worker(config, base).compute(REQ, replica_zero_only=True)]) == expected
    for layout, kernel in [(KVCacheLayout.LBNHC, None), (KVCacheLayout.BLHNC, None), (KVCacheLayout.LBHNC, [8]),
                           (KVCacheLayout.LBNHC, [4])]:
        cfg, caches = build_caches(groups, NUM_BLOCKS, layout, kernel_block_sizes=kernel)
        for name in LAYERS:
            if kernel:
                kb = BS // kernel[0]
                caches[name].unflatten(0, (NUM_BLOCKS, kb)).copy_(
                    base[name].unflatten(2, (kb, kernel[0])).permute(0, 2, 1, 3, 4))
            else:
                caches[name].copy_(base[name])
        got = values([worker(cfg, caches).compute(REQ, replica_zero_only=True)])
        assert got == expected, (layout, kernel)


def test_tp2_shards_and_pp2_stages_sum_to_tp1():
    groups = [KVCacheGroupSpec(LAYERS, attn(heads=4))]
    config, base = build_caches(groups, NUM_BLOCKS)
    expected = values([worker(config, base).compute(REQ, replica_zero_only=True)])
    assert expected == reference(base, LAYERS)
    ranks = shard(base, lambda n: attn(), 2, 4, lambda r: [KVCacheGroupSpec(LAYERS, attn(heads=2))])
    outs = [worker(c, k, tp_rank=r, tp_size=2, model_kv_heads=4).compute(REQ, replica_zero_only=True)
            for r, (c, k) in enumerate(ranks)]
    assert values(outs) == expected
    # Each rank alone is not the whole (the ranks' heads are numbered globally).
    assert values(outs[:1]) != expected
    stages = []
    for stage, names in enumerate([LAYERS[:2], LAYERS[2:]]):
        cfg, caches = build_caches([KVCacheGroupSpec(names, attn(heads=4))], NUM_BLOCKS, seed=7 + stage)
        for name in names:
            caches[name].copy_(base[name])
        stages.append(worker(cfg, caches, pp_rank=stage, pp_size=2))
    assert values([s.compute(REQ, replica_zero_only=True) for s in stages]) == expected
    fp = worker(config, base).fingerprints[0]
    assert (stages[0].fingerprints[0] + stages[1].fingerprints[0]) % MOD == fp


def test_gqa_replicas_counted_once_per_check():
    # 2 KV heads at TP4: each head on two consecutive ranks.
    groups = [KVCacheGroupSpec(LAYERS[:2], attn(heads=2))]
    config, base = build_caches(groups, NUM_BLOCKS)
    expected = reference(base, LAYERS[:2])
    ranks = shard(base, lambda n: attn(heads=2), 4, 2, lambda r: [KVCacheGroupSpec(LAYERS[:2], attn(heads=1))])
    workers = [worker(c, k, tp_rank=r, tp_size=4, model_kv_heads=2) for r, (c, k) in enumerate(ranks)]
    assert [w.plans[0].caches[0].key for w in workers] == [(2, 0), (2, 1), (2, 0), (2, 1)]
    assert [w.plans[0].caches[0].first_head for w in workers] == [0, 0, 1, 1]
    producer = [w.compute(REQ, replica_zero_only=True) for w in workers]
    assert values(producer) == expected
    consumer = [w.compute(REQ, replica_zero_only=False) for w in workers]
    for check in range(2):
        assert values(consumer, check=check) == expected
    # A corrupted copy fails only the check that contains it.
    ranks[3][1][LAYERS[0]].view(torch.uint8)[2, 0, 1, 0] ^= 1
    consumer = [w.compute(REQ, replica_zero_only=False) for w in workers]
    assert values(consumer, check=0) == expected
    assert values(consumer, check=1) != expected


def test_one_head_per_rank_needs_the_model_head_count():
    ranks = [build_caches([KVCacheGroupSpec(LAYERS[:1], attn(heads=1))], NUM_BLOCKS, seed=r) for r in range(2)]
    w = worker(*ranks[0], tp_rank=0, tp_size=2, model_kv_heads=None)
    assert "unknown TP replication" in w.skipped_groups[0]
    assert worker(*ranks[0], tp_rank=0, tp_size=2, model_kv_heads=2).plans[0].caches[0].key == (1, 0)
    assert worker(*ranks[1], tp_rank=1, tp_size=2, model_kv_heads=1).plans[0].caches[0].key == (2, 1)
    assert "unknown TP replication" in worker(*ranks[0], tp_rank=0, tp_size=2, model_kv_heads=3).skipped_groups[0]


@pytest.mark.parametrize("max_tp_shards", [1, None])
@pytest.mark.parametrize("tp_size", [2, 4])
def test_mla_one_head_replicated_on_every_rank(max_tp_shards, tp_size):
    spec = mla(max_tp_shards=max_tp_shards)
    config, base = build_caches([KVCacheGroupSpec(LAYERS[:2], spec)], NUM_BLOCKS)
    expected = reference(base, LAYERS[:2])
    ranks = shard(base, lambda n: spec, tp_size, 1, lambda r: [KVCacheGroupSpec(LAYERS[:2], spec)])
    # Kimi-K3-like config: the model's KV head count (8) does not describe the MLA cache.
    workers = [worker(c, k, tp_rank=r, tp_size=tp_size, model_kv_heads=8) for r, (c, k) in enumerate(ranks)]
    assert [w.plans[0].caches[0].key for w in workers] == [(tp_size, r) for r in range(tp_size)]
    assert values([w.compute(REQ, replica_zero_only=True) for w in workers]) == expected
    consumer = [w.compute(REQ, replica_zero_only=False) for w in workers]
    for check in range(tp_size):
        assert values(consumer, check=check) == expected


@pytest.mark.parametrize("indexer_shards", [1, None])
def test_minimax_m3_layout(indexer_shards):
    """GQA of two heads next to a one-head indexer cache of the same layer module."""
    names = []
    for i in range(2):
        names += [f"model.layers.{i}.self_attn.attn", f"model.layers.{i}.self_attn.indexer"]

    def specs(gqa_heads):
        return UniformTypeKVCacheSpecs(block_size=BS, kv_cache_specs={
            n: (attn(heads=gqa_heads) if n.endswith(".attn") else mla(max_tp_shards=indexer_shards))
            for n in names})

    config, base = build_caches([KVCacheGroupSpec(names, specs(2))], NUM_BLOCKS)
    # TP1: the indexer (after "attn" in name order) takes the heads after the GQA's two.
    heads = {n: (0 if n.endswith(".attn") else 2) for n in names}
    expected = reference(base, names, first_heads=heads)
    tp1 = worker(config, base, model_kv_heads=2)
    assert values([tp1.compute(REQ, replica_zero_only=True)]) == expected
    for tp_size in (2, 4):
        ranks = shard(base, lambda n: attn(heads=2) if n.endswith(".attn") else mla(), tp_size, 2,
                      lambda r: [KVCacheGroupSpec(names, specs(1))])
        workers = [worker(c, k, tp_rank=r, tp_size=tp_size, model_kv_heads=2) for r, (c, k) in enumerate(ranks)]
        keys = {c.name.rsplit(".", 1)[1]: c.key for c in workers[-1].plans[0].caches}
        assert keys == {"attn": (tp_size // 2, tp_size // 2 - 1), "indexer": (tp_size, tp_size - 1)}
        assert values([w.compute(REQ, replica_zero_only=True) for w in workers]) == expected, tp_size
        consumer = [w.compute(REQ, replica_zero_only=False) for w in workers]
        for check in range(tp_size):
            assert values(consumer, check=check) == expected, (tp_size, check)
        assert sum(w.fingerprints[0] for w in workers[:1]) == tp1.fingerprints[0]


def test_two_caches_of_one_module_are_numbered_apart():
    names = ["model.layers.0.a", "model.layers.0.b"]
    config, caches = build_caches([KVCacheGroupSpec(names, attn(heads=2))], NUM_BLOCKS)
    w = worker(config, caches)
    assert [c.first_head for c in w.plans[0].caches] == [0, 2]
    got = values([w.compute(REQ, replica_zero_only=True)])
    assert got == reference(caches, names, first_heads={names[1]: 2})
    # Swapping the two caches' data changes the value.
    a, b = caches[names[0]].clone(), caches[names[1]].clone()
    caches[names[0]].copy_(b)
    caches[names[1]].copy_(a)
    assert values([w.compute(REQ, replica_zero_only=True)]) != got


def test_kv_sharing_alias_counted_once():
    names = LAYERS[:3]
    config, caches = build_caches([KVCacheGroupSpec(names, attn())], NUM_BLOCKS,
                                  aliases={LAYERS[2]: LAYERS[0]})
    w = worker(config, caches)
    assert [c.name for c in w.plans[0].caches] == LAYERS[:2]
    assert values([w.compute(REQ, replica_zero_only=True)]) == reference(caches, LAYERS[:2])


def test_slots_past_num_tokens_and_swaps():
    config, caches = build_caches([KVCacheGroupSpec(LAYERS[:2], attn())], NUM_BLOCKS)
    w = worker(config, caches)
    before = values([w.compute(REQ, replica_zero_only=True)])
    # Block 1 (last, position 3) holds 5 valid tokens; slot 5 onward is free.
    caches[LAYERS[0]][1, :, 5:].view(torch.uint8).fill_(0xAB)
    assert values([w.compute(REQ, replica_zero_only=True)]) == before
    caches[LAYERS[0]][1, :, 4].view(torch.uint8).add_(1)
    assert values([w.compute(REQ, replica_zero_only=True)]) != before
    # Swapped blocks: the same data at other positions checksums differently.
    swapped = {"r": blocks(REQ["r"].num_tokens, {0: (0, [2, 5, 7, 1])})}
    assert values([w.compute(swapped, replica_zero_only=True)])[:2] != before[:2]


def test_two_requests_two_groups_partial_blocks_odd_rows():
    groups = [KVCacheGroupSpec(LAYERS[:2], attn()), KVCacheGroupSpec(LAYERS[2:], attn(heads=2, head_size=16))]
    config, caches = build_caches(groups, NUM_BLOCKS)
    reqs = {
        "a": blocks(2 * BS + 3, {0: (1, [4, 6]), 1: (0, [1, 2, 3])}),   # first group: 2 rows from position 1
        "b": blocks(5 * BS + 9, {0: (4, [7, 3]), 1: (5, [0])}),         # ... 4 rows in all, second starts past
    }
    reqs["c"] = blocks(BS - 1, {0: (0, [0])})                           # 5 rows: odd
    w = worker(config, caches)
    out = w.compute(reqs, replica_zero_only=True)
    for rid, req in reqs.items():
        for gid, names in ((0, LAYERS[:2]), (1, LAYERS[2:])):
            if gid in req.groups:
                assert values([out], req=rid, gid=gid) == reference(caches, names, req=req, gid=gid), (rid, gid)
                assert out.finalize()[0].requests[rid][gid].start == req.groups[gid].start
            else:
                assert gid not in out.finalize()[0].requests[rid]


def test_the_pytorch_fallback_in_chunks_gives_the_same_values(monkeypatch):
    """The worker on the Numba pass (the default on CPU), and on the PyTorch
    path (where numba does not import) in small chunks, agree."""
    from vllm_kvchecksum.core import kernels
    from vllm_kvchecksum.core.kernels import numba_path, torch_path

    config, caches = build_caches([KVCacheGroupSpec(LAYERS, attn())], NUM_BLOCKS)
    calls = numba_path.call_count
    whole = values([worker(config, caches).compute(REQ, replica_zero_only=True)])
    assert numba_path.call_count > calls
    monkeypatch.setattr(kernels, "numba_available", lambda: False)
    monkeypatch.setattr(torch_path, "GATHER_CHUNK_BYTES", 1024)
    calls = numba_path.call_count
    assert values([worker(config, caches).compute(REQ, replica_zero_only=True)]) == whole
    assert numba_path.call_count == calls


def skip_cases():
    mamba = MambaSpec(block_size=BS, shapes=((4, 8),), dtypes=(torch.bfloat16,))
    return {
        "mamba": (KVCacheGroupSpec(["model.layers.9.mixer"], mamba), "not an int8 page view"),
        "compressed": (KVCacheGroupSpec(["model.layers.9.attn"], mla(tokens_per_state=4)), "compressed cache"),
        "head_slots": (KVCacheGroupSpec(["model.layers.9.attn"], attn(heads=2, num_head_slots=1,
                                                                      state_content_bytes=64)), "head slots"),
        "host": (KVCacheGroupSpec(["model.layers.9.attn"], attn(), host_resident=True), "host-resident"),
        "no_number": (KVCacheGroupSpec(["model.attn"], attn()), "single layer number"),
        "two_numbers": (KVCacheGroupSpec(["model.layers.9.experts.1.attn"], attn()), "single layer number"),
        "two_modules": (KVCacheGroupSpec(["model.layers.9.attn", "mtp.layers.9.attn"], attn()), "several modules"),
        "odd_cell": (KVCacheGroupSpec(["model.layers.9.attn"], attn(head_size=1, dtype=torch.float16)), "8"),
    }


@pytest.mark.parametrize("kind", list(skip_cases()))
def test_skipped_group_next_to_a_checksummed_one(kind, caplog):
    group, reason = skip_cases()[kind]
    groups = [KVCacheGroupSpec(LAYERS[:2], attn()), group]
    if kind in ("mamba", "host"):
        # Not allocatable as per-layer views here: hand the worker a cache of the right size.
        config, caches = build_caches(groups[:1], NUM_BLOCKS)
        config.kv_cache_groups.append(group)
        caches.update({n: torch.zeros(NUM_BLOCKS, 2, BS, 16, dtype=torch.bfloat16) for n in group.layer_names})
        config.__dict__.pop("transfer_group_ids", None)
    else:
        config, caches = build_caches(groups, NUM_BLOCKS)
    logger = logging.getLogger("vllm.kv_checksum")
    logger.addHandler(caplog.handler)  # vLLM's loggers do not propagate to the root
    try:
        w = worker(config, caches)
    finally:
        logger.removeHandler(caplog.handler)
    assert reason in w.skipped_groups[1]
    assert "group 1 is not checksummed" in caplog.text
    req = {"r": blocks(REQ["r"].num_tokens, {0: (0, [5, 2, 7, 1]), 1: (0, [5, 2, 7, 1])})}
    out = w.compute(req, replica_zero_only=True)
    rec = out.finalize()[0]
    assert rec.skipped_groups == {1: w.skipped_groups[1]}
    assert set(rec.requests["r"]) == {0}
    assert values([out]) == reference(caches, LAYERS[:2])


def test_structural_skips():
    config, caches = build_caches([KVCacheGroupSpec(LAYERS[:1], attn())], NUM_BLOCKS)
    name = LAYERS[0]
    cases = {
        "does not hold 8 blocks": caches[name][:-1],
        "do not tile": torch.zeros(NUM_BLOCKS // 2, 4, 2 * BS, 16, dtype=torch.bfloat16),
        "more than 65536 KV heads": torch.zeros(1, dtype=torch.bfloat16).expand(NUM_BLOCKS, 2**16 + 1, BS, 16),
        "8-byte": caches[name][..., :3],
    }
    for reason, tensor in cases.items():
        w = worker(config, {name: tensor}, model_kv_heads=4)
        assert reason in w.skipped_groups.get(0, ""), (reason, w.skipped_groups)


def test_records_pickle_aggregate_and_finalize_from_another_thread():
    config, caches = build_caches([KVCacheGroupSpec(LAYERS, attn())], NUM_BLOCKS)
    w = worker(config, caches)
    out = w.compute(REQ, replica_zero_only=True)
    assert not out.is_empty()
    done = []
    t = threading.Thread(target=lambda: done.append(out.finalize()))
    t.start()
    t.join()
    expected = reference(caches, LAYERS)
    assert values([out]) == expected
    clone = pickle.loads(pickle.dumps(w.compute(REQ, replica_zero_only=True)))
    assert values([clone]) == expected
    agg = KVChecksumOutput.aggregate([None, clone, KVChecksumOutput(), w.compute(REQ, replica_zero_only=True)])
    assert len(agg.records) == 2
    assert KVChecksumOutput.aggregate([None, KVChecksumOutput()]) is None
    # A request with no group on this worker is still listed, so it counts as reported.
    empty = w.compute({"x": blocks(10, {})}, replica_zero_only=True)
    assert empty.finalize()[0].requests == {"x": {}} and not empty.is_empty()


def test_rows_per_rank_numbering_is_caught(monkeypatch):
    """Guard: heads must be numbered globally; per-rank numbering breaks TP sums."""
    groups = [KVCacheGroupSpec(LAYERS[:1], attn(heads=4))]
    config, base = build_caches(groups, NUM_BLOCKS)
    expected = reference(base, LAYERS[:1])
    ranks = shard(base, lambda n: attn(), 2, 4, lambda r: [KVCacheGroupSpec(LAYERS[:1], attn(heads=2))])
    outs = [worker(c, k, tp_rank=r, tp_size=2, model_kv_heads=4).compute(REQ, replica_zero_only=True)
            for r, (c, k) in enumerate(ranks)]
    assert values(outs) == expected
    local = [worker(c, k, tp_rank=0, tp_size=2, model_kv_heads=4).compute(REQ, replica_zero_only=True)
             for c, k in ranks]
    assert values(local) != expected
