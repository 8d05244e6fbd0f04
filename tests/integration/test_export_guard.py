"""KV that failed its check under fail-open never leaves the instance with a checksum.

Real vLLM Schedulers and KVChecksumWorkers (pd_harness, offload_harness). A
request that uses a load which mismatched (fail-open) keeps its KV from the
first bad block on to itself (Request.max_cached_tokens, patch 0022), and
vllm_kvchecksum.engine.export_guard reads that boundary where KV leaves:

- a P/D consumer with MultiConnector[NixlConnector, an offloading child]:
  - vLLM's OffloadingConnector stores none of the request's blocks from the
    bad one on (its saves are capped);
  - a child that stores checksum entries with the blocks (the host store
    harness, whose worker half stores every block it is handed) stores them
    with entries that never match: a fail-closed instance that loads them
    back finds a mismatch, never verifies them. Once the request's blocks
    are freed, the same block ids hold good KV again and their entries match;
- a kv_both producer whose request loaded a bad block from its store sends
  checksums of the blocks before it only: its consumer's load is unverified
  (not covered by the producer), never verified;
- MooncakeStoreScheduler's saves stop before the request's limit (the whole
  store path runs in tests/e2e/test_mooncake_store.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from offload_harness import (STORE, corrupt_store_kv, empty_store, host_connector,  # noqa: F401 (fixture)
                             load_prompt, loading_forward, make_offload_side, offload, perform_loads, store_prompt)
from pd_harness import forward_of, load, make_request, make_side, prefill, prompt_of, stats
from vllm_kvchecksum.core.payload import KVChecksumPayload

BS = 16
PROMPT = BS * 5 + 3  # 5 full blocks, then 3 tokens
BAD = 2

NIXL = dict(kv_connector="NixlConnector", kv_role="kv_both")
HOST = dict(kv_connector="HostOffloadConnector", kv_connector_module_path="offload_harness", kv_role="kv_both")
OFFLOADING = dict(kv_connector="OffloadingConnector", kv_role="kv_both",
                  kv_connector_extra_config={"cpu_bytes_to_use": 64 << 20})


def _multi_side(role: str, child: dict, **kw):
    side = make_side(role, connector="MultiConnector", connector_extra={"connectors": [NIXL, child]}, **kw)
    for w in side.workers:
        w.checksums.init_block_checksums((0,))
    return side


def _recording(side) -> list:
    """Every SchedulerOutput the side's scheduler makes from now on."""
    outs, schedule = [], side.scheduler.schedule

    def record():
        out = schedule()
        outs.append(out)
        return out

    side.scheduler.schedule = record
    return outs


def _pd_load_fail_open(child: dict):
    """A fail-open P/D consumer with MultiConnector[NixlConnector, child] loads a
    prompt whose block BAD went bad in flight, uses it and computes the rest."""
    P = make_side("kv_producer")
    B = _multi_side("kv_consumer", child)
    outs = _recording(B)
    preq, params = prefill(P, prompt_of(PROMPT))
    result = load(B, P, preq, params, tamper=lambda req: B.corrupt(req.request_id, position=BAD))
    assert stats(B) == {"mismatch": 1}
    assert result.next_scheduled == 1  # used (fail-open); the prompt's last token computed
    assert result.request.max_cached_tokens == BAD * BS
    return B, result.request, outs


FULL_TOKENS = PROMPT // BS * BS


def test_offloading_connector_stores_none_of_a_failed_loads_blocks_from_the_bad_one():
    B, req, outs = _pd_load_fail_open(OFFLOADING)
    forward = forward_of(B, req)
    for _ in range(6):
        outs_before = len(outs)
        B.step(forward=forward)
        assert len(outs) == outs_before + 1
        if req.is_finished():
            break
    stored = [int(b) for out in outs for job in out.kv_connector_metadata.metadata[1].store_jobs.values()
              if job.req_id == req.request_id for b in job.src_spec.block_ids]
    # It stores the blocks before the bad one, and nothing from there on.
    loaded = _loaded_block_ids(outs, req)
    assert stored and set(stored) <= set(loaded[:BAD]), (stored, loaded)


def _loaded_block_ids(outs, req) -> list[int]:
    """The block ids of the request's load (as the step that started it sent them to the workers)."""
    for out in outs:
        scheduled = out.kv_checksum_scheduled
        if scheduled is not None and req.request_id in scheduled.reqs_to_recv:
            return list(scheduled.reqs_to_recv[req.request_id].groups[0].block_ids)
    raise AssertionError("no load started")


def test_a_store_with_checksums_gets_entries_that_never_verify_the_blocks_from_the_bad_one(logs):
    B, req, outs = _pd_load_fail_open(HOST)
    # The offloading child's worker stores every full block it is handed, with its entry.
    hashes = offload(B, req.request_id)
    assert all(h in STORE for h in hashes)
    C = make_offload_side(fail_closed=True, policy="recompute")
    result = load_prompt(C, prompt_of(PROMPT))
    # A fail-closed instance loading them back finds each block from the bad one on a mismatch.
    assert stats(C) == {"mismatch": 1, "offloaded_mismatch": 1}, logs.text
    assert result.failures == [(result.request.request_id, {0: tuple(range(BAD, FULL_TOKENS // BS))})]
    assert result.next_scheduled == PROMPT - BAD * BS  # recomputed from the bad block; the blocks before verified
    assert all(h in STORE for h in hashes[:BAD]) and not any(h in STORE for h in hashes[BAD:])
    # The workers were told the tainted blocks: the request's from BAD on (the load's, and any it fills later).
    told = [out.kv_checksum_scheduled.tainted_blocks for out in outs
            if out.kv_checksum_scheduled is not None and out.kv_checksum_scheduled.tainted_blocks is not None]
    assert told and set(told[-1]) == set(B.scheduler.kv_cache_manager.get_block_ids(req.request_id)[0][BAD:])
    assert set(_loaded_block_ids(outs, req)[BAD:]) <= told[-1]
    assert all(w.checksums.tainted_blocks == told[-1] for w in B.workers)


def test_blocks_freed_by_a_tainted_request_get_good_entries_again(logs):
    B, req, outs = _pd_load_fail_open(HOST)
    tainted = set(B.scheduler.kv_cache_manager.get_block_ids(req.request_id)[0][BAD:])
    forward = forward_of(B, req)
    for _ in range(8):
        B.step(forward=forward)
        if req.request_id not in B.scheduler.requests:
            break
    assert req.request_id not in B.scheduler.requests
    B.step()  # the workers hear that no block is tainted any more
    assert all(w.checksums.tainted_blocks == frozenset() for w in B.workers)
    # Another request computes the prompt afresh (its blocks before BAD are the prefix cache's), in
    # freed blocks, some of them those the tainted request held; their entries match.
    again = make_request(prompt_of(PROMPT), block_size=BS, max_tokens=3)
    B.scheduler.add_request(again)
    fresh = forward_of(B, again)
    B.step(forward=fresh)
    assert again.num_computed_tokens == PROMPT
    assert tainted & set(B.scheduler.kv_cache_manager.get_block_ids(again.request_id)[0]), "no freed block reused"
    hashes = offload(B, again.request_id)
    C = make_offload_side(fail_closed=True)
    load_prompt(C, prompt_of(PROMPT))
    assert stats(C) == {"verified": 1, "offloaded_verified": 1}, logs.text
    assert all(h in STORE for h in hashes)


@pytest.mark.parametrize("bad", [BAD, 0])
def test_a_producer_that_loaded_a_bad_block_sends_no_checksums_of_it_nor_after_it(bad, logs):
    """kv_both with MultiConnector[NixlConnector, a store]: a P/D producer
    request's prompt loads from the store, whose block `bad` is corrupt;
    fail-open, the producer uses it, computes the rest, and sends checksums
    of the blocks before it only (none for block 0). Its consumer's load
    covers every block, so it is unverified (not covered by the producer);
    it was verified, corrupt block included, while the producer's checksums
    covered it."""
    A = make_offload_side()
    prompt = prompt_of(PROMPT)
    hashes = store_prompt(A, prompt)
    corrupt_store_kv(hashes, bad)
    P = _multi_side("kv_both", HOST)
    req = make_request(prompt, remote_decode=True, block_size=BS)
    P.scheduler.add_request(req)
    P.step()
    assert req.status.name == "WAITING_FOR_REMOTE_KVS"
    P.step(finished_recving=set(perform_loads(P)))
    assert stats(P) == {"mismatch": 1, "offloaded_mismatch": 1}
    params = None
    forward = forward_of(P, req)
    for _ in range(4):
        _, outputs = P.step(forward=forward)
        if req.request_id in outputs and outputs[req.request_id].kv_transfer_params:
            params = outputs[req.request_id].kv_transfer_params
            break
    assert params and "kv_checksums" in params and stats(P)["sent"] == 1
    C = make_side("kv_consumer", fail_closed=True)
    result = load(C, P, req, params)
    # (With none of the blocks left, nothing is compared: no_common_blocks.)
    reason = "not_covered_by_producer" if bad else "no_common_blocks"
    assert stats(C) == {"unverified": 1}, logs.text
    assert C.reported_metrics[f"loads_unverified/{reason}"] == 1
    assert result.outputs[result.request.request_id].stop_reason.startswith(f"kv_checksum_unverified: {reason}")
    assert f"leave out its KV from token {bad * BS} on" in logs.text
    # The values of the blocks before the bad one, for a payload over the whole prompt.
    sent = KVChecksumPayload.decode(params["kv_checksums"])
    assert sent.num_tokens == PROMPT and (sent.groups[0].start, sent.groups[0].num_blocks) == (0, bad)


@pytest.mark.parametrize("limit,saved,puts,can_save", [
    (None, 96, [32, 96], True),    # no limit: as the connector built it
    (64, 64, [32], True),          # tokens from the limit on left out, and boundary puts past it
    (70, 64, [32], True),          # a partial block is never stored
    (0, 0, [], False),             # nothing left: no save
])
def test_mooncake_store_saves_stop_at_the_requests_limit(limit, saved, puts, can_save):
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import BoundaryPut, ReqMeta
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.scheduler import MooncakeStoreScheduler

    store = object.__new__(MooncakeStoreScheduler)  # only what _keep_failed_kv_out reads
    store._block_size = 32
    request = SimpleNamespace(max_cached_tokens=limit)
    store._unfinished_requests = {"r": (request, ())}
    req_meta = ReqMeta(req_id="r", token_len_chunk=96, block_ids=([1, 2, 3],), block_hashes=[], can_save=True,
                       token_ids=list(range(32, 96)), token_ids_start=32, num_prompt_tokens=96,
                       boundary_puts=[BoundaryPut(0, 1, 32), BoundaryPut(0, 3, 96)], publish_partial_tail=True)
    other = ReqMeta(req_id="other", token_len_chunk=96, block_ids=([4, 5, 6],), block_hashes=[], can_save=True)
    store._keep_failed_kv_out(SimpleNamespace(requests=[req_meta, other]))
    assert req_meta.token_len_chunk == saved and req_meta.can_save is can_save
    assert [p.num_tokens for p in req_meta.boundary_puts or []] == puts
    assert req_meta.token_ids == list(range(32, max(32, saved)))
    assert req_meta.publish_partial_tail is (limit is None)
    assert other.token_len_chunk == 96 and other.can_save  # a request the store does not know: unchanged


def test_only_an_int_limit_limits():
    """A request without patch 0022's field, or a test's stand-in (upstream's
    tests drive the store connectors with mocks), exports all its tokens."""
    from unittest.mock import MagicMock

    from vllm_kvchecksum.engine.export_guard import exportable_tokens

    assert exportable_tokens(SimpleNamespace(max_cached_tokens=32), 80) == 32
    assert exportable_tokens(SimpleNamespace(max_cached_tokens=96), 80) == 80
    assert exportable_tokens(SimpleNamespace(max_cached_tokens=0), 80) == 0
    for request in (SimpleNamespace(), SimpleNamespace(max_cached_tokens=None), MagicMock(),
                    SimpleNamespace(max_cached_tokens=True)):
        assert exportable_tokens(request, 80) == 80


# -- a synchronous load: nothing it loaded or computed leaves before its verdict --

HOST_CHILD = dict(kv_connector="HostOffloadConnector", kv_connector_module_path="offload_harness", kv_role="kv_both")
LONGER = PROMPT + 2 * BS  # the stored prefix's 5 full blocks, then blocks the request computes on them


def _sync_side(*, entries=(0,), **kw):
    """kv_both, fail-open: MultiConnector[a store loading synchronously, vLLM's OffloadingConnector]."""
    B = make_side("kv_both", connector="MultiConnector", connector_extra={"connectors": [HOST_CHILD, OFFLOADING]},
                  **kw)
    for w in B.workers:
        w.checksums.init_block_checksums(entries)
    host_connector(B).load_async = False
    return B


def _stored_blocks(outs, req) -> list[int]:
    """The block ids vLLM's OffloadingConnector (the second child) stored of `req`, in order."""
    return [int(b) for out in outs for job in out.kv_connector_metadata.metadata[1].store_jobs.values()
            if job.req_id == req.request_id for b in job.src_spec.block_ids]


@pytest.mark.parametrize("batch_queue", [False, True])
@pytest.mark.parametrize("corrupt", [True, False])
def test_a_sync_loads_blocks_are_not_stored_before_its_verdict(corrupt, batch_queue, logs):
    """kv_both, fail-open, MultiConnector[a store loading synchronously,
    vLLM's OffloadingConnector]. The step that loads the prompt's stored
    prefix (block BAD corrupt, or not) also computes two blocks on it, and
    the connector builds that step's saves (and with the batch queue the next
    step's) before the verdict. Nothing from the loaded blocks on is stored
    until then; afterwards nothing still (a mismatch: a failed load keeps
    the request's KV from the load on in), or every full block (verified:
    the held-back saves are made, not lost)."""
    A = make_offload_side()
    hashes = store_prompt(A, prompt_of(PROMPT))
    if corrupt:
        corrupt_store_kv(hashes, BAD)
    B = _sync_side(batch_queue=batch_queue)
    outs = _recording(B)
    req = make_request(prompt_of(LONGER), block_size=BS, max_tokens=6)
    B.scheduler.add_request(req)
    computed = forward_of(B, req)
    out_n = B.scheduler.schedule()
    loading_forward(B, req)(out_n)
    merged_n = B.run_workers(out_n)
    assert req.request_id in out_n.kv_checksum_scheduled.reqs_loaded
    before_verdict = 1
    if batch_queue:  # step N+1 is scheduled before step N's update
        out_next = B.scheduler.schedule()
        computed(out_next)
        before_verdict = 2
    assert _stored_blocks(outs[:before_verdict], req) == [], "stored before its verdict"
    B.update(out_n, merged_n)
    assert stats(B) == ({"mismatch": 1, "offloaded_mismatch": 1} if corrupt
                        else {"verified": 1, "offloaded_verified": 1}), logs.text
    if batch_queue:
        B.update(out_next, B.run_workers(out_next))
    for _ in range(8):
        if req.is_finished():
            break
        B.step(forward=computed)
    stored = _stored_blocks(outs, req)
    loaded = list(out_n.kv_checksum_scheduled.reqs_loaded[req.request_id].groups[0].block_ids)
    if corrupt:
        # A load that failed keeps its request's KV from the load on in for
        # the request's life (its store dropped the bad block; the rest is there).
        assert req.max_cached_tokens == BAD * BS
        assert stored == [], (stored, loaded)
    else:
        assert len(stored) == LONGER // BS and stored[:len(loaded)] == loaded, (stored, loaded)


def _sync_load_run(B, req):
    """The request loads synchronously in its first step, then runs to its end; (outs, that step's output)."""
    outs = _recording(B)
    B.scheduler.add_request(req)
    out_n, _ = B.step(forward=loading_forward(B, req))
    computed = forward_of(B, req)
    for _ in range(8):
        if req.is_finished():
            break
        B.step(forward=computed)
    return outs, out_n


def _held_from(req):
    return getattr(req, "kv_checksum_exports_held_from", None)


@pytest.mark.parametrize("case", ["no_entries_kept", "unverified", "tier_without_checksums"])
def test_a_sync_load_that_is_not_failed_leaves_its_request_free_to_export(case, logs, monkeypatch):
    """A synchronous load judged unverified under fail-open, or never checked
    (no worker keeps entries of its group; a tier that brings no checksums
    back, never held at all), does not keep the request's KV from the store:
    as for the prefix cache, nothing says which block is bad. All 7 full
    blocks are stored."""
    store_prompt(make_offload_side(), prompt_of(PROMPT))
    B = _sync_side(entries=() if case == "no_entries_kept" else (0,))
    if case == "unverified":
        # The comparison raising is one way to an unverified verdict.
        from vllm_kvchecksum.engine import scheduler as checksum_scheduler

        def raising(*args, **kwargs):
            raise RuntimeError("a comparison that fails")
        monkeypatch.setattr(checksum_scheduler, "compare_offloaded", raising)
    if case == "tier_without_checksums":
        host_connector(B).sources = set()
    req = make_request(prompt_of(LONGER), block_size=BS, max_tokens=6)
    outs, out_n = _sync_load_run(B, req)
    scheduled = out_n.kv_checksum_scheduled
    assert (scheduled is not None and req.request_id in scheduled.reqs_loaded) == (case != "tier_without_checksums")
    assert stats(B) == ({"unverified": 1, "offloaded_unverified": 1} if case == "unverified" else {}), logs.text
    assert _held_from(req) is None
    assert len(_stored_blocks(outs, req)) == LONGER // BS


def test_a_sync_load_of_several_groups_is_not_checked_nor_held(logs):
    """With two KV cache groups (a sliding-window model) synchronous loads are
    not checked (vLLM rolls back one group only): no verdict will come, so
    no hold either; the connector stores as it would without checksums."""
    B = _sync_side(entries=(0, 1), sliding_window=48)
    A = make_offload_side(sliding_window=48, covered=(0, 1))
    store_prompt(A, prompt_of(PROMPT))
    req = make_request(prompt_of(LONGER), block_size=BS, max_tokens=6)
    outs, out_n = _sync_load_run(B, req)
    assert B.reported_metrics.get("offloaded_loads_not_checked/sync_load") == 1, logs.text
    assert _held_from(req) is None
    assert _stored_blocks(outs[:1], req), "the step that loaded stored nothing"


def test_the_earliest_hold_of_a_request_holds_until_released():
    from vllm_kvchecksum.engine.export_guard import exportable_tokens, hold_exports, release_exports
    req = SimpleNamespace()
    assert exportable_tokens(req, 100) == 100
    hold_exports(req, 32)
    hold_exports(req, 16)
    hold_exports(req, 48)
    assert exportable_tokens(req, 100) == 16 and exportable_tokens(req, 10) == 10
    release_exports(req)
    assert exportable_tokens(req, 100) == 100


def test_a_verdict_leaves_the_hold_while_another_load_of_the_request_waits(logs):
    """Two synchronous loads of one request waiting at once (steps 5 and 6;
    with pipeline parallelism the batch queue holds several steps): the
    first verdict leaves the request held, the second releases it. (The
    scheduler's pending loads are set by the test.)"""
    from vllm_kvchecksum.engine.export_guard import exportable_tokens, hold_exports
    B = _sync_side()
    checksums = B.scheduler.kv_checksum
    req = SimpleNamespace(request_id="r")
    hold_exports(req, 16)
    checksums._sync = {step: {"r": SimpleNamespace(request=req, held={}, records=[], ended=False)} for step in (5, 6)}
    checksums._judge = lambda rid, pending: None  # not checked: a load that does not fail
    checksums.verify_sync_loads(SimpleNamespace(step=5))
    assert exportable_tokens(req, 100) == 16
    checksums.verify_sync_loads(SimpleNamespace(step=6))
    assert exportable_tokens(req, 100) == 100
