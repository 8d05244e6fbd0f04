"""A consumer load's blocks reach the workers once, and no worker keeps them
after the scheduler stops waiting for the load.

The scheduler sends a load's blocks in the step it starts; each worker keeps
them until its own connector reports the load finished (then checksums and
drops them) or the scheduler says to forget the request: it ended, its load
failed, or the load was compared. The workers here are the harness's real
KVChecksumWorkers, reused across steps as in a real worker process.
"""

from __future__ import annotations

import time

import pytest
from pd_harness import make_request, make_side, prefill, prompt_of, stats
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.v1.request import RequestStatus

from vllm_kvchecksum.core.records import GroupBlocks, KVChecksumBlocks, KVChecksumScheduled
from vllm_kvchecksum.engine.runner import checksum_step

PROMPT = 77



def kept_on_workers(side) -> set[str]:
    """The requests whose loads any worker still keeps blocks for."""
    return set().union(*(w.checksums.pending_load_ids for w in side.workers))


def awaited_by_scheduler(side) -> set[str]:
    return set(side.scheduler.kv_checksum._recvs)


def add_loads(P, C, seeds):
    """Consumer requests for producer prefills of prompt_of(PROMPT, seed); not scheduled yet."""
    pairs = []
    for seed in seeds:
        preq, params = prefill(P, prompt_of(PROMPT, seed=seed))
        req = make_request(preq.prompt_token_ids, params=dict(params))
        C.scheduler.add_request(req)
        pairs.append((req, preq))
    return pairs


def transfer(P, C, pairs):
    """What the connector's transfer writes into the consumer's blocks."""
    for req, preq in pairs:
        assert req.status is RequestStatus.WAITING_FOR_REMOTE_KVS, req.status
        C.write_tokens(req.request_id, 0, req.num_computed_tokens, source=P, source_id=preq.request_id)


def start_loads(P, C, seeds):
    """Consumer loads that start in one step; returns that step's output and the requests."""
    pairs = add_loads(P, C, seeds)
    out, _ = C.step()
    transfer(P, C, pairs)
    return out, [req for req, _ in pairs]


def ids(reqs) -> set[str]:
    return {r.request_id for r in reqs}


def test_blocks_are_sent_once_and_steady_steps_carry_nothing():
    P = make_side("kv_producer", fail_closed=True)
    C = make_side("kv_consumer", tp=2, fail_closed=True)
    decoding = make_request(prompt_of(40, seed=50), max_tokens=30)
    C.scheduler.add_request(decoding)
    C.step()
    out, loads = start_loads(P, C, seeds=[1, 2])
    assert set(out.kv_checksum_scheduled.reqs_to_recv) == ids(loads)
    for _ in range(2):
        # An ordinary decode step with the loads in flight: no checksum part.
        out, _ = C.step()
        assert out.num_scheduled_tokens.get(decoding.request_id) == 1
        assert out.kv_checksum_scheduled is None
        assert kept_on_workers(C) == ids(loads)
    C.step(finished_recving=ids(loads))
    assert stats(C) == {"verified": 2}
    assert kept_on_workers(C) == set() and awaited_by_scheduler(C) == set()
    # The compared loads are forgotten once, then steps are quiet again.
    out, _ = C.step()
    assert out.kv_checksum_scheduled.reqs_to_forget == ids(loads)
    assert not out.kv_checksum_scheduled.reqs_to_recv
    out, _ = C.step()
    assert out.kv_checksum_scheduled is None


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)], ids=lambda v: str(v))
def test_abort_while_loading_leaves_nothing_on_any_worker(tp, pp):
    P = make_side("kv_producer", fail_closed=True)
    C = make_side("kv_consumer", tp=tp, pp=pp, fail_closed=True)
    _, (aborted, kept) = start_loads(P, C, seeds=[1, 2])
    C.scheduler.finish_requests(aborted.request_id, RequestStatus.FINISHED_ABORTED)
    out, _ = C.step()
    assert out.kv_checksum_scheduled.reqs_to_forget == {aborted.request_id}
    assert kept_on_workers(C) == {kept.request_id}
    # The aborted transfer completes later, with the other load: only that one is checked.
    C.step(finished_recving=ids([aborted, kept]))
    assert stats(C) == {"verified": 1}
    assert kept_on_workers(C) == set() and awaited_by_scheduler(C) == set()


@pytest.mark.parametrize("failure", ["connector", "mismatch"])
@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_failed_loads_leave_nothing_on_any_worker(failure, policy):
    P = make_side("kv_producer", fail_closed=True)
    C = make_side("kv_consumer", tp=2, fail_closed=True, policy=policy)
    _, (req,) = start_loads(P, C, seeds=[1])
    if failure == "mismatch":
        C.corrupt(req.request_id, position=2)
    failed = {req.request_id} if failure == "connector" else set()
    C.step(finished_recving={req.request_id}, failed_recving=failed)
    # A load the connector failed is not compared.
    assert stats(C) == ({} if failure == "connector" else {"mismatch": 1})
    assert req.is_finished() == (policy == "fail")
    C.step()
    assert kept_on_workers(C) == set() and awaited_by_scheduler(C) == set()


def test_load_that_one_worker_never_reports_is_forgotten_after_the_comparison():
    # A connector whose transfers finish on one worker's report
    # (get_finished_count() == 1): the other worker's connector never
    # reports the load, so only the scheduler can tell it to drop it.
    P = make_side("kv_producer")
    C = make_side("kv_consumer", tp=2)
    C.aggregator = KVOutputAggregator(1)
    _, (req,) = start_loads(P, C, seeds=[1])
    C.step(finished_on={0: {req.request_id}})
    assert sum(stats(C).values()) == 1 and "verified" not in stats(C)  # one worker's part only
    assert C.workers[1].checksums.pending_load_ids == {req.request_id}
    out, _ = C.step()
    assert out.kv_checksum_scheduled.reqs_to_forget == {req.request_id}
    assert kept_on_workers(C) == set()


def test_workers_reporting_a_load_in_different_steps_each_keep_it_until_their_own_report():
    P = make_side("kv_producer", fail_closed=True)
    C = make_side("kv_consumer", tp=2, fail_closed=True)
    _, (req,) = start_loads(P, C, seeds=[1])
    C.step(finished_on={0: {req.request_id}})
    assert stats(C) == {}
    assert C.workers[0].checksums.pending_load_ids == set()
    assert C.workers[1].checksums.pending_load_ids == {req.request_id}
    C.step(finished_on={1: {req.request_id}})
    assert stats(C) == {"verified": 1}
    assert kept_on_workers(C) == set()


def test_preemption_while_a_load_is_in_flight():
    # vLLM preempts only running requests (Scheduler._preempt_request), so a
    # load in flight (WAITING_FOR_REMOTE_KVS) is never preempted itself:
    # preempting the others must leave it alone, and a request preempted
    # after its load was compared must leave nothing behind.
    P = make_side("kv_producer", fail_closed=True)
    C = make_side("kv_consumer", tp=2, fail_closed=True)
    _, (first,) = start_loads(P, C, seeds=[1])
    C.step(finished_recving={first.request_id})
    C.step()
    assert first.status is RequestStatus.RUNNING
    _, (second,) = start_loads(P, C, seeds=[2])
    preempt(C, first)
    out, _ = C.step()
    assert out.kv_checksum_scheduled is None  # the preempted request is recomputed, not loaded
    assert kept_on_workers(C) == {second.request_id}
    C.step(finished_recving={second.request_id})
    assert stats(C) == {"verified": 2}
    assert kept_on_workers(C) == set() and awaited_by_scheduler(C) == set()


def preempt(side, request):
    """What Scheduler.schedule does to a running request when blocks run out."""
    side.scheduler.running.remove(request)
    side.scheduler._preempt_request(request, time.monotonic())


def test_outputs_in_flight_reach_the_workers_in_order():
    # Async scheduling and PP's batch queue schedule the next step before
    # the workers have run the last one; the workers still run them in order.
    P = make_side("kv_producer", fail_closed=True)
    C = make_side("kv_consumer", tp=2, pp=2, fail_closed=True)
    [(aborted, _)] = add_loads(P, C, seeds=[1])
    first = C.scheduler.schedule()
    C.scheduler.finish_requests(aborted.request_id, RequestStatus.FINISHED_ABORTED)
    [(kept, kept_source)] = add_loads(P, C, seeds=[2])
    second = C.scheduler.schedule()
    assert set(first.kv_checksum_scheduled.reqs_to_recv) == {aborted.request_id}
    assert second.kv_checksum_scheduled.reqs_to_forget == {aborted.request_id}
    assert set(second.kv_checksum_scheduled.reqs_to_recv) == {kept.request_id}
    transfer(P, C, [(kept, kept_source)])
    merged_first = C.run_workers(first)
    # The aborted transfer completes in the second step: forgotten first, so not checksummed.
    merged_second = C.run_workers(second, finished_recving={aborted.request_id})
    assert merged_second.kv_connector_output.kv_checksums is None
    assert kept_on_workers(C) == {kept.request_id}
    C.update(first, merged_first)
    C.update(second, merged_second)
    C.step(finished_recving={kept.request_id})
    assert stats(C) == {"verified": 1}
    assert kept_on_workers(C) == set() and awaited_by_scheduler(C) == set()


def test_a_load_forgotten_before_it_is_sent_is_never_sent():
    C = make_side("kv_consumer")
    req = make_request(prompt_of(PROMPT), params={"do_remote_prefill": True})
    checksums = C.scheduler.kv_checksum
    checksums.add_recv(req, ([1, 2, 3, 4, 5],), 0, PROMPT)
    checksums.forget(req.request_id)
    scheduled = checksums.build_checksum_meta()
    assert scheduled.reqs_to_recv == {} and scheduled.reqs_to_forget == {req.request_id}
    worker = C.workers[0].checksums
    checksum_step(worker, scheduled, None)
    assert worker.pending_load_ids == set()


def blocks(num_blocks):
    return KVChecksumBlocks(num_blocks * 16, {0: GroupBlocks(0, tuple(range(1, num_blocks + 1)))})


def test_forget_applies_before_a_new_load_of_the_same_request():
    # The scheduler dropped the request's old load, then a new one started,
    # both in one step: the worker must keep the new one.
    worker = make_side("kv_consumer").workers[0].checksums
    checksum_step(worker, KVChecksumScheduled(reqs_to_recv={"r": blocks(1)}), None)
    out = checksum_step(worker, KVChecksumScheduled(reqs_to_recv={"r": blocks(3)}, reqs_to_forget={"r"}), {"r"})
    assert out.records[0].requests["r"][0].num_blocks == 3
    assert worker.pending_load_ids == set()


def test_load_finishing_in_the_step_it_starts_is_checksummed_once():
    # The V1 runner calls checksum_step twice for one scheduler output when
    # a drafter runs: the second call (sends only) must not add the load again.
    worker = make_side("kv_consumer").workers[0].checksums
    scheduled = KVChecksumScheduled(reqs_to_recv={"r": blocks(2)})
    out = checksum_step(worker, scheduled, {"r"}, sends=False)
    assert set(out.records[0].requests) == {"r"}
    assert checksum_step(worker, scheduled, None, recvs=False) is None
    assert worker.pending_load_ids == set()


def test_received_checksums_are_kept_only_for_this_workers_pending_loads():
    """A connector-owned carrier's bytes come from another host: a worker
    keeps those of loads it waits for (bytes only), with or before the load
    finishing, and drops the rest."""
    worker = make_side("kv_consumer").workers[0].checksums
    checksum_step(worker, KVChecksumScheduled(reqs_to_recv={"r": blocks(2), "s": blocks(1)}), None)
    # Before the load finishes: a record with the received bytes only.
    out = checksum_step(worker, None, None, received={"r": b"R", "unknown": b"U", "s": "not bytes"})
    [record] = out.records
    assert record.received == {"r": b"R"} and record.requests == {}
    # With the load: the same record as its checksums.
    out = checksum_step(worker, None, {"s"}, received={"s": b"S"})
    [record] = out.records
    assert record.received == {"s": b"S"} and set(record.requests) == {"s"}
    # Nothing for loads the worker does not wait for.
    assert checksum_step(worker, None, None, received={"unknown": b"U"}) is None
