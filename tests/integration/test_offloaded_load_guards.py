"""Loads of offloaded KV in the cases the plain store-and-load-back tests miss.

Real vLLM Schedulers and KVChecksumWorkers (pd_harness) with the host-store
offloading connector (offload_harness), as in test_offloaded_loads: a load
after a local prefix hit, a load that ends inside a block, an unverified
synchronous load, a synchronous load whose request is aborted before its
step's update, workers that keep no entries, and a connector whose hooks
raise.
"""

from __future__ import annotations

import types

import pytest
from offload_harness import (STORE, corrupt_store_kv, empty_store, host_connector, load_prompt,  # noqa: F401 (fixture)
                             load_prompt_sync, make_offload_side, perform_loads, store_prompt)
from pd_harness import forward_of, make_request, make_side, prompt_of, run_local, stats
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import RequestStatus

from vllm_kvchecksum.core.records import GroupBlocks, KVChecksumBlocks

BS = 16
PROMPT = BS * 5 + 3  # 5 full blocks, then 3 tokens computed locally
FULL = PROMPT // BS




def report_tiers_by_plan(connector) -> None:
    """Make the connector split a hit by tier as vLLM's OffloadingConnector
    does (get_external_cache_hit_sources): of the `num_external_tokens` from
    the request's local prefix on, those its load plan covers come from the
    host; any beyond the plan are EXTERNAL_UNSPECIFIED."""
    planned: dict[str, int] = {}
    update_state_after_alloc = connector.update_state_after_alloc

    def update(self, request, blocks, num_external_tokens):
        if num_external_tokens:
            planned[request.request_id] = num_external_tokens
        update_state_after_alloc(request, blocks, num_external_tokens)

    def sources(self, request, num_external_tokens):
        host = min(num_external_tokens, planned.get(request.request_id, 0))
        split = {CacheHitSource.HOST: host, CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens - host}
        return {tier: n for tier, n in split.items() if n}

    connector.update_state_after_alloc = types.MethodType(update, connector)
    connector.get_external_cache_hit_sources = types.MethodType(sources, connector)


# -- what a load covers -------------------------------------------------------


@pytest.mark.parametrize("corrupt", [None, 3], ids=["intact", "corrupt-block-3"])
def test_offloaded_load_after_a_local_prefix_hit_checks_the_loaded_blocks(corrupt, logs):
    """B holds the prompt's first 2 blocks in its prefix cache and loads
    blocks 2-4 from the store: those three are checked, each against the tag
    of its own position's block hash, and a corrupt one is named by its
    position in the request."""
    A = make_offload_side()
    B = make_offload_side(fail_closed=True)
    report_tiers_by_plan(host_connector(B))
    prompt = prompt_of(PROMPT)
    run_local(B, prompt[:2 * BS + 1])  # before anything is stored: computed, and cached
    hashes = store_prompt(A, prompt)
    if corrupt is not None:
        corrupt_store_kv(hashes, corrupt)
    result = load_prompt(B, prompt)
    req = result.request
    if corrupt is None:
        assert stats(B) == {"verified": 1, "offloaded_verified": 1}, logs.text
        assert "group 0 verified (3 blocks compared)" in logs.text
        assert result.failures == []
        assert result.next_scheduled == PROMPT - FULL * BS
    else:
        assert stats(B) == {"mismatch": 1, "offloaded_mismatch": 1}, logs.text
        assert "group 0 differs at block positions 3 (1 of 3 compared)" in logs.text
        assert result.failures == [(req.request_id, {0: (3,)})]
        assert result.outputs[req.request_id].stop_reason.startswith("kv_checksum_mismatch")


def test_offloaded_load_ending_inside_a_block_checks_its_full_blocks(logs):
    """A connector that loads tokens of a partial last block (stored by token
    range, not per block): that block has no block hash and no entry, so only
    the full blocks before it are checked, and they verify."""
    A = make_offload_side()
    B = make_offload_side(fail_closed=True)
    connector = host_connector(B)
    report_tiers_by_plan(connector)
    partial = PROMPT - 1 - FULL * BS  # all but the prompt's last token
    matched = connector.get_num_new_matched_tokens

    def with_partial_block(self, request, num_computed_tokens):
        tokens, load_async = matched(request, num_computed_tokens)
        return (tokens + partial if tokens else tokens), load_async

    connector.get_num_new_matched_tokens = types.MethodType(with_partial_block, connector)
    prompt = prompt_of(PROMPT)
    store_prompt(A, prompt)
    # The partial block's tokens arrive with the load (the harness stores full blocks only).
    result = load_prompt(B, prompt, tamper=lambda req: B.write_tokens(req.request_id, FULL * BS, PROMPT - 1))
    assert stats(B) == {"verified": 1, "offloaded_verified": 1}, logs.text
    assert "group 0 verified (5 blocks compared)" in logs.text
    assert result.next_scheduled == 1  # the prompt's last token


# -- synchronous loads --------------------------------------------------------


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_unverified_sync_load_fail_closed_is_rolled_back(policy, logs):
    """Rank 1 keeps no entries while rank 0 does: the synchronous load is
    unverified. Fail-closed, every loaded block is invalid: the step's output
    is dropped and the request fails with the reason, or recomputes the
    prompt from its start; the loaded blocks are dropped from the store."""
    A = make_offload_side(tp=2)
    B = make_offload_side(tp=2, fail_closed=True, policy=policy)
    B.workers[1].checksums.offload_groups = frozenset()
    prompt = prompt_of(PROMPT)
    hashes = store_prompt(A, prompt)
    req, outputs, out = load_prompt_sync(B, prompt)
    assert out.num_scheduled_tokens[req.request_id] == PROMPT - FULL * BS  # loaded, and run in its step
    assert stats(B) == {"unverified": 1, "offloaded_unverified": 1}, logs.text
    assert B.reported_metrics == {"offloaded_loads_unverified/not_stored": 1}
    assert host_connector(B).failures == [(req.request_id, {0: tuple(range(FULL))})]
    assert not any(h in STORE for h in hashes)
    if policy == "fail":
        assert req.is_finished() and outputs[req.request_id].finish_reason.name == "ERROR"
        assert req.stop_reason.startswith("kv_checksum_unverified: not_stored"), req.stop_reason
    else:
        assert not req.is_finished()
        assert req.request_id not in outputs or not outputs[req.request_id].new_token_ids
        assert req.num_computed_tokens == 0
        nxt, _ = B.step(forward=forward_of(B, req))
        assert nxt.num_scheduled_tokens[req.request_id] == PROMPT  # nothing left to load: computed


def test_sync_load_of_a_request_aborted_before_its_update_fails_nothing(logs):
    """With a batch queue a client's abort can land between the step that
    loads a request's KV synchronously and that step's update. The request
    is gone: its load fails no request (there is none left to fail, nor a
    client to give a reason to), and the update goes on."""
    A = make_offload_side()
    B = make_offload_side(fail_closed=True, policy="fail")
    prompt = prompt_of(PROMPT)
    hashes = store_prompt(A, prompt)
    corrupt_store_kv(hashes, 2)
    host_connector(B).load_async = False
    r1 = make_request(prompt, block_size=BS, max_tokens=2)
    B.scheduler.add_request(r1)
    out_n = B.scheduler.schedule()
    assert r1.request_id in out_n.kv_checksum_scheduled.reqs_loaded
    perform_loads(B)
    forward_of(B, r1)(out_n)
    merged = B.run_workers(out_n)
    B.scheduler.finish_requests(r1.request_id, RequestStatus.FINISHED_ABORTED)
    outputs = B.update(out_n, merged)
    assert r1.request_id not in outputs or outputs[r1.request_id].finish_reason.name != "ERROR"
    assert r1.status is RequestStatus.FINISHED_ABORTED
    assert not (r1.stop_reason or "").startswith("kv_checksum_")
    # The engine goes on: another request runs to its end.
    other = make_request(prompt_of(40, seed=4), block_size=BS, max_tokens=1)
    B.scheduler.add_request(other)
    for _ in range(4):
        B.step(forward=forward_of(B, other))
    assert other.is_finished()


# -- workers that keep no entries ---------------------------------------------


def test_workers_without_entries_check_no_offloaded_load(logs):
    """The connector offloads no checksums (its workers never asked for
    entries: init_block_checksums not called): a load of its offloaded KV
    is reported without values by every worker, and left unchecked."""
    A = make_offload_side(covered=())  # no entries stored either
    B = make_side("kv_both", connector="HostOffloadConnector", connector_module_path="offload_harness",
                  fail_closed=True)
    assert all(w.checksums.block_checksums is None for w in B.workers)
    prompt = prompt_of(PROMPT)
    store_prompt(A, prompt)
    result = load_prompt(B, prompt)
    assert stats(B) == {} and result.failures == []
    assert dict(B.reported_metrics) == {"offloaded_loads_not_checked/no_groups": 1}
    assert result.next_scheduled == PROMPT - FULL * BS  # used


def test_worker_reports_an_offloaded_load_of_its_entry_groups_only():
    """Entries are kept for group 0 only: of an offloaded load over both
    groups, a worker reports values and stored entries of group 0 only (a
    group without entries has nothing stored to compare with)."""
    side = make_offload_side(sliding_window=48, covered=(0,))
    worker = side.workers[0].checksums
    assert worker.offload_groups == {0}
    blocks = KVChecksumBlocks(4 * BS, {0: GroupBlocks(0, (1, 2, 3, 4)), 1: GroupBlocks(0, (5, 6, 7, 8))},
                              offloaded=True)
    record, = worker.compute({"r": blocks}, replica_zero_only=False).finalize()
    assert set(record.requests["r"]) == {0}
    assert set(record.stored["r"]) == {0}
    # A P/D load of the same blocks covers both groups.
    pd = KVChecksumBlocks(4 * BS, dict(blocks.groups))
    record, = worker.compute({"r": pd}, replica_zero_only=False).finalize()
    assert set(record.requests["r"]) == {0, 1} and record.stored == {}


# -- connector hooks that raise -----------------------------------------------


def test_failure_hook_raising_leaves_the_verdict_and_the_engine(logs):
    """on_kv_checksum_failure raises (a store's client error, not a
    ValueError): the mismatch still fails the load with its reason, the
    error is logged, and the engine goes on with other requests."""
    A = make_offload_side()
    B = make_offload_side(fail_closed=True, policy="fail")
    connector = host_connector(B)

    def broken(self, request, mismatches):
        raise RuntimeError("store unreachable")

    connector.on_kv_checksum_failure = types.MethodType(broken, connector)
    prompt = prompt_of(PROMPT)
    hashes = store_prompt(A, prompt)
    corrupt_store_kv(hashes, 2)
    result = load_prompt(B, prompt)
    req = result.request
    assert stats(B) == {"mismatch": 1, "offloaded_mismatch": 1}, logs.text
    assert req.is_finished() and result.outputs[req.request_id].finish_reason.name == "ERROR"
    assert req.stop_reason.startswith("kv_checksum_mismatch"), req.stop_reason
    assert "on_kv_checksum_failure raised for request" in logs.text and "store unreachable" in logs.text
    assert hashes[2] in STORE  # not dropped: the log says it may be loaded again
    other = make_request(prompt_of(40, seed=4), block_size=BS, max_tokens=1)
    B.scheduler.add_request(other)
    for _ in range(4):
        B.step(forward=forward_of(B, other))
    assert other.is_finished()


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_sources_hook_raising_leaves_the_load_unchecked(sync, logs):
    """get_kv_checksum_sources raises (not a ValueError): the load is not
    checked, the error is logged, and the request runs on the loaded KV."""
    A = make_offload_side()
    B = make_offload_side(fail_closed=True)
    connector = host_connector(B)

    def broken(self, request):
        raise RuntimeError("tier lookup failed")

    connector.get_kv_checksum_sources = types.MethodType(broken, connector)
    prompt = prompt_of(PROMPT)
    store_prompt(A, prompt)
    if sync:
        req, outputs, out = load_prompt_sync(B, prompt)
        assert out.num_scheduled_tokens[req.request_id] == PROMPT - FULL * BS
        assert outputs[req.request_id].new_token_ids
    else:
        result = load_prompt(B, prompt)
        req = result.request
        assert result.next_scheduled == PROMPT - FULL * BS
    assert stats(B) == {}
    assert f"asking the connector where request {req.request_id}'s load comes from raised" in logs.text
    assert "tier lookup failed" in logs.text
