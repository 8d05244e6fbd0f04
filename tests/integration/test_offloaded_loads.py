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
from vllm.v1.request import RequestStatus
from offload_harness import (STORE, corrupt_store_kv, empty_store, host_connector, load_prompt,  # noqa: F401 (fixture)
                             load_prompt_sync, loading_forward, make_offload_side, perform_loads, store_prompt)
import pd_harness
from pd_harness import (ReportingConnector, forward_of, load, make_config, make_request, make_side, prompt_of, runner_step,
                        series_lacks_first_bad_block_rollback,
                        stats)
from vllm.v1.kv_cache_interface import KVCacheConfig

from vllm_kvchecksum.engine.offload import BlockChecksumRun

BS = 16
PROMPT = BS * 5 + 3  # 5 full blocks, then 3 tokens computed locally
FULL = PROMPT // BS




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
    "kv_bit": lambda hashes: corrupt_store_kv(hashes, 2),
    "entry": lambda hashes: _corrupt_store_entry(hashes, 3),
    "kv_bit_rank1": lambda hashes: corrupt_store_kv(hashes, 1, worker=1),
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
    elif not series_lacks_first_bad_block_rollback():
        # Recomputed from the bad block: the blocks before it compared equal
        # and stay; the bad one is gone from the store.
        req = result.request
        assert not req.is_finished() and result.next_scheduled == PROMPT - bad * BS
        assert B.reported_metrics["loads_recomputed/from_first_bad_block"] == 1
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
    corrupt_store_kv(hashes, 4)
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
    corrupt_store_kv(hashes, 0)  # a group 0 layer (sorted first: layers.0)
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
    corrupt_store_kv(hashes, 2)
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
    corrupt_store_kv(hashes, 2)
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
    corrupt_store_kv(hashes, 3)
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
    corrupt_store_kv(hashes, 0)
    req, outputs, out = load_prompt_sync(B, prompt)
    assert stats(B) == {"mismatch": 1, "offloaded_mismatch": 1}
    assert outputs[req.request_id].new_token_ids  # used
    assert host_connector(B).failures == [(req.request_id, {0: (0,)})]


def test_sync_loads_with_several_groups_are_not_checked_and_say_so(logs):
    kw = dict(sliding_window=48, covered=(0, 1))
    A, B = make_offload_side(**kw), make_offload_side(fail_closed=True, **kw)
    prompt = prompt_of(PROMPT)
    hashes = store_prompt(A, prompt)
    corrupt_store_kv(hashes, 0)
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
    # Held until its own step's update: its blocks, and the load in flight.
    assert B.reported_gauges == {"loads_in_flight": 1, "held_blocks": PROMPT // BS + 1}
    B.update(out_next, B.run_workers(out_next))
    assert stats(B) == {"verified": 1, "offloaded_verified": 1}, logs.text
    assert B.reported_gauges == {"loads_in_flight": 0, "held_blocks": 0}


@pytest.mark.parametrize("runner", pd_harness.MODEL_RUNNERS)
def test_sync_load_is_checksummed_before_a_save_can_refill_its_entries(runner, logs):
    """A save in the step of a synchronous load refills the entries of the
    loaded blocks from the loaded, corrupt KV in wait_for_save: the model
    runners checksum the load, entries included, before that, so the
    corruption is still found. (A second request of the step no longer hits
    the loaded blocks before their verdict, so it loads, and fails, its own.)"""
    A, B = make_offload_side(), make_offload_side(fail_closed=True, policy="recompute")
    prompt = prompt_of(PROMPT)
    hashes = store_prompt(A, prompt)
    corrupt_store_kv(hashes, 2)
    host_connector(B).load_async = False
    r1 = make_request(prompt, block_size=BS, max_tokens=2)
    r2 = make_request(prompt + [5, 6, 7], block_size=BS, max_tokens=2)
    B.scheduler.add_request(r1)
    B.scheduler.add_request(r2)
    worker = B.workers[0]
    connector = ReportingConnector(B.scheduler.vllm_config, B.scheduler.kv_cache_config)
    connector.start_load_kv = lambda forward_context, **kw: perform_loads(B)

    def save_r1_blocks():  # a store connector's wait_for_save saving the loaded blocks in the same step
        ids = B.scheduler.kv_cache_manager.get_block_ids(r1.request_id)[0][:FULL]
        assert not set(ids) & set(B.scheduler.kv_cache_manager.get_block_ids(r2.request_id)[0])
        worker.checksums.save_block_checksums([BlockChecksumRun(0, 0, ids, r1.block_hashes[:FULL])])

    connector.wait_for_save = save_r1_blocks
    runner_step(B, runner, connector=connector)
    assert stats(B) == {"mismatch": 2, "offloaded_mismatch": 2}, logs.text
    assert sorted(host_connector(B).failures) == sorted((r.request_id, {0: (2,)}) for r in (r1, r2))


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


# -- a batch queue: step N+1 is scheduled before step N's update --------------


def _sync_load_then_next_step(B, prompt, *, second=None):
    """r1 loads `prompt`'s KV synchronously in step N (its forward and its
    workers' checksums run); then, as vLLM's batch queue does, step N+1 is
    scheduled before step N's update, with `second` (a request sharing the
    prefix) added just before it. (r1, out_n, merged_n, out_next)."""
    host_connector(B).load_async = False
    r1 = make_request(prompt, block_size=BS, max_tokens=4)
    B.scheduler.add_request(r1)
    out_n = B.scheduler.schedule()
    assert r1.request_id in out_n.kv_checksum_scheduled.reqs_loaded
    perform_loads(B)
    forward_of(B, r1)(out_n)
    merged_n = B.run_workers(out_n)
    if second is not None:
        B.scheduler.add_request(second)
    out_next = B.scheduler.schedule()
    return r1, out_n, merged_n, out_next


def _run_step(B, out, *reqs):
    perform_loads(B)
    for req in reqs:
        forward_of(B, req)(out)
    return B.run_workers(out)


def _loaded_ids(B, req) -> list[int]:
    return B.scheduler.kv_cache_manager.get_block_ids(req.request_id)[0][:FULL]


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_sync_loaded_blocks_are_not_shared_before_their_verdict(policy, logs):
    """Batch queue: r2 shares r1's prefix and is scheduled in step N+1, before
    step N's update compares r1's synchronous load (block 2 corrupt in the
    store). r2 must not run on r1's unchecked blocks; it loads its own, which
    are checked in their own step, and both end (or recompute) with the
    checksum's reason."""
    A = make_offload_side()
    B = make_offload_side(fail_closed=True, policy=policy, batch_queue=True)
    prompt = prompt_of(PROMPT)
    hashes = store_prompt(A, prompt)
    corrupt_store_kv(hashes, 2)
    r2 = make_request(prompt + [7, 8, 9], block_size=BS, max_tokens=2)
    r1, out_n, merged_n, out_next = _sync_load_then_next_step(B, prompt, second=r2)
    assert r2.request_id in out_next.num_scheduled_tokens
    assert not set(_loaded_ids(B, r1)) & set(B.scheduler.kv_cache_manager.get_block_ids(r2.request_id)[0])
    merged_next = _run_step(B, out_next, r1, r2)
    outs_n = B.update(out_n, merged_n)
    outs_next = B.update(out_next, merged_next)
    assert stats(B) == {"mismatch": 2, "offloaded_mismatch": 2}, logs.text
    if policy == "fail":
        for req, outs in ((r1, outs_n), (r2, outs_next)):
            assert req.is_finished() and outs[req.request_id].finish_reason.name == "ERROR"
            assert req.stop_reason.startswith("kv_checksum_mismatch"), (req.request_id, req.stop_reason)
    else:
        assert not r2.is_finished() and r2.num_computed_tokens == 2 * BS
        assert r2.request_id not in outs_next or not outs_next[r2.request_id].new_token_ids


def test_sync_loaded_blocks_are_shared_once_verified(logs):
    """The hold ends with the verdict: after step N's update verifies r1's
    load, a request with the same prefix hits r1's blocks in the prefix cache."""
    A = make_offload_side()
    B = make_offload_side(fail_closed=True, batch_queue=True)
    prompt = prompt_of(PROMPT)
    store_prompt(A, prompt)
    r2 = make_request(prompt + [7, 8, 9], block_size=BS, max_tokens=2)
    r1, out_n, merged_n, out_next = _sync_load_then_next_step(B, prompt, second=r2)
    assert not set(_loaded_ids(B, r1)) & set(B.scheduler.kv_cache_manager.get_block_ids(r2.request_id)[0])
    merged_next = _run_step(B, out_next, r1, r2)
    B.update(out_n, merged_n)
    B.update(out_next, merged_next)
    assert stats(B) == {"verified": 2, "offloaded_verified": 2}, logs.text
    r3 = make_request(prompt + [4, 5], block_size=BS, max_tokens=2)
    B.scheduler.add_request(r3)
    out = B.scheduler.schedule()
    assert _loaded_ids(B, r3) == _loaded_ids(B, r1)  # a local hit on r1's verified blocks
    assert out.kv_checksum_scheduled is None or r3.request_id not in out.kv_checksum_scheduled.reqs_loaded


@pytest.mark.parametrize("fail_closed,policy,bad_positions", [
    (True, "fail", (2,)), (True, "recompute", (2,)), (False, "fail", (2,)),
    (True, "recompute", (2, 4)),  # two bad blocks: evicted from the first
])
def test_failed_sync_load_is_not_hit_afterwards(fail_closed, policy, bad_positions, logs):
    """A synchronous load that failed its check leaves the prefix cache from
    its first bad block on (under fail-open too: its own request uses it, no
    other request may); the blocks before it stay shared."""
    A = make_offload_side()
    B = make_offload_side(fail_closed=fail_closed, policy=policy, batch_queue=True)
    prompt = prompt_of(PROMPT)
    hashes = store_prompt(A, prompt)
    for position in bad_positions:
        corrupt_store_kv(hashes, position)
    r1, out_n, merged_n, out_next = _sync_load_then_next_step(B, prompt)
    bad = _loaded_ids(B, r1)
    merged_next = _run_step(B, out_next, r1)
    B.update(out_n, merged_n)
    B.update(out_next, merged_next)
    assert stats(B) == {"mismatch": 1, "offloaded_mismatch": 1}, logs.text
    r3 = make_request(prompt + [4, 5], block_size=BS, max_tokens=2)
    blocks, num_hit, _ = B.scheduler.kv_cache_manager.get_computed_blocks(r3)
    assert num_hit == 2 * BS and blocks.get_block_ids()[0] == bad[:2]  # the blocks before the first bad one stay


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_failed_sync_load_of_a_request_preempted_meanwhile(policy, logs):
    """Batch queue: r1 is preempted while its synchronous load's step runs.
    Step N's output (computed on the corrupt KV) must not reach the client;
    under "fail" r1 ends now with the checksum's reason, under "recompute" it
    resumes without the bad blocks and ends with no checksum reason."""
    A = make_offload_side()
    B = make_offload_side(fail_closed=True, policy=policy, batch_queue=True)
    prompt = prompt_of(PROMPT)
    hashes = store_prompt(A, prompt)
    corrupt_store_kv(hashes, 2)
    r1, out_n, merged_n, out_next = _sync_load_then_next_step(B, prompt)
    merged_next = _run_step(B, out_next, r1)
    bad = _loaded_ids(B, r1)
    # What schedule() does when it preempts r1 for memory (between step N+1's
    # scheduling and step N's update).
    B.scheduler.running.remove(r1)
    B.scheduler._preempt_request(r1, 0.0)
    outs_n = B.update(out_n, merged_n)
    B.update(out_next, merged_next)
    assert stats(B) == {"mismatch": 1, "offloaded_mismatch": 1}, logs.text
    assert not (r1.request_id in outs_n and outs_n[r1.request_id].new_token_ids)
    if policy == "fail":
        assert r1.is_finished() and outs_n[r1.request_id].finish_reason.name == "ERROR"
        assert r1.stop_reason.startswith("kv_checksum_mismatch")
        return
    host_connector(B).load_async = True
    forward = forward_of(B, r1)
    for _ in range(12):
        B.step(forward=forward)
        if r1.is_finished():
            break
    assert r1.is_finished() and r1.output_token_ids, r1.status
    assert r1.stop_reason is None or not str(r1.stop_reason).startswith("kv_checksum_")
    assert not set(_loaded_ids(B, r1)[2:]) & set(bad[2:]) or r1.num_preemptions


# -- one request sent and loaded back in one step -------------------------------


@pytest.mark.parametrize("batch_queue", [False, True])
def test_producer_request_loaded_back_synchronously_keeps_its_records_apart(batch_queue, logs):
    """A prefill node with MultiConnector[NixlConnector, a store with
    synchronous loads]: a P/D producer request whose prompt starts with KV
    loaded back from the store is sent and sync-loaded in one step, and each
    worker reports both. Each is judged with its own records: the load
    verifies (nothing is dropped from the store), the producer's checksums
    are sent, and a consumer's load of them verifies."""
    A = make_offload_side()
    prompt = prompt_of(PROMPT)
    hashes = store_prompt(A, prompt)
    nixl = dict(kv_connector="NixlConnector", kv_role="kv_both")
    host = dict(kv_connector="HostOffloadConnector", kv_connector_module_path="offload_harness", kv_role="kv_both")
    P = make_side("kv_both", connector="MultiConnector", connector_extra={"connectors": [nixl, host]},
                  fail_closed=True, batch_queue=batch_queue)
    for w in P.workers:
        w.checksums.init_block_checksums((0,))
    host_connector(P).load_async = False
    req = make_request(prompt, remote_decode=True, block_size=BS)
    P.scheduler.add_request(req)
    out, outputs = P.step(forward=loading_forward(P, req))
    scheduled = out.kv_checksum_scheduled
    assert req.request_id in scheduled.reqs_loaded and req.request_id in scheduled.reqs_to_send
    assert stats(P) == {"verified": 1, "offloaded_verified": 1, "sent": 1}, logs.text
    assert host_connector(P).failures == [] and all(h in STORE for h in hashes)
    params = outputs[req.request_id].kv_transfer_params
    C = make_side("kv_consumer", fail_closed=True)
    load(C, P, req, params)
    assert stats(C) == {"verified": 1}, logs.text


@pytest.mark.parametrize("corrupt", [False, True])
def test_producer_preempted_after_its_send_resumes_through_an_async_offloaded_load(corrupt, logs):
    """Batch queue, a prefill node with MultiConnector[NixlConnector, a store
    with async loads]: a P/D producer request (max_tokens 3) finishes its
    prompt (add_send), is preempted, and its prefix leaves the local cache;
    it resumes by loading the prefix back from the store and recomputes its
    prompt with its first output token in one step. Its load is judged on
    its own records (verified; or a mismatch, recomputed from a load without
    the bad block), and the checksums it
    sends cover its prompt, as its consumer loads it: the consumer
    verifies."""
    A = make_offload_side()
    prompt = prompt_of(PROMPT)
    nixl = dict(kv_connector="NixlConnector", kv_role="kv_both")
    host = dict(kv_connector="HostOffloadConnector", kv_connector_module_path="offload_harness", kv_role="kv_both")
    P = make_side("kv_both", connector="MultiConnector", connector_extra={"connectors": [nixl, host]},
                  fail_closed=True, policy="recompute", batch_queue=True)
    for w in P.workers:
        w.checksums.init_block_checksums((0,))
    req = make_request(prompt, remote_decode=True, block_size=BS)
    req.max_tokens = req.sampling_params.max_tokens = 3
    P.scheduler.add_request(req)
    compute = forward_of(P, req)
    out, _ = P.step(forward=compute)
    assert req.request_id in out.kv_checksum_scheduled.reqs_to_send
    hashes = store_prompt(A, prompt)
    if corrupt:
        corrupt_store_kv(hashes, 2)
    P.scheduler.running.remove(req)
    P.scheduler._preempt_request(req, 0.0)
    assert P.scheduler.kv_cache_manager.reset_prefix_cache()
    params, loaded, sent_with = None, False, []
    for _ in range(12):
        done = perform_loads(P)
        out, outputs = P.step(forward=compute, finished_recving=set(done))
        scheduled = out.kv_checksum_scheduled
        loaded |= bool(scheduled and req.request_id in scheduled.reqs_to_recv)
        if scheduled and req.request_id in scheduled.reqs_to_send:
            sent_with.append(out.num_scheduled_tokens[req.request_id])
        if req.request_id in outputs and outputs[req.request_id].kv_transfer_params:
            params = outputs[req.request_id].kv_transfer_params
        if req.is_finished():
            break
    assert loaded and req.num_preemptions == 1
    # The resumed prompt step computes past the prompt (its first output token too).
    assert sent_with and sent_with[-1] > PROMPT - FULL * BS
    expected = {"verified": 1, "offloaded_verified": 1, "sent": 1}
    if corrupt and series_lacks_first_bad_block_rollback():
        # Recomputed: loaded again without the bad block (dropped from the store).
        expected.update(mismatch=1, offloaded_mismatch=1)
    elif corrupt:
        # Recomputed from the bad block 2: blocks 0-1 compared equal and stay.
        expected = {"mismatch": 1, "offloaded_mismatch": 1, "sent": 1}
    assert stats(P) == expected, logs.text
    assert host_connector(P).failures == ([(req.request_id, {0: (2,)})] if corrupt else [])
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED and params and "kv_checksums" in params
    C = make_side("kv_consumer", fail_closed=True)
    load(C, P, req, params)
    assert stats(C) == {"verified": 1}, logs.text


@pytest.mark.parametrize("fail_closed", [True, False])
def test_failed_sync_load_of_a_request_aborted_meanwhile(fail_closed, logs):
    """Batch queue: r1 is aborted while its synchronous load's step runs; its
    blocks are freed but stay in the prefix cache. The load is still judged
    with its step's records: it fails, and its blocks leave the prefix cache
    from the bad one on, so a later request with that prefix does not hit
    them. Nothing is failed (there is no request left)."""
    A = make_offload_side()
    B = make_offload_side(fail_closed=fail_closed, policy="recompute", batch_queue=True)
    prompt = prompt_of(PROMPT)
    hashes = store_prompt(A, prompt)
    corrupt_store_kv(hashes, 3)
    r1, out_n, merged_n, out_next = _sync_load_then_next_step(B, prompt)
    bad = _loaded_ids(B, r1)
    B.scheduler.finish_requests({r1.request_id}, RequestStatus.FINISHED_ABORTED)
    merged_next = _run_step(B, out_next)
    outs_n = B.update(out_n, merged_n)
    B.update(out_next, merged_next)
    assert stats(B) == {"mismatch": 1, "offloaded_mismatch": 1}, logs.text
    assert host_connector(B).failures == [(r1.request_id, {0: (3,)})]
    r3 = make_request(prompt + [4, 5], block_size=BS, max_tokens=2)
    blocks, num_hit, _ = B.scheduler.kv_cache_manager.get_computed_blocks(r3)
    assert num_hit == 3 * BS and blocks.get_block_ids()[0] == bad[:3]


def test_two_offloading_connectors_cover_the_union_of_their_groups(logs):
    """MultiConnector hands the one checksum worker to every child: two
    children offloading different groups share its entries tensor, and a
    load of either group is checked (the last child's call no longer
    decides alone)."""
    kw = dict(sliding_window=48)
    B = make_offload_side(fail_closed=True, covered=(0,), multi=1, **kw)
    for w in B.workers:
        first = w.checksums.block_checksums
        assert w.checksums.init_block_checksums((1,)) is first
        assert w.checksums.offload_groups == frozenset({0, 1})
    A = make_offload_side(covered=(0, 1), **kw)
    prompt = prompt_of(PROMPT)
    hashes = store_prompt(A, prompt)
    corrupt_store_kv(hashes, 4)  # a layer of group 0, the first child's
    result = load_prompt(B, prompt)
    assert stats(B) == {"mismatch": 1, "offloaded_mismatch": 1}, logs.text
    assert result.failures == [(result.request.request_id, {0: (4,)})]
    assert "group 1 verified" in logs.text  # the second child's group is checked too


# -- found missing by an outside mutation round --------------------------------


def test_a_hold_leaves_hits_on_other_blocks_whole():
    from types import SimpleNamespace

    B = make_offload_side(fail_closed=True, batch_queue=True)
    checksums = B.scheduler.kv_checksum
    checksums._held.update([10_000])
    hit = [[SimpleNamespace(block_id=1), SimpleNamespace(block_id=2)]]
    assert checksums.usable_local_hit(hit) is None
    hit[0].append(SimpleNamespace(block_id=10_000))
    assert checksums.usable_local_hit(hit) == 2


def test_nothing_of_a_judged_sync_load_is_kept(logs):
    """After the updates of a batch-queue sync load: no loads, records or
    holds left (they would grow with every step, and a request loading again
    would be judged with its old records)."""
    A = make_offload_side()
    B = make_offload_side(fail_closed=True, batch_queue=True)
    prompt = prompt_of(PROMPT)
    store_prompt(A, prompt)
    r1, out_n, merged_n, out_next = _sync_load_then_next_step(B, prompt)
    merged_next = _run_step(B, out_next, r1)
    B.update(out_n, merged_n)
    B.update(out_next, merged_next)
    checksums = B.scheduler.kv_checksum
    assert stats(B) == {"verified": 1, "offloaded_verified": 1}, logs.text
    assert checksums._sync_records == [] and not checksums._sync and not checksums._held


def test_a_sync_load_forgotten_before_its_step_is_sent_holds_nothing():
    A = make_offload_side()
    B = make_offload_side(fail_closed=True, batch_queue=True)
    prompt = prompt_of(PROMPT)
    store_prompt(A, prompt)
    host_connector(B).load_async = False
    checksums = B.scheduler.kv_checksum
    r1 = make_request(prompt, block_size=BS, max_tokens=4)
    B.scheduler.add_request(r1)
    # What add_sync_load does inside schedule(); the request dropped before the step's meta is built.
    checksums.add_sync_load(r1, ([100 + i for i in range(FULL + 1)],), 0, FULL * BS)
    assert checksums._held
    checksums.forget(r1.request_id)
    assert not checksums._held and not checksums._sync
    assert checksums.build_checksum_meta() is None


def test_offload_groups_asked_twice_stay_covered():
    B = make_offload_side(fail_closed=True)
    for w in B.workers:
        assert w.checksums.offload_groups == frozenset({0})
        w.checksums.init_block_checksums((0,))
        assert w.checksums.offload_groups == frozenset({0})
