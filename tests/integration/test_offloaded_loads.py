"""KV loaded back from offloading is checked against the checksums stored with it.

Real vLLM Schedulers and KVChecksumWorkers (pd_harness), with a host-store
offloading connector (offload_harness): instance A computes a prompt and
offloads its full blocks with their entries; instance B, with an empty cache,
loads them back asynchronously, and its scheduler checks them per block.
"""

from __future__ import annotations

import logging

import pytest
import torch
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from offload_harness import (STORE, host_connector, load_prompt, load_prompt_sync, make_offload_side, perform_loads,
                             store_prompt)
from pd_harness import ReportingConnector, forward_of, make_config, make_request, prompt_of, runner_step, stats
from vllm.v1.kv_cache_interface import KVCacheConfig

from vllm_kvchecksum.offload import BlockChecksumRun

BS = 16
PROMPT = BS * 5 + 3  # 5 full blocks, then 3 tokens computed locally
FULL = PROMPT // BS


@pytest.fixture(autouse=True)
def _empty_store():
    STORE.clear()
    yield
    STORE.clear()


def _corrupt_store_kv(hashes, position: int, worker: int = 0):
    value = STORE[hashes[position]][worker]
    layer = sorted(value.kv)[0]
    value.kv[layer].view(torch.uint8)[0, 1, 2] ^= 0x08


def _corrupt_store_entry(hashes, position: int, worker: int = 0):
    STORE[hashes[position]][worker].entries[0] ^= 1 << 40


@pytest.mark.parametrize("tp", [1, 2])
def test_intact_offloaded_kv_is_verified(tp, logs):
    A, B = make_offload_side(tp=tp), make_offload_side(tp=tp)
    prompt = prompt_of(PROMPT)
    hashes = store_prompt(A, prompt)
    assert len(hashes) == FULL and all(len(STORE[h]) == tp for h in hashes)
    result = load_prompt(B, prompt)
    assert stats(B) == {"verified": 1, "offloaded_verified": 1}, logs.text
    assert result.failures == []
    assert result.next_scheduled == PROMPT - FULL * BS  # the rest of the prompt, computed
    assert B.reported_metrics == {"offloaded_loads_verified": 1}
    assert "group 0 verified (5 blocks compared)" in logs.text


CORRUPTIONS = {
    "kv_bit": lambda hashes: _corrupt_store_kv(hashes, 2),
    "entry": lambda hashes: _corrupt_store_entry(hashes, 3),
    "kv_bit_rank1": lambda hashes: _corrupt_store_kv(hashes, 1, worker=1),
}
BAD_POSITION = {"kv_bit": 2, "entry": 3, "kv_bit_rank1": 1}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_corrupted_store_value_fails_the_load_and_is_dropped(kind, policy, logs):
    tp = 2 if kind == "kv_bit_rank1" else 1
    A = make_offload_side(tp=tp)
    B = make_offload_side(tp=tp, fail_closed=True, policy=policy)
    prompt = prompt_of(PROMPT)
    hashes = store_prompt(A, prompt)
    CORRUPTIONS[kind](hashes)
    result = load_prompt(B, prompt)
    bad = BAD_POSITION[kind]
    assert stats(B) == {"mismatch": 1, "offloaded_mismatch": 1}, logs.text
    assert result.failures == [(result.request.request_id, {0: (bad,)})]
    assert hashes[bad] not in STORE and all(h in STORE for i, h in enumerate(hashes) if i != bad)
    assert f"KV checksum mismatch for request {result.request.request_id!r} (offloaded KV loaded back): " \
           f"group 0 differs at block positions {bad}" in logs.text
    assert B.reported_metrics["offloaded_loads_mismatched"] == 1
    assert B.reported_metrics["offloaded_mismatched_blocks"] == 1
    out = result.outputs.get(result.request.request_id)
    if policy == "fail":
        assert out.finish_reason.name == "ERROR" and result.request.is_finished()
        assert out.stop_reason.startswith("kv_checksum_mismatch: the KV loaded back from the offloaded KV cache")
    else:
        # Retried: the store no longer has the bad block, so the retry loads
        # the blocks before it (checked again) and computes the rest.
        req = result.request
        assert not req.is_finished() and result.next_scheduled == 0
        assert req.status.name == "WAITING_FOR_REMOTE_KVS"
        assert host_connector(B).pending_loads[req.request_id].num_blocks == bad
        _, outputs = B.step(finished_recving=set(perform_loads(B)))
        assert stats(B) == {"mismatch": 1, "offloaded_mismatch": 1, "verified": 1, "offloaded_verified": 1}
        out, _ = B.step(forward=forward_of(B, req))
        assert out.num_scheduled_tokens[req.request_id] == PROMPT - bad * BS


def test_corrupted_store_value_fail_open_is_logged_used_and_dropped(logs):
    A, B = make_offload_side(), make_offload_side()
    prompt = prompt_of(PROMPT)
    hashes = store_prompt(A, prompt)
    _corrupt_store_kv(hashes, 4)
    result = load_prompt(B, prompt)
    assert stats(B) == {"mismatch": 1, "offloaded_mismatch": 1}
    assert any(r.levelno == logging.ERROR and "offloaded KV loaded back" in r.getMessage() for r in logs.records)
    assert result.next_scheduled == PROMPT - FULL * BS  # used (fail-open)
    assert result.failures == [(result.request.request_id, {0: (4,)})]  # and dropped from the store
    assert hashes[4] not in STORE


def test_another_prefixs_intact_value_fails_by_its_tag(logs):
    """The store holds, under this prompt's hashes, intact values stored for
    the same positions of another prompt (a misplaced or late-written value).
    Each one checksums to its own entry; only the tag tells them apart."""
    A, B = make_offload_side(), make_offload_side(fail_closed=True)
    prompt, other = prompt_of(PROMPT), prompt_of(PROMPT, seed=5)
    mine = store_prompt(A, prompt)
    STORE.clear()
    store_prompt(A, other, block_hashes=mine)  # other's KV and entries, under prompt's keys
    result = load_prompt(B, prompt)
    assert stats(B) == {"mismatch": 1, "offloaded_mismatch": 1}, logs.text
    assert result.failures == [(result.request.request_id, {0: tuple(range(FULL))})]


def test_another_models_value_fails_by_its_fingerprint(logs):
    """A value stored by a model whose group fingerprint differs (other layer
    names or dtypes, same cache shape) fails though its KV is this prompt's."""
    A, B = make_offload_side(), make_offload_side(fail_closed=True)
    for w in A.workers:
        w.checksums.fingerprints[0] ^= 0x5A5A
    prompt = prompt_of(PROMPT)
    store_prompt(A, prompt)
    result = load_prompt(B, prompt)
    assert stats(B) == {"mismatch": 1, "offloaded_mismatch": 1}, logs.text
    assert result.failures == [(result.request.request_id, {0: tuple(range(FULL))})]


def test_a_value_moved_to_another_position_fails(logs):
    A, B = make_offload_side(), make_offload_side(fail_closed=True)
    prompt = prompt_of(PROMPT)
    hashes = store_prompt(A, prompt)
    STORE[hashes[1]], STORE[hashes[3]] = STORE[hashes[3]], STORE[hashes[1]]
    result = load_prompt(B, prompt)
    assert stats(B) == {"mismatch": 1, "offloaded_mismatch": 1}, logs.text
    assert result.failures == [(result.request.request_id, {0: (1, 3)})]


def test_groups_not_covered_are_not_checked(logs):
    """Entries are kept for group 0 only: group 1 (sliding window) is not
    checked, so its corruption passes; group 0's is caught."""
    kw = dict(sliding_window=48, covered=(0,))
    A, B = make_offload_side(**kw), make_offload_side(fail_closed=True, **kw)
    assert B.workers[0].checksums.offload_groups == {0}
    prompt = prompt_of(PROMPT)
    hashes = store_prompt(A, prompt)
    value = STORE[hashes[4]][0]
    group1_layer = "model.layers.1.self_attn.attn"
    value.kv[group1_layer].view(torch.uint8)[0, 0, 0] ^= 0x01
    result = load_prompt(B, prompt)
    assert stats(B) == {"verified": 1, "offloaded_verified": 1}, logs.text
    assert "group 1" not in logs.text.split("offloaded KV loaded back")[-1].splitlines()[0]
    STORE.clear()
    hashes = store_prompt(A, prompt_of(PROMPT, seed=3))
    _corrupt_store_kv(hashes, 0)  # a group 0 layer (sorted first: layers.0)
    result = load_prompt(B, prompt_of(PROMPT, seed=3))
    assert result.failures == [(result.request.request_id, {0: (0,)})]


@pytest.mark.parametrize("sources", [(), (CacheHitSource.DISK,)])
def test_tier_without_checksums_is_not_checked(sources, logs):
    """A load from a tier whose loads bring no checksums back is not checked
    (and, when the connector has other tiers that do, counted as such)."""
    A, B = make_offload_side(), make_offload_side(fail_closed=True)
    host_connector(B).sources = set(sources)
    prompt = prompt_of(PROMPT)
    hashes = store_prompt(A, prompt)
    _corrupt_store_kv(hashes, 2)
    result = load_prompt(B, prompt)
    assert stats(B) == {}
    assert result.next_scheduled == PROMPT - FULL * BS
    expected = {"offloaded_loads_not_checked/tier_not_covered": 1} if sources else {}
    assert dict(B.reported_metrics) == expected


def test_multi_connector_routes_to_the_connector_serving_the_load(logs):
    """MultiConnector asks the child that serves the load which tiers bring
    checksums back, and tells that child of a failure; another child that
    reports the same tier is not asked."""
    A = make_offload_side()
    B = make_offload_side(fail_closed=True, multi=1)
    serving, other = B.scheduler.connector._connectors
    prompt = prompt_of(PROMPT)
    hashes = store_prompt(A, prompt)
    _corrupt_store_kv(hashes, 2)
    result = load_prompt(B, prompt)
    assert stats(B) == {"mismatch": 1, "offloaded_mismatch": 1}, logs.text
    assert serving.failures == [(result.request.request_id, {0: (2,)})] and other.failures == []
    # The serving child brings no checksums back: not checked, though the
    # other child would say its (same) tier does.
    serving.sources = set()
    STORE.clear()
    store_prompt(A, prompt_of(PROMPT, seed=9))
    load_prompt(B, prompt_of(PROMPT, seed=9))
    assert stats(B) == {"mismatch": 1, "offloaded_mismatch": 1}


def test_multi_connector_hands_the_checksum_worker_to_every_connector():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    child = dict(kv_connector="HostOffloadConnector", kv_connector_module_path="offload_harness", kv_role="kv_both")
    config = make_config("kv_both", 1, 1, 16, connector_extra={"connectors": [child, child]})
    seen = []

    class Worker:
        pass

    connector = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[]))
    assert isinstance(connector, MultiConnector)
    for c in connector._connectors:
        c.set_kv_checksum_worker = lambda w, c=c: seen.append((c, w))
    worker = Worker()
    connector.set_kv_checksum_worker(worker)
    assert [w for _, w in seen] == [worker, worker]
    assert {id(c) for c, _ in seen} == {id(c) for c in connector._connectors}


# -- synchronous loads (the step that schedules a load also uses it) ----------


def test_intact_sync_load_is_verified_in_its_step(logs):
    A, B = make_offload_side(), make_offload_side(fail_closed=True)
    prompt = prompt_of(PROMPT)
    store_prompt(A, prompt)
    req, outputs, out = load_prompt_sync(B, prompt)
    assert out.num_scheduled_tokens[req.request_id] == PROMPT - FULL * BS  # loaded, and run in the same step
    assert out.kv_checksum_scheduled.reqs_loaded[req.request_id].offloaded
    assert stats(B) == {"verified": 1, "offloaded_verified": 1}, logs.text
    assert outputs[req.request_id].new_token_ids  # the step's output is kept


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_corrupted_sync_load_is_rolled_back(policy, logs):
    A, B = make_offload_side(), make_offload_side(fail_closed=True, policy=policy)
    prompt = prompt_of(PROMPT)
    hashes = store_prompt(A, prompt)
    _corrupt_store_kv(hashes, 3)
    req, outputs, out = load_prompt_sync(B, prompt)
    assert stats(B) == {"mismatch": 1, "offloaded_mismatch": 1}, logs.text
    assert host_connector(B).failures == [(req.request_id, {0: (3,)})]
    assert hashes[3] not in STORE
    if policy == "fail":
        assert req.is_finished() and outputs[req.request_id].finish_reason.name == "ERROR"
        assert req.stop_reason.startswith("kv_checksum_mismatch: the KV loaded back from the offloaded KV cache")
    else:
        # The step's output is dropped and the request resumes from the bad block.
        assert not req.is_finished()
        assert req.request_id not in outputs or not outputs[req.request_id].new_token_ids
        assert req.num_computed_tokens == 3 * BS
        nxt, _ = B.step(forward=forward_of(B, req))
        assert nxt.num_scheduled_tokens[req.request_id] == PROMPT - 3 * BS


def test_corrupted_sync_load_fail_open_is_logged_and_used(logs):
    A, B = make_offload_side(), make_offload_side()
    prompt = prompt_of(PROMPT)
    hashes = store_prompt(A, prompt)
    _corrupt_store_kv(hashes, 0)
    req, outputs, out = load_prompt_sync(B, prompt)
    assert stats(B) == {"mismatch": 1, "offloaded_mismatch": 1}
    assert outputs[req.request_id].new_token_ids  # used
    assert host_connector(B).failures == [(req.request_id, {0: (0,)})]


def test_sync_loads_with_several_groups_are_not_checked_and_say_so(logs):
    kw = dict(sliding_window=48, covered=(0, 1))
    A, B = make_offload_side(**kw), make_offload_side(fail_closed=True, **kw)
    prompt = prompt_of(PROMPT)
    hashes = store_prompt(A, prompt)
    _corrupt_store_kv(hashes, 0)
    req, outputs, out = load_prompt_sync(B, prompt)
    assert stats(B) == {}
    assert dict(B.reported_metrics) == {"offloaded_loads_not_checked/sync_load": 1}
    assert "synchronous loads of offloaded KV" in logs.text and "not checked with 2 KV cache groups" in logs.text


def test_sync_load_is_judged_with_its_own_steps_output(logs):
    """With a batch queue (async scheduling, PP) the next step is scheduled
    before this step's update: its synchronous load waits for its own
    step's records instead of being judged (unverified) early."""
    A, B = make_offload_side(), make_offload_side(fail_closed=True, policy="recompute")
    prompt = prompt_of(PROMPT)
    store_prompt(A, prompt)
    host_connector(B).load_async = False
    other = make_request(prompt_of(40, seed=4), block_size=BS, max_tokens=4)
    B.scheduler.add_request(other)
    out_n = B.scheduler.schedule()
    forward_of(B, other)(out_n)
    req = make_request(prompt, block_size=BS, max_tokens=2)
    B.scheduler.add_request(req)
    out_next = B.scheduler.schedule()  # step N+1, before step N's update
    assert req.request_id in out_next.kv_checksum_scheduled.reqs_loaded
    perform_loads(B)
    forward_of(B, req)(out_next)
    B.update(out_n, B.run_workers(out_n))
    assert stats(B) == {} and req.num_computed_tokens == PROMPT  # not judged, not rolled back
    B.update(out_next, B.run_workers(out_next))
    assert stats(B) == {"verified": 1, "offloaded_verified": 1}, logs.text


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_sync_load_is_checksummed_before_a_save_can_refill_its_entries(runner, logs):
    """A second request of the same step hits the synchronously loaded blocks
    in the prefix cache and saves them (refilling their entries from the
    loaded, corrupt KV) in wait_for_save: the model runners checksum the
    load, entries included, before that, so the corruption is still found."""
    A, B = make_offload_side(), make_offload_side(fail_closed=True, policy="recompute")
    prompt = prompt_of(PROMPT)
    hashes = store_prompt(A, prompt)
    _corrupt_store_kv(hashes, 2)
    host_connector(B).load_async = False
    r1 = make_request(prompt, block_size=BS, max_tokens=2)
    r2 = make_request(prompt + [5, 6, 7], block_size=BS, max_tokens=2)
    B.scheduler.add_request(r1)
    B.scheduler.add_request(r2)
    worker = B.workers[0]
    connector = ReportingConnector(B.scheduler.vllm_config, B.scheduler.kv_cache_config)
    connector.start_load_kv = lambda forward_context, **kw: perform_loads(B)

    def save_r2():  # what a store connector's wait_for_save does for r2's first save
        ids = B.scheduler.kv_cache_manager.get_block_ids(r2.request_id)[0][:FULL]
        assert ids == B.scheduler.kv_cache_manager.get_block_ids(r1.request_id)[0][:FULL]
        worker.checksums.save_block_checksums([BlockChecksumRun(0, 0, ids, r2.block_hashes[:FULL])])

    connector.wait_for_save = save_r2
    runner_step(B, runner, connector=connector)
    assert stats(B) == {"mismatch": 1, "offloaded_mismatch": 1}, logs.text
    assert host_connector(B).failures == [(r1.request_id, {0: (2,)})]


def test_loads_of_groups_without_entries_are_not_checked_nor_failed(logs):
    """Workers that keep no entries for the loaded groups (e.g. the planner
    skipped them) leave the load unchecked, counted and logged once; failing
    it would fail every load, and a retry would load the same blocks."""
    A = make_offload_side()
    B = make_offload_side(fail_closed=True, policy="recompute", covered=())
    prompt = prompt_of(PROMPT)
    store_prompt(A, prompt)
    result = load_prompt(B, prompt)
    assert stats(B) == {} and result.failures == []
    assert result.next_scheduled == PROMPT - FULL * BS  # used, not retried
    assert dict(B.reported_metrics) == {"offloaded_loads_not_checked/no_groups": 1}
    assert "keep no checksum entries for the loaded KV cache groups" in logs.text


def test_unverified_offloaded_load_fail_closed_drops_its_blocks(logs):
    """Rank 1 keeps no entries of group 0 while rank 0 does: the load is
    unverified. Under fail-closed its blocks are dropped from the store too,
    so the retry computes them instead of loading them again."""
    A = make_offload_side(tp=2)
    B = make_offload_side(tp=2, fail_closed=True, policy="recompute")
    B.workers[1].checksums.offload_groups = frozenset()
    prompt = prompt_of(PROMPT)
    hashes = store_prompt(A, prompt)
    result = load_prompt(B, prompt)
    assert stats(B) == {"unverified": 1, "offloaded_unverified": 1}, logs.text
    assert result.failures == [(result.request.request_id, {0: tuple(range(FULL))})]
    assert not any(h in STORE for h in hashes)
    assert result.next_scheduled == PROMPT  # recomputed: nothing left to load
