"""A push consumer that registers after the producer's lease ran out fails its load; it never waits forever.

In NIXL push mode the producer keeps a finished request's blocks for a
lease and WRITEs them when the consumer's registration (PUSH_REG) arrives.
Under pressure a consumer may allocate its blocks, and so register, only
after the lease ran out and the producer freed the blocks. vLLM v0.32 kept
such a registration forever, unanswered, and the consumer held its blocks
and its request waiting for a WRITE that never came (found by `make soak
--mode push` with a 5 s lease: requests never answered). The patched
producer answers a late registration with PUSH_GONE, in place of the WRITE's
completion notif; the consumer fails the load through the connector's
load-failure path, and the scheduler applies kv_load_failure_policy.

The push workers are built without __init__ (as vLLM's own NIXL push tests
do: a full worker needs a running engine's handshake); the methods under
test are the real ones, wired producer to consumer by a stand-in for the
NIXL agents' notification delivery (send_notif puts the bytes where the
consumer's writer thread forwards them). The consumer's side is the real
vLLM Scheduler with NixlPushConnector and the real checksum workers
(pd_harness).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import msgspec
import pytest
from pd_harness import CONNECTORS, forward_of, make_request, make_side, prompt_of, stats
from push_pair import expire, push_worker, registration, wired_pair
from vllm.v1.request import RequestStatus

nixl_metadata = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata")
pytestmark = pytest.mark.skipif(not hasattr(nixl_metadata, "PUSH_GONE_NOTIF_PREFIX"),
                                reason="the series' prefixes before the push lease-expiry patch")

PROMPT = 77


@pytest.mark.parametrize("drained", [True, False], ids=["eviction-drained", "eviction-pending"])
def test_a_late_registration_fails_the_load_instead_of_waiting(drained):
    # Each leg's engine adds its own random suffix to the client's request id.
    producer_id, consumer_id = "req-1-0a1b2c3d", "req-1-9f8e7d6c"
    p, d = wired_pair()
    expire(p, producer_id, ([3, 4],))
    if drained:
        p._drain_evictions()
    d._recving_metadata[consumer_id] = SimpleNamespace(pp_size=1, local_block_ids=([7, 8],))

    # The consumer names the producer's request (its kv_transfer_params came
    # from the producer): the released attempt is answered at once.
    p._handle_push_reg_notif(registration(consumer_id, ([7, 8],), names=producer_id))
    # Every consumer rank registers with every producer rank: one answer.
    p._handle_push_reg_notif(registration(consumer_id, ([7, 8],), names=producer_id))
    assert p.nixl_wrapper.send_notif.call_count == 1
    results = d.get_transfer_results()

    assert results.failed_recving == {consumer_id}
    assert consumer_id in results.finished_recving
    assert d.xfer_stats.data["num_failed_transfers"] == [1]
    # No WRITE: the producer's blocks hold other requests' KV by now.
    p._xfer_blocks_for_req.assert_not_called()
    assert d._invalid_block_ids.get_nowait() == {7, 8}
    assert p._pending_d_registrations == {}


def test_a_registration_in_time_is_written_not_answered_gone():
    p, d = wired_pair()
    p._push_finished_blocks["req-2"] = ([3, 4],)
    p._reqs_to_send["req-2"] = time.perf_counter() + 60
    p._reqs_to_process.add("req-2")

    p._handle_push_reg_notif(registration("req-2", ([7, 8],)))

    p._xfer_blocks_for_req.assert_called_once()
    assert d._pending_completion_notifs.empty()


def test_a_request_written_before_its_lease_ran_out_is_not_answered_gone():
    """A WRITE still in flight when the lease runs out carries its own
    completion notif; a late duplicate registration must not add a "gone"
    that the consumer could count first and fail a load that was written."""
    p, d = wired_pair()
    p._push_finished_blocks["req-7"] = ([3, 4],)
    p._handle_push_reg_notif(registration("req-7", ([7, 8],)))
    p._xfer_blocks_for_req.assert_called_once()
    expire(p, "req-7")
    p._drain_evictions()

    p._handle_push_reg_notif(registration("req-7", ([7, 8],)))

    assert d._pending_completion_notifs.empty()
    assert p._push_gone() == {}


def test_producer_tp2_one_rank_wrote_one_lost_the_kv_fails_when_both_answered():
    """A consumer waits for one notif per writing producer rank; a load one
    rank lost is incomplete whatever the other wrote, in either order."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import PUSH_GONE_NOTIF_PREFIX

    for first, second in [(b"gone", b"wrote"), (b"wrote", b"gone")]:
        d = push_worker("consumer")
        d._recving_metadata["req-3"] = SimpleNamespace(pp_size=1, local_block_ids=([7],))
        notif = {b"gone": PUSH_GONE_NOTIF_PREFIX + b"req-3:2", b"wrote": b"req-3:2"}
        d._pending_completion_notifs.put(notif[first])
        assert d.get_transfer_results().finished_recving == set()
        d._pending_completion_notifs.put(notif[second])
        assert d.get_transfer_results().failed_recving == {"req-3"}
        assert d._push_gone_recvs() == set()


def test_a_gone_notif_names_a_request_whose_id_holds_colons():
    """The TP size is what follows the last colon, as in a completion notif."""
    p, d = wired_pair()
    rid = "tenant:a:req-9-0a1b2c3d"
    expire(p, rid, ([3],))
    d._recving_metadata[rid] = SimpleNamespace(pp_size=1, local_block_ids=([7],))

    p._handle_push_reg_notif(registration(rid, ([7],), names=rid))

    assert d.get_transfer_results().failed_recving == {rid}


def test_the_answer_waits_for_the_handshake_with_the_consumer():
    """A producer that has not met this consumer yet (the lease ran out
    before any registration) answers once the handshake is done, as a write
    would go."""
    p, d = wired_pair()
    handshake = Future()
    p._ensure_handshake.return_value = handshake
    expire(p, "req-10-0a1b2c3d", ([3],))
    p._drain_evictions()
    d._recving_metadata["req-10-9f8e7d6c"] = SimpleNamespace(pp_size=1, local_block_ids=([7],))

    p._handle_push_reg_notif(registration("req-10-9f8e7d6c", ([7],), names="req-10-0a1b2c3d"))
    assert d._pending_completion_notifs.empty()
    p._ensure_handshake.return_value = None
    handshake.set_result(({(0, 0): "consumer-agent"}, 0.0))
    p._drain_deferred_pushes()  # the writer's step 2

    assert d.get_transfer_results().failed_recving == {"req-10-9f8e7d6c"}


def test_producer_tp2_a_rank_that_lost_the_kv_waits_for_the_rank_that_writes():
    """The notif carries the producer's TP size (2), not the rank: the
    consumer must not fail the load while the other rank's WRITE is in flight."""
    p, d = wired_pair()
    p.world_size, p.tp_rank = 2, 0
    rid = "req-11-0a1b2c3d"
    expire(p, rid, ([3],))
    d._recving_metadata[rid] = SimpleNamespace(pp_size=1, local_block_ids=([7],))

    p._handle_push_reg_notif(registration(rid, ([7],), names=rid))
    assert d.get_transfer_results().failed_recving == set()
    d._pending_completion_notifs.put(rid.encode() + b":2")  # rank 1's WRITE landed

    assert d.get_transfer_results().failed_recving == {rid}


def test_write_ranks_widen_to_every_consumer_rank_only_for_pure_mla():
    """The ranks answered are the ranks written: MLA's latent is replicated
    on every consumer rank, so pure MLA writes them all; a hybrid MLA + SSM
    model writes the ranks of its plan."""
    p, _ = wired_pair()
    p.use_mla, p.transfer_topo.tp_ratio.return_value = True, -2
    p.dst_xfer_side_handles = {"consumer": {0: "h0", 1: "h1"}}
    assert p._push_write_ranks("consumer") == [0, 1]
    p._has_mamba = True
    assert p._push_write_ranks("consumer") == [0]


def test_an_idle_producers_writer_answers_without_its_engine_waking_it():
    """The writer thread, running: nothing sets its wake event (the engine is
    idle), and the late registration is still read and answered."""
    p, d = wired_pair()
    rid = "req-12-0a1b2c3d"
    expire(p, rid, ([3],))
    p._drain_evictions()
    d._recving_metadata[rid] = SimpleNamespace(pp_size=1, local_block_ids=([7],))
    arrivals = [{}, {"consumer-agent": [registration(rid, ([7],), names=rid)]}]
    p.nixl_wrapper.get_new_notifs.side_effect = lambda: arrivals.pop(0) if arrivals else {}
    p._push_writer_wake.clear()  # set by the expiry's transfer results
    writer = threading.Thread(target=p._push_writer_loop, daemon=True)
    writer.start()

    def wait_for(done) -> None:
        # A liveness bound, not a speed measure: the writer polls every 50 ms.
        deadline = time.monotonic() + 30
        while not done() and time.monotonic() < deadline:
            time.sleep(0.01)

    try:
        wait_for(lambda: not d._pending_completion_notifs.empty())
        answered_unwoken = not d._pending_completion_notifs.empty()
        # Answered: the writer parks again until the engine hands it work.
        p._finished_blocks_inbox.put(("req-13", ([5],), None))
        arrivals.append({"consumer-agent": [registration("req-13", ([9],))]})
        p._push_writer_wake.set()
        wait_for(lambda: p._xfer_blocks_for_req.called)
    finally:
        p._push_writer_stop.set()
        p._push_writer_wake.set()
        writer.join(30)

    assert answered_unwoken
    assert d.get_transfer_results().failed_recving == {rid}
    assert p._xfer_blocks_for_req.call_count == 1


def test_a_retry_reusing_the_client_id_is_written_and_the_late_original_answered_gone():
    """Registrations match finished blocks by base id (the client's request
    id; each engine adds a random suffix). A retry reusing the id of a
    request released unpushed gets its KV; duplicates are told apart by the
    consumer's full id, so the retry never hears "gone" after its WRITE."""
    p, d = wired_pair()
    expire(p, "abc-0000aaaa", ([3],))  # the original: its consumer never registered in time
    p._drain_evictions()
    p._push_finished_blocks["abc-3333cccc"] = ([5],)  # the retry, finished on the producer

    p._handle_push_reg_notif(registration("abc-4444dddd", ([9],)))  # the retry's consumer, rank 0
    p._xfer_blocks_for_req.assert_called_once()
    p._handle_push_reg_notif(registration("abc-4444dddd", ([9],)))  # ... and rank 1
    assert d._pending_completion_notifs.empty()
    d._recving_metadata["abc-1111bbbb"] = SimpleNamespace(pp_size=1, local_block_ids=([7],))
    # The original's, at last: its consumer had the producer's params.
    p._handle_push_reg_notif(registration("abc-1111bbbb", ([7],), names="abc-0000aaaa"))

    assert d.get_transfer_results().failed_recving == {"abc-1111bbbb"}
    p._xfer_blocks_for_req.assert_called_once()


def test_a_retry_registered_before_its_prefill_finished_is_written_once_not_answered_gone():
    p, d = wired_pair()
    expire(p, "abc-0000aaaa", ([3],))
    p._drain_evictions()
    p._pending_d_registrations["abc-4444dddd"] = msgspec.msgpack.decode(
        registration("abc-4444dddd", ([9],))[len(b"PUSH_REG:"):])  # rank 0's, kept: no blocks yet
    p._finished_blocks_inbox.put(("abc-3333cccc", ([5],), None))

    p._drain_finished_blocks()
    p._handle_push_reg_notif(registration("abc-4444dddd", ([9],)))  # rank 1's

    p._xfer_blocks_for_req.assert_called_once()
    assert d._pending_completion_notifs.empty()


@pytest.mark.parametrize("named", [True, False], ids=["names-the-attempt", "client-id-only"])
def test_a_lease_that_ran_out_during_the_handshake_is_not_written(named):
    """Named: that registration was this attempt's, answered gone. Paired by
    the client's id alone, it may be a retry's: it is kept for the retry's
    own blocks, and written with them."""
    p, d = wired_pair()
    handshake = Future()
    p._ensure_handshake.return_value = handshake
    rid, retry = "req-14-0a1b2c3d", "req-14-3333cccc"
    p._push_finished_blocks[rid] = ([3],)
    p._reqs_to_send[rid] = time.perf_counter() + 60
    p._reqs_to_process.add(rid)
    d._recving_metadata["req-14-9f8e7d6c"] = SimpleNamespace(pp_size=1, local_block_ids=([7],))
    # Matched; the WRITE waits for the handshake.
    p._handle_push_reg_notif(registration("req-14-9f8e7d6c", ([7],), names=rid if named else "req-14"))
    expire(p, rid)  # meanwhile the lease runs out and the engine frees the blocks
    p._ensure_handshake.return_value = None
    handshake.set_result(({(0, 0): "consumer-agent"}, 0.0))

    p._drain_deferred_pushes()

    p._xfer_blocks_for_req.assert_not_called()
    if named:
        assert d.get_transfer_results().failed_recving == {"req-14-9f8e7d6c"}
        return
    assert d._pending_completion_notifs.empty()
    p._finished_blocks_inbox.put((retry, ([5],), None))
    p._drain_finished_blocks()
    assert p._xfer_blocks_for_req.call_args.kwargs["req_id"] == retry


def test_kv_released_longer_ago_than_the_ttl_is_forgotten(monkeypatch):
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import push_worker as push_module

    p, d = wired_pair()
    expire(p, "req-15", ([3],))
    p._drain_evictions()
    assert p._push_gone_poll_s() is not None
    monkeypatch.setattr(push_module, "_PUSH_GONE_TTL_S", -1.0)

    assert p._push_gone_poll_s() is None
    p._handle_push_reg_notif(registration("req-15", ([7],)))
    assert d._pending_completion_notifs.empty() and "req-15" in p._pending_d_registrations


@pytest.mark.parametrize("field, value", [("decode_port", None), ("decode_engine_id", 7), ("local_block_ids", "x"),
                                          ("remote_request_id", 7)])
def test_a_malformed_registration_is_dropped_before_it_touches_any_state(field, value):
    p, d = wired_pair()
    rid = "req-16-0a1b2c3d"
    expire(p, rid, ([3],))
    p._drain_evictions()
    bad = msgspec.msgpack.decode(registration(rid, ([7],), names=rid)[len(b"PUSH_REG:"):])
    bad[field] = value
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import PUSH_REG_NOTIF_PREFIX

    p._handle_push_reg_notif(PUSH_REG_NOTIF_PREFIX + msgspec.msgpack.encode(bad))
    assert p.xfer_stats.data["num_failed_notifications"] == [1] and d._pending_completion_notifs.empty()
    assert p._pending_d_registrations == {}
    d._recving_metadata[rid] = SimpleNamespace(pp_size=1, local_block_ids=([7],))
    p._handle_push_reg_notif(registration(rid, ([7],), names=rid))

    assert d.get_transfer_results().failed_recving == {rid}


def test_every_consumer_rank_the_producer_writes_hears_gone():
    """Producer TP 1 into consumer TP 2: the producer writes both ranks, so both
    must hear the answer, or one of them waits forever."""
    p, d0 = wired_pair()
    d1 = push_worker("consumer")
    p._remote_agents = {"consumer": {(0, 0): "d0", (0, 1): "d1"}}
    p.tp_mappings = {"consumer": SimpleNamespace(all_source_ranks=[0, 1])}
    ranks = {"d0": d0, "d1": d1}
    tries = []

    def send_notif(agent, notif_msg):
        tries.append(agent)
        if len(tries) == 1:
            raise RuntimeError("UCX: connection reset")  # one rank's answer is lost...
        ranks[agent]._pending_completion_notifs.put(notif_msg)

    p.nixl_wrapper.send_notif.side_effect = send_notif
    rid = "req-4-0a1b2c3d"
    expire(p, rid, ([3],))
    for d in (d0, d1):
        d._recving_metadata[rid] = SimpleNamespace(pp_size=1, local_block_ids=([7],))

    p._handle_push_reg_notif(registration(rid, ([7],), names=rid))

    # ...the other rank still hears it.
    assert tries == ["d0", "d1"]
    assert [d.get_transfer_results().failed_recving for d in (d0, d1)] == [set(), {rid}]
    assert p.xfer_stats.data["num_failed_notifications"] == [1]


@pytest.mark.parametrize("payload", [b"req-5", b"req-5:", b"req-5:two", b"\xff:1x", "req-5:\u00b2".encode(),
                                     b":1", b"req-5:" + b"9" * 5000])
@pytest.mark.parametrize("kind", ["gone", "completion"])
def test_a_malformed_notif_from_another_host_is_dropped(payload, kind):
    """Never raised into the engine loop: the PUSH_GONE notif and vLLM's
    plain completion notif ("request_id:tp_size") alike."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import PUSH_GONE_NOTIF_PREFIX

    d = push_worker("consumer")
    d._recving_metadata["req-5"] = SimpleNamespace(pp_size=1, local_block_ids=([7],))
    d._pending_completion_notifs.put((PUSH_GONE_NOTIF_PREFIX if kind == "gone" else b"") + payload)

    results = d.get_transfer_results()

    assert results.finished_recving == set() and results.failed_recving == set()
    assert d.xfer_stats.data["num_failed_notifications"] == [1]


def test_an_idle_producer_keeps_reading_registrations_while_released_kv_awaits_one():
    """The writer parks until the engine wakes it, and an idle engine never
    does: while KV released on expiry may still be asked for, it polls."""
    p, _ = wired_pair()
    assert p._push_gone_poll_s() is None
    expire(p, "req-8-0a1b2c3d", ([3],))
    p._drain_evictions()
    assert p._push_gone_poll_s() is not None and p._push_gone_poll_s() > 0

    p._handle_push_reg_notif(registration("req-8-9f8e7d6c", ([7],), names="req-8-0a1b2c3d"))

    assert p._push_gone_poll_s() is None


def test_the_producer_remembers_a_bounded_number_of_released_requests(monkeypatch):
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import push_worker as push_module

    monkeypatch.setattr(push_module, "_MAX_RELEASED_ON_EXPIRY", 2)
    p, _ = wired_pair()
    for i in range(3):
        expire(p, f"req-{i}", ([i],))
    p._drain_evictions()

    assert list(p._push_gone()) == ["req-1", "req-2"]


def test_a_gone_answer_is_dropped_with_the_load_it_was_for():
    """A load that ends (its request aborted) before every producer rank
    answered leaves nothing behind."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import PUSH_GONE_NOTIF_PREFIX

    d = push_worker("consumer")
    d._recving_metadata["req-6"] = SimpleNamespace(pp_size=1, local_block_ids=([7],))
    d._pending_completion_notifs.put(PUSH_GONE_NOTIF_PREFIX + b"req-6:2")
    d.get_transfer_results()
    assert d._push_gone_recvs() == {"req-6"}
    del d._recving_metadata["req-6"]

    assert d._push_gone_recvs() == set()


def attempt(side, prompt: list[int], request_id: str, *, params: dict | None = None, remote_decode=False):
    """A request of `side` under vLLM's internal id form: the client's id and
    the engine's random 8-hex suffix (what NIXL push pairs by, less the
    suffix)."""
    req = make_request(prompt, remote_decode=remote_decode, params=params, block_size=side.block_size)
    req.request_id = request_id
    return req


def prefill_as(P, prompt: list[int], request_id: str):
    """The producer runs `request_id` to its end (pd_harness.prefill, with
    the id chosen): its kv_transfer_params, and the blocks and checksums its
    scheduler ships to its push workers."""
    req = attempt(P, prompt, request_id, remote_decode=True)
    P.scheduler.add_request(req)
    forward = forward_of(P, req)
    for _ in range(8):
        _, outputs = P.step(forward=forward)
        if req.request_id in outputs and outputs[req.request_id].kv_transfer_params is not None:
            params = dict(outputs[req.request_id].kv_transfer_params)
            out, _ = P.step()
            meta = out.kv_connector_metadata
            return req, params, meta.push_finished_blocks[request_id], meta.push_finished_kv_checksums[request_id]
    raise AssertionError("the producer request did not finish")


def consumer_registration(C, req, p) -> bytes:
    """What the consumer's push worker sends for `req`: the registration its
    real scheduler staged (the step that allocated the blocks). The producer
    worker `p` reaches that consumer engine (see push_pair.wired_pair)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import PUSH_REG_NOTIF_PREFIX

    C.scheduler.add_request(req)
    out, _ = C.step()
    assert req.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    reg = out.kv_connector_metadata.push_registrations[req.request_id]
    p._remote_agents[reg["decode_engine_id"]] = p._remote_agents["consumer"]
    p.tp_mappings[reg["decode_engine_id"]] = p.tp_mappings["consumer"]
    return PUSH_REG_NOTIF_PREFIX + msgspec.msgpack.encode(reg)


@pytest.mark.parametrize("retry_prompt", ["same-prompt", "new-prompt"])
def test_a_retry_registered_before_its_prefill_ends_gets_its_own_kv_not_gone(retry_prompt):
    """Issue 44 §2. Attempt 1 of X-Request-Id "abc" finished on the producer;
    its consumer never registered and its lease ran out. The client retries
    under the same id, and (the push proxy's order) the retry's consumer
    registers before the retry's prefill ends. Its registration names the
    client's id only: it is not answered gone, it waits for the retry's own
    blocks, and the load verifies on the consumer's real scheduler."""
    P = make_side("kv_producer", connector=CONNECTORS["push"])
    C = make_side("kv_consumer", connector=CONNECTORS["push"], fail_closed=True, policy="fail")
    first, retry = "abc-0000aaaa", "abc-3333cccc"
    _, _, blocks_1, checksums_1 = prefill_as(P, prompt_of(PROMPT), first)
    new_prompt = prompt_of(PROMPT, seed=1) if retry_prompt == "new-prompt" else prompt_of(PROMPT)
    p, d = wired_pair()
    p._finished_blocks_inbox.put((first, blocks_1, checksums_1))
    p._drain_finished_blocks()
    expire(p, first)
    p._drain_evictions()
    P.step(finished_sending={first})  # the producer's engine frees attempt 1's blocks
    assert list(p._push_gone()) == [first]

    preq, params, blocks_2, checksums_2 = prefill_as(P, new_prompt, retry)
    push_proxy_params = dict(params, remote_request_id="abc", remote_block_ids=None)  # base id only
    req = attempt(C, new_prompt, "abc-4444dddd", params=push_proxy_params)
    reg = consumer_registration(C, req, p)
    d._recving_metadata[req.request_id] = SimpleNamespace(pp_size=1, local_block_ids=([7],))
    p._handle_push_reg_notif(reg)  # before the retry's blocks reach the push worker
    p._answer_unclaimed_regs()
    assert d._pending_completion_notifs.empty()
    assert req.request_id in p._pending_d_registrations

    p._reqs_to_process.add(retry)  # scheduled here; then its prefill ends
    p._push_unclaimed_regs()[req.request_id] = time.monotonic() - 1  # even a lease later
    p._answer_unclaimed_regs()
    assert d._pending_completion_notifs.empty() and p._push_unclaimed_regs() == {}
    p._finished_blocks_inbox.put((retry, blocks_2, checksums_2))
    p._drain_finished_blocks()

    write = p._xfer_blocks_for_req.call_args.kwargs
    assert write["req_id"] == retry and write["meta"].remote.request_id == req.request_id
    assert [list(g) for g in write["meta"].remote.block_ids] == [
        list(g) for g in C.scheduler.kv_cache_manager.get_block_ids(req.request_id)]
    C.write_tokens(req.request_id, 0, req.num_computed_tokens, source=P, source_id=preq.request_id)
    d._pending_completion_notifs.put(p._completion_notif(retry, req.request_id))
    d._get_new_notifs()  # the consumer worker counts the WRITE's notif: the load is done
    assert req.request_id in d._recving_transfers and d._failed_recv_reqs.empty()
    received = {req.request_id: d._received_kv_checksums[req.request_id]}
    C.step(finished_recving={req.request_id}, received=received)
    out, _ = C.step()
    assert stats(C) == {"verified": 1}
    assert out.num_scheduled_tokens.get(req.request_id, 0) > 0  # it runs on the KV it received
    # Attempt 1 is still remembered: its own late registration is answered.
    assert list(p._push_gone()) == [first]


def test_a_registration_naming_another_attempt_is_never_answered_for_this_one():
    """A consumer that knows its producer request by its full id (the
    producer's kv_transfer_params) waits for that one; the released
    attempt's memory does not answer it, nor do its blocks match another."""
    p, d = wired_pair()
    expire(p, "abc-0000aaaa", ([3],))
    p._drain_evictions()
    p._push_finished_blocks["abc-5555eeee"] = ([4],)  # a third attempt, finished
    d._recving_metadata["abc-4444dddd"] = SimpleNamespace(pp_size=1, local_block_ids=([9],))
    p._push_lease_s = 0.0

    p._handle_push_reg_notif(registration("abc-4444dddd", ([9],), names="abc-3333cccc"))
    p._answer_unclaimed_regs()

    assert d._pending_completion_notifs.empty()
    p._finished_blocks_inbox.put(("abc-6666ffff", ([6],), None))  # a fourth finishes
    p._drain_finished_blocks()
    p._xfer_blocks_for_req.assert_not_called()
    p._finished_blocks_inbox.put(("abc-3333cccc", ([5],), None))
    p._drain_finished_blocks()
    assert p._xfer_blocks_for_req.call_args.kwargs["req_id"] == "abc-3333cccc"


def test_a_late_registration_naming_only_the_client_id_is_answered_once_no_attempt_came():
    """The push proxy gives the consumer the client's id only. A registration
    for KV released under that id waits the producer's lease for an attempt
    to be scheduled here; none came, so it was the released one's: gone."""
    p, d = wired_pair()
    expire(p, "req-17-0a1b2c3d", ([3],))
    p._drain_evictions()
    d._recving_metadata["req-17-9f8e7d6c"] = SimpleNamespace(pp_size=1, local_block_ids=([7],))

    p._handle_push_reg_notif(registration("req-17-9f8e7d6c", ([7],), names="req-17"))
    p._answer_unclaimed_regs()
    assert d._pending_completion_notifs.empty()  # the lease (30 s) has not run out
    p._push_unclaimed_regs()["req-17-9f8e7d6c"] = time.monotonic() - 1  # now it has

    p._answer_unclaimed_regs()

    assert d.get_transfer_results().failed_recving == {"req-17-9f8e7d6c"}
    assert p._pending_d_registrations == {} and p._push_gone() == {} and p._push_unclaimed_regs() == {}
    p._xfer_blocks_for_req.assert_not_called()


def test_the_consumer_scheduler_ends_the_load_by_its_failure_policy():
    """The consumer's real scheduler gets the failed load from the push
    worker's own transfer results: vLLM's load-failure path ends the request
    (policy "fail"), it is not a checksum verdict, and nothing stays held.
    The registration is the one the consumer's scheduler staged, naming the
    producer's request from its kv_transfer_params."""
    P = make_side("kv_producer", connector=CONNECTORS["push"])
    C = make_side("kv_consumer", connector=CONNECTORS["push"], fail_closed=True, policy="fail")
    preq, params, blocks, _ = prefill_as(P, prompt_of(PROMPT), "req-18-0a1b2c3d")
    req = attempt(C, preq.prompt_token_ids, "req-18-9f8e7d6c", params=params)
    p, d = wired_pair()
    reg = consumer_registration(C, req, p)
    expire(p, preq.request_id, blocks)
    d._recving_metadata[req.request_id] = SimpleNamespace(pp_size=1, local_block_ids=([7],))
    p._handle_push_reg_notif(reg)
    results = d.get_transfer_results()
    C.step(finished_recving=results.finished_recving, failed_recving=results.failed_recving)

    assert req.status is RequestStatus.FINISHED_ERROR
    assert stats(C) == {}
    assert not C.scheduler.kv_checksum._recvs
