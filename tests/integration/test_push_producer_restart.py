"""A push consumer survives a producer restart: the loads the dead producer can no longer write fail by policy, and the next loads reach the new one.

A restarted producer keeps its engine id (routers and proxies name it) but
comes back with new NIXL agents. vLLM v0.32's push consumer kept the dead
agents: every later registration failed to send, and the push worker kept
such a receive pending, as an earlier registration might still bring a WRITE;
the loads registered before the death waited for a WRITE that could never
come. Their requests held their blocks and never got an answer (found by
`make soak --mode push --kill-producer`: 19 of 30 requests unanswered). The
patched consumer fails a load whose registration reached no producer rank
(nothing can write it), drops the unreachable agents so the next registration
handshakes again, and fails a load whose registration reached only agents a
new handshake has since replaced.

The NIXL agents are stand-ins (see push_pair): `send_notif` raises for an
agent whose process is gone, as NIXL does (NIXL_ERR_REMOTE_DISCONNECT), and a
handshake returns the agents of whichever producer process listens now. The
consumer's scheduler in the first test is the real vLLM Scheduler with
NixlPushConnector and the checksum workers (pd_harness).

With a consumer of TP > 1 (the last tests) each consumer rank handshakes, as
vLLM's does, with the producer ranks that write it only, and a producer rank
writes every consumer rank it serves on the first registration it gets: a
consumer rank gives a load up only where no other rank registers with the
producer ranks it missed, so a failed load's blocks never take a WRITE.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import msgspec
import pytest
from log_capture import capture_logger
from pd_harness import CONNECTORS, make_request, make_side, prefill, prompt_of
from push_pair import push_worker, registration
from vllm.v1.request import RequestStatus

push_worker_module = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker")
pytestmark = pytest.mark.skipif(
    not hasattr(push_worker_module.NixlPushConnectorWorker, "_fail_recvs_of_replaced_producers"),
    reason="the series' prefixes before the push producer-restart patch")


class Producer:
    """The producer engine "producer" as the consumer's NIXL agent sees it:
    the agents of the process listening now, and which agents are alive."""

    def __init__(self, *agents: str):
        self.agents = dict(enumerate(agents))
        self.alive = set(agents)
        self.received: list[tuple[str, bytes]] = []

    def restart(self, *agents: str) -> None:
        self.alive -= set(self.agents.values())
        self.agents = dict(enumerate(agents))
        self.alive |= set(agents)

    def send_notif(self, agent: str, notif_msg: bytes) -> None:
        if agent not in self.alive:
            raise RuntimeError("NIXL_ERR_REMOTE_DISCONNECT")
        self.received.append((agent, notif_msg))


def consumer(producer: Producer):
    """A consumer push worker whose handshakes reach `producer`."""
    d = push_worker("consumer")
    d.nixl_wrapper.send_notif.side_effect = producer.send_notif

    def handshake(engine_id, host, port, tp_size, *args, **kwargs):
        with d._handshake_lock:
            d._remote_agents.setdefault(
                engine_id, {(0, rank): name for rank, name in producer.agents.items()})

    d._ensure_handshake = handshake
    return d


def register(d, request_id: str) -> None:
    """The consumer's writer thread sends `request_id`'s registration."""
    d._recving_metadata.setdefault(request_id, SimpleNamespace(pp_size=1, local_block_ids=([7],)))
    reg = msgspec.msgpack.decode(registration(request_id, ([7],))[len(b"PUSH_REG:"):])
    d._send_registration_to_p(request_id, reg)


def test_the_consumer_scheduler_fails_the_dead_producers_loads_and_the_next_load_reaches_the_new_one():
    """Load A registered with the producer, which then died and came back with
    new agents. Load B's registration reaches no agent: it fails at once. Load
    C handshakes again and reaches the new process; A, which only the dead one
    could have written, fails. The real scheduler ends A and B by policy and
    frees their blocks; C waits for the new producer's WRITE."""
    P = make_side("kv_producer", connector=CONNECTORS["push"])
    C = make_side("kv_consumer", connector=CONNECTORS["push"], fail_closed=True, policy="fail")
    reqs = {}
    for name, length in (("A", 77), ("B", 53)):
        _, params = prefill(P, prompt_of(length))
        params.pop("kv_checksums", None)
        reqs[name] = make_request(prompt_of(length), params=dict(params))
        C.scheduler.add_request(reqs[name])
    C.step()
    assert all(r.status is RequestStatus.WAITING_FOR_REMOTE_KVS for r in reqs.values())
    producer = Producer("old-agent")
    d = consumer(producer)
    a, b = reqs["A"].request_id, reqs["B"].request_id

    register(d, a)
    assert [agent for agent, _ in producer.received] == ["old-agent"]
    results = d.get_transfer_results()
    assert not results.failed_recving

    producer.restart("new-agent")
    register(d, b)
    results = d.get_transfer_results()
    assert results.failed_recving == {b}
    assert "producer" not in d._remote_agents
    d.nixl_wrapper.remove_remote_agent.assert_called_once_with("old-agent")
    C.step(finished_recving=results.finished_recving, failed_recving=results.failed_recving)
    assert reqs["B"].status is RequestStatus.FINISHED_ERROR
    assert reqs["A"].status is RequestStatus.WAITING_FOR_REMOTE_KVS

    register(d, "C")
    assert producer.received[-1][0] == "new-agent"
    results = d.get_transfer_results()
    assert results.failed_recving == {a}
    C.step(finished_recving=results.finished_recving, failed_recving=results.failed_recving)
    assert reqs["A"].status is RequestStatus.FINISHED_ERROR
    assert not C.scheduler.kv_checksum._recvs
    assert C.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == \
        C.scheduler.kv_cache_manager.block_pool.num_gpu_blocks - 1  # all but the null block

    assert "C" in d._recving_metadata  # waits for the new producer's WRITE
    # B's undelivered registration is a failed notification; A's end is a
    # failed transfer. Neither is a checksum verdict.
    assert d.xfer_stats.data["num_failed_notifications"] == [1]
    assert d.xfer_stats.data["num_failed_transfers"] == [1]


def test_a_load_a_live_rank_may_still_write_waits_until_every_rank_it_reached_is_replaced():
    """Producer TP 2: the registration reached rank 0 only. Rank 0 may still
    write, so the load waits, also when rank 1 alone restarts; once both
    ranks' agents are new, nothing can write it and it fails."""
    producer = Producer("old-0", "old-1")
    producer.alive.discard("old-1")
    d = consumer(producer)
    register(d, "A")
    assert not d.get_transfer_results().failed_recving
    assert set(d._remote_agents["producer"].values()) == {"old-0", "old-1"}

    d._remote_agents["producer"] = {(0, 0): "old-0", (0, 1): "new-1"}
    assert not d.get_transfer_results().failed_recving
    d._remote_agents["producer"] = {(0, 0): "new-0", (0, 1): "new-1"}
    assert d.get_transfer_results().failed_recving == {"A"}


def test_what_counts_is_the_agents_the_registration_reached_not_all_the_engines():
    """The registration reached rank 0 only (rank 1 was down). Once rank 0's
    agent is replaced, nothing that got it is left, even while rank 1's old
    agent is still listed: the load fails."""
    producer = Producer("old-0", "old-1")
    producer.alive.discard("old-1")
    d = consumer(producer)
    register(d, "A")
    assert not d.get_transfer_results().failed_recving
    d._remote_agents["producer"] = {(0, 0): "new-0", (0, 1): "old-1"}
    assert d.get_transfer_results().failed_recving == {"A"}


def test_a_load_that_reached_both_ranks_waits_while_either_may_write():
    producer = Producer("old-0", "old-1")
    d = consumer(producer)
    register(d, "A")
    d._remote_agents["producer"] = {(0, 0): "old-0", (0, 1): "new-1"}
    assert not d.get_transfer_results().failed_recving
    d._remote_agents["producer"] = {(0, 0): "new-0", (0, 1): "new-1"}
    assert d.get_transfer_results().failed_recving == {"A"}


def test_a_new_handshake_with_the_same_live_producer_fails_nothing():
    """An engine evicted and handshaken again while alive answers with the
    same agents: its loads keep waiting for their WRITEs."""
    producer = Producer("agent-0")
    d = consumer(producer)
    register(d, "A")
    d.get_transfer_results()
    del d._remote_agents["producer"]
    d._ensure_handshake("producer", "127.0.0.1", 5601, 1)
    assert not d.get_transfer_results().failed_recving
    assert "A" in d._recving_metadata


def test_heartbeats_that_reach_no_agent_drop_them_and_a_partial_miss_does_not():
    producer = Producer("old-0", "old-1")
    d = consumer(producer)
    d._ensure_handshake("producer", "127.0.0.1", 5601, 2)
    hb = SimpleNamespace(host="127.0.0.1", port=5601, tp_size=2, dcp_size=1, pp_size=1,
                         req_ids=["A"])
    metadata = SimpleNamespace(heartbeat_by_engine={"producer": hb})

    producer.alive.discard("old-1")
    d._send_heartbeats(metadata)
    d.get_transfer_results()
    assert "producer" in d._remote_agents

    producer.restart("new-0", "new-1")
    d._send_heartbeats(metadata)
    d.get_transfer_results()
    assert "producer" not in d._remote_agents
    d._send_heartbeats(metadata)  # handshakes again: the next heartbeat goes through
    assert set(d._remote_agents["producer"].values()) == {"new-0", "new-1"}


def test_agents_a_new_handshake_replaced_already_are_not_dropped():
    """Reports of an unreachable agent set that is no longer the engine's
    (a handshake replaced it since) leave the new agents alone."""
    producer = Producer("new-agent")
    d = consumer(producer)
    d._ensure_handshake("producer", "127.0.0.1", 5601, 1)
    d._on_unreachable_remote_engine("producer", frozenset({"old-agent"}))
    d.get_transfer_results()
    assert d._remote_agents["producer"] == {(0, 0): "new-agent"}
    d.nixl_wrapper.remove_remote_agent.assert_not_called()


def test_an_instance_that_also_writes_to_the_engine_keeps_its_agents_but_fails_the_load():
    """kv_both: the writer thread may WRITE to that engine with its
    descriptors, which the main thread must not release under it. A load no
    rank received still fails."""
    producer = Producer("old-agent")
    d = consumer(producer)
    d.kv_transfer_config.kv_role = "kv_both"
    d._ensure_handshake("producer", "127.0.0.1", 5601, 1)
    d.dst_xfer_side_handles["producer"] = {0: 11}
    producer.restart("new-agent")
    register(d, "A")
    assert d.get_transfer_results().failed_recving == {"A"}
    assert d._remote_agents["producer"] == {(0, 0): "old-agent"}


def test_an_instance_that_writes_elsewhere_drops_the_dead_producers_agents():
    """kv_both, but with no descriptors for that engine: nothing of this
    worker uses its agents but notifs, so they go."""
    producer = Producer("old-agent")
    d = consumer(producer)
    d.kv_transfer_config.kv_role = "kv_both"
    d.dst_xfer_side_handles["another-consumer"] = {0: 11}
    d._ensure_handshake("producer", "127.0.0.1", 5601, 1)
    producer.restart("new-agent")
    register(d, "A")
    assert d.get_transfer_results().failed_recving == {"A"}
    assert "producer" not in d._remote_agents


def test_agents_reported_twice_are_dropped_once_quietly(caplog):
    """A registration and a heartbeat both miss the dead agents: the second
    report finds them gone and does nothing."""
    producer = Producer("old-agent")
    d = consumer(producer)
    d._ensure_handshake("producer", "127.0.0.1", 5601, 1)
    producer.restart("new-agent")
    with capture_logger(caplog, "vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker"):
        register(d, "A")
        d._on_unreachable_remote_engine("producer", frozenset({"old-agent"}))
        d.get_transfer_results()
    d.nixl_wrapper.remove_remote_agent.assert_called_once_with("old-agent")
    assert not [r for r in caplog.records if "Could not release" in r.getMessage()]
    assert len({id(r) for r in caplog.records if "Dropped the NIXL agents" in r.getMessage()}) == 1


@pytest.mark.parametrize("failing", ["remove_remote_agent", "release_dlist_handle"])
def test_a_failing_agent_teardown_still_drops_the_agents_and_stays_out_of_the_engine_loop(failing):
    """Whichever NIXL call of the teardown fails: a consumer holds descriptors
    for the producer too when a heartbeat made the first, full, handshake."""
    producer = Producer("old-agent")
    d = consumer(producer)
    getattr(d.nixl_wrapper, failing).side_effect = RuntimeError("NIXL_ERR_NOT_FOUND")
    d._ensure_handshake("producer", "127.0.0.1", 5601, 1)
    d.dst_xfer_side_handles["producer"] = {0: 11}
    producer.restart("new-agent")
    register(d, "A")
    assert d.get_transfer_results().failed_recving == {"A"}
    assert "producer" not in d._remote_agents


def test_a_load_that_ended_is_forgotten():
    """What the consumer keeps per registration goes with the load."""
    producer = Producer("agent-0")
    d = consumer(producer)
    register(d, "A")
    d.get_transfer_results()
    assert set(d._push_reg_agents) == {"A"}
    del d._recving_metadata["A"]
    d.get_transfer_results()
    assert d._push_reg_agents == {}


# -- Issue 44 §1: a registration that reached only some producer ranks --------

def waiting_load(tp: int, *, fail_closed: bool = True):
    """A push consumer engine of `tp` ranks (its real scheduler, pd_harness) with one
    load waiting for the KV a real producer prefilled; the producer's checksums left
    out, so the load is judged by its completion alone."""
    C = make_side("kv_consumer", tp=tp, connector=CONNECTORS["push"], fail_closed=fail_closed, policy="fail")
    P = make_side("kv_producer", connector=CONNECTORS["push"])
    _, params = prefill(P, prompt_of(77))
    params.pop("kv_checksums", None)
    req = make_request(prompt_of(77), params=dict(params))
    C.scheduler.add_request(req)
    C.step()
    assert req.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    return C, req


def test_the_consumer_scheduler_fails_a_load_a_producer_rank_never_got_once_the_rank_that_got_it_wrote(caplog):
    """Producer TP 2 into consumer TP 1: both producer ranks write this
    consumer's KV, and the registration's send to rank 1 failed. The writer
    sends it again; while rank 1 stays unreached the load can never complete
    (it needs one notif per writing rank). A lease after the first send, once
    rank 0 (which got it) has written, nothing more can be written: the load
    fails by policy, counted, logged with the rank, and no retry follows."""
    C, req = waiting_load(tp=1)
    a = req.request_id
    producer = Producer("agent-0", "agent-1")
    producer.alive.discard("agent-1")
    d = consumer(producer)
    d._push_lease_s = 0.0  # the lease has passed by the first check (no waiting in a test)

    register(d, a)
    assert [agent for agent, _ in producer.received] == ["agent-0"]
    d._push_reg_retries()[a]["next_try"] = 0.0
    d._retry_push_registrations()  # rank 1 is still down
    assert [agent for agent, _ in producer.received] == ["agent-0"]
    # Rank 0 may still write into the blocks: nothing is freed under it.
    assert not d.get_transfer_results().failed_recving

    d._pending_completion_notifs.put(f"{a}:2".encode())  # rank 0 wrote
    with capture_logger(caplog, "vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker"):
        d._get_new_notifs()  # the step counts the notif and gives the load up
    # From that moment no retry may reach rank 1, even before the failure
    # is reported and the load's metadata goes.
    producer.alive.add("agent-1")
    for entry in d._push_reg_retries().values():
        entry["next_try"] = 0.0
    d._retry_push_registrations()
    assert [agent for agent, _ in producer.received] == ["agent-0"]
    results = d.get_transfer_results()
    assert results.failed_recving == {a}
    assert d.xfer_stats.data["num_failed_transfers"] == [1]
    assert any("rank(s) [1] of producer engine producer" in r.getMessage() and a in r.getMessage()
               for r in caplog.records if r.levelname == "ERROR")
    C.step(finished_recving=results.finished_recving, failed_recving=results.failed_recving)
    assert req.status is RequestStatus.FINISHED_ERROR
    assert C.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == \
        C.scheduler.kv_cache_manager.block_pool.num_gpu_blocks - 1  # all but the null block

    d._retry_push_registrations()
    assert [agent for agent, _ in producer.received] == ["agent-0"]
    assert d._push_reg_retries() == {}


def test_a_load_a_rank_missed_waits_out_the_lease_while_retrying():
    """Before the lease has run out the missed rank may still be reached: the
    load waits, though the rank that got it has written."""
    producer = Producer("agent-0", "agent-1")
    producer.alive.discard("agent-1")
    d = consumer(producer)  # kv_lease_duration: vLLM's default, 30 s
    register(d, "A")
    d._pending_completion_notifs.put(b"A:2")

    d._get_new_notifs()

    assert d._failed_recv_reqs.empty() and "A" not in d._recving_transfers
    assert d._push_reg_retries()["A"]["missed"] == {(0, 1): "agent-1"}


def test_a_missed_rank_reached_on_retry_writes_and_the_load_completes():
    producer = Producer("agent-0", "agent-1")
    producer.alive.discard("agent-1")
    d = consumer(producer)
    register(d, "A")
    producer.alive.add("agent-1")  # the link is back
    d._push_reg_retries()["A"]["next_try"] = 0.0

    d._retry_push_registrations()

    assert [agent for agent, _ in producer.received] == ["agent-0", "agent-1"]
    assert producer.received[0][1] == producer.received[1][1]  # the same registration
    assert d._push_reg_retries() == {}
    d._push_lease_s = 0.0
    for _ in range(2):  # both ranks write
        d._pending_completion_notifs.put(b"A:2")
    d._get_new_notifs()
    assert "A" in d._recving_transfers and d._failed_recv_reqs.empty()
    # The rank reached on retry counts for the producer-restart check too.
    d._fail_recvs_of_replaced_producers()
    assert d._push_reg_agents["A"] == ("producer", frozenset({"agent-0", "agent-1"}))


def test_a_load_that_ends_stops_its_retries():
    producer = Producer("agent-0", "agent-1")
    producer.alive.discard("agent-1")
    d = consumer(producer)
    register(d, "A")
    del d._recving_metadata["A"]  # aborted, or failed for another reason
    producer.alive.add("agent-1")
    d._push_reg_retries()["A"]["next_try"] = 0.0

    d._retry_push_registrations()

    assert [agent for agent, _ in producer.received] == ["agent-0"]
    assert d._push_reg_retries() == {}


def test_an_idle_consumers_writer_retries_without_its_engine_waking_it(monkeypatch):
    """The writer parks until its engine wakes it: while a registration
    misses a rank it polls, so the retry does not wait for the next step."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import push_worker as push_module

    monkeypatch.setattr(push_module, "_PUSH_REG_RETRY_S", 0.0)
    producer = Producer("agent-0", "agent-1")
    producer.alive.discard("agent-1")
    d = consumer(producer)
    d.nixl_wrapper.get_new_notifs.return_value = {}
    register(d, "A")
    producer.alive.add("agent-1")
    d._push_writer_wake.clear()
    writer = threading.Thread(target=d._push_writer_loop, daemon=True)
    writer.start()
    try:
        deadline = time.monotonic() + 30  # a liveness bound, not a speed measure
        while len(producer.received) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        d._push_writer_stop.set()
        d._push_writer_wake.set()
        writer.join(30)
    assert [agent for agent, _ in producer.received] == ["agent-0", "agent-1"]


def test_a_load_failed_for_a_restart_is_not_failed_again_for_its_missed_rank():
    """Rank 1 missed the registration, rank 0 wrote, then both restarted: the
    restart fails the load; the missed rank adds no second failure."""
    producer = Producer("old-0", "old-1")
    producer.alive.discard("old-1")
    d = consumer(producer)
    d._push_lease_s = 0.0
    register(d, "A")
    d._fail_recvs_of_replaced_producers()  # the main thread records what it reached
    d._remote_agents["producer"] = {(0, 0): "new-0", (0, 1): "new-1"}
    d._pending_completion_notifs.put(b"A:2")  # rank 0's WRITE landed before it died

    d._fail_recvs_of_replaced_producers()
    d._get_new_notifs()

    assert d._failed_recv_reqs.get_nowait() == "A" and d._failed_recv_reqs.empty()
    assert d.xfer_stats.data["num_failed_transfers"] == [1]


# --- Consumer TP > 1: a consumer rank registers with the producer ranks that write it ---


def consumer_rank(producer: Producer, tp_rank: int, tp_size: int, producer_tp: int, producer_dcp: int = 1):
    """Consumer rank `tp_rank` of a TP `tp_size` engine. Its handshake, as
    vLLM's, reaches the producer ranks vLLM's TransferTopology names for it
    (the ranks that write it) and records the producer's TP."""
    from vllm.distributed.kv_transfer.kv_connector.utils import EngineTransferInfo, TransferTopology

    d = push_worker("consumer")
    d.world_size, d.tp_rank = tp_size, tp_rank
    d.transfer_topo = TransferTopology(tp_rank=tp_rank, tp_size=tp_size, block_size=16, engine_id="consumer",
                                       is_mla=False, is_mamba=False, total_num_kv_heads=8, attn_backends=[])
    d.nixl_wrapper.send_notif.side_effect = lambda agent, notif_msg: producer.send_notif(agent, notif_msg, tp_rank)

    def handshake(engine_id, host, port, tp_size, *args, **kwargs):
        targets = d.transfer_topo.handshake_target_ranks(producer_tp, producer_dcp)
        d.transfer_topo.register_remote_engine(engine_id, EngineTransferInfo(
            remote_tp_size=producer_tp, remote_block_len=1, remote_block_size=16,
            remote_physical_blocks_per_logical=1, remote_dcp_size=producer_dcp))
        with d._handshake_lock:
            d._remote_agents.setdefault(engine_id, {(0, r): producer.agents[r] for r in targets})

    d._ensure_handshake = handshake
    # What the base worker reads of a load it reports done (its KV landed
    # in place: no post-processing on this layout).
    d.enable_permute_local_kv = d.enable_heterogeneous_attn_post_process = False
    return d


def register_load(d, request_id: str) -> None:
    """register, with the metadata of a load that can complete."""
    d._recving_metadata[request_id] = SimpleNamespace(
        pp_size=1, local_block_ids=([7],), local_physical_block_ids=([7],), region_blocks_to_zero=None,
        remote=SimpleNamespace(engine_id="producer", block_ids=([3],)))
    register(d, request_id)


class Links(Producer):
    """A producer whose agents some consumer ranks cannot reach (one link
    down), while others can."""

    def __init__(self, *agents: str):
        super().__init__(*agents)
        self.down: set[tuple[int, str]] = set()  # (consumer rank, agent)

    def send_notif(self, agent: str, notif_msg: bytes, consumer_rank: int = 0) -> None:
        if (consumer_rank, agent) in self.down:
            raise RuntimeError("NIXL_ERR_REMOTE_DISCONNECT")
        super().send_notif(agent, notif_msg)


def consumer_pair(producer_tp: int, *, fail_closed: bool = True):
    """A TP 2 consumer engine: its real scheduler (pd_harness, two workers
    merged by vLLM's KVOutputAggregator), one load waiting for its KV, and
    its two ranks' push workers; a producer of `producer_tp` ranks."""
    C, req = waiting_load(tp=2, fail_closed=fail_closed)
    producer = Links(*(f"agent-{r}" for r in range(producer_tp)))
    ranks = [consumer_rank(producer, r, 2, producer_tp) for r in (0, 1)]
    for d in ranks:
        d._push_lease_s = 0.0  # the lease has passed by the first check (no waiting in a test)
    return C, req, producer, ranks


def consumer_step(C, ranks):
    """One consumer engine step: each rank's connector results, merged."""
    results = [d.get_transfer_results() for d in ranks]
    C.step(finished_on={i: r.finished_recving for i, r in enumerate(results)},
           failed_recving=set().union(*(r.failed_recving for r in results)))
    return results


def holds_blocks(C, req) -> bool:
    pool = C.scheduler.kv_cache_manager.block_pool
    return pool.get_num_free_blocks() < pool.num_gpu_blocks - 1  # all but the null block


def test_producer_tp4_consumer_tp2_a_missed_rank_fails_the_load_only_after_the_rank_that_got_it_wrote():
    """Producer TP 4 into consumer TP 2: consumer rank 0 registers with
    producer ranks 0 and 1 (they write it), rank 1 with 2 and 3. Rank 0's
    registration misses producer rank 0. A lease later, producer rank 1,
    which got it, has not written yet (its prefill outlasts the lease):
    consumer rank 0 must not give the load up, or, once consumer rank 1 has
    its KV, the scheduler frees the blocks and producer rank 1's WRITE lands
    in blocks another request may hold."""
    C, req, producer, (d0, d1) = consumer_pair(producer_tp=4)
    a = req.request_id
    producer.down.add((0, "agent-0"))
    register_load(d0, a)
    register_load(d1, a)
    assert sorted(agent for agent, _ in producer.received) == ["agent-1", "agent-2", "agent-3"]
    for _ in range(2):  # producer ranks 2 and 3 write consumer rank 1
        d1._pending_completion_notifs.put(f"{a}:4".encode())

    results = consumer_step(C, (d0, d1))
    assert results[1].finished_recving == {a} and not results[1].failed_recving
    assert not results[0].finished_recving  # producer rank 1 may still write here
    assert req.status is RequestStatus.WAITING_FOR_REMOTE_KVS and holds_blocks(C, req)

    # Producer rank 1's WRITE lands (its notif): the blocks are still the load's.
    d0._pending_completion_notifs.put(f"{a}:4".encode())
    results = consumer_step(C, (d0, d1))
    assert results[0].failed_recving == {a}
    assert req.status is RequestStatus.FINISHED_ERROR and not holds_blocks(C, req)
    assert d0.xfer_stats.data["num_failed_transfers"] == [1]


def test_producer_tp1_consumer_tp2_a_rank_its_registration_missed_may_still_write_it():
    """Producer TP 1 into consumer TP 2: producer rank 0 writes both consumer
    ranks, and both register with it. Consumer rank 0's registration reaches
    no agent, rank 1's does: the producer writes both when its prefill ends.
    Consumer rank 0 must keep its blocks for that WRITE: failing at once
    would free them as soon as rank 1's WRITE completes, with rank 0's still
    to land. It completes instead."""
    C, req, producer, (d0, d1) = consumer_pair(producer_tp=1, fail_closed=False)
    a = req.request_id
    producer.down.add((0, "agent-0"))
    register_load(d0, a)
    register_load(d1, a)
    assert [agent for agent, _ in producer.received] == ["agent-0"]  # from consumer rank 1

    d1._pending_completion_notifs.put(f"{a}:1".encode())  # rank 1's WRITE completes first
    results = consumer_step(C, (d0, d1))
    assert not results[0].finished_recving and not results[0].failed_recving
    assert req.status is RequestStatus.WAITING_FOR_REMOTE_KVS and holds_blocks(C, req)

    d0._pending_completion_notifs.put(f"{a}:1".encode())  # then rank 0's
    results = consumer_step(C, (d0, d1))
    assert results[0].finished_recving == {a} and not results[0].failed_recving
    assert req.status is not RequestStatus.FINISHED_ERROR
    assert not any(d0.xfer_stats.data["num_failed_transfers"])


def test_a_shared_producer_rank_that_restarted_fails_the_load_it_may_have_held():
    """Consumer rank 0 of TP 2 reached no agent of its TP 1 producer; another
    consumer rank may have. It keeps the agents, which may still write the
    load. Once heartbeats reach none and a new handshake shows new agents,
    the process that may hold it is gone: the load fails."""
    producer = Links("old-0")
    producer.down.add((0, "old-0"))
    d0 = consumer_rank(producer, 0, 2, producer_tp=1)
    register(d0, "A")
    assert not d0.get_transfer_results().failed_recving
    assert set(d0._remote_agents["producer"].values()) == {"old-0"}
    producer.restart("new-0")
    d0._on_unreachable_remote_engine("producer", frozenset({"old-0"}))  # a heartbeat reached none
    assert not d0.get_transfer_results().failed_recving
    register(d0, "B")
    assert [agent for agent, _ in producer.received] == ["new-0"]
    assert d0.get_transfer_results().failed_recving == {"A"}


def test_a_missed_rank_other_consumer_ranks_register_with_is_retried_not_given_up(caplog):
    """A pipeline-parallel consumer: each stage's worker registers with the
    same producer ranks, so a rank this worker missed may have another
    stage's registration. Producer rank 1 wrote; a lease after the first
    send the load keeps waiting for rank 0 (said once) and the writer keeps
    sending it; reached, rank 0 writes and the load completes."""
    producer = Links("agent-0", "agent-1")
    producer.down.add((0, "agent-0"))
    d0 = consumer_rank(producer, 0, 1, producer_tp=2)
    d0.pp_size = 2
    d0._push_lease_s = 0.0
    register_load(d0, "A")
    assert set(d0._remote_agents["producer"].values()) == {"agent-0", "agent-1"}
    d0._pending_completion_notifs.put(b"A:2")  # rank 1 wrote
    with capture_logger(caplog, "vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker"):
        for _ in range(2):
            assert not d0.get_transfer_results().failed_recving
    said = {id(r) for r in caplog.records if "Another consumer rank" in r.getMessage()}
    assert len(said) == 1  # once, however many steps it waits (a record may reach caplog twice)
    producer.down.clear()
    d0._push_reg_retries()["A"]["next_try"] = 0.0
    d0._retry_push_registrations()
    assert [agent for agent, _ in producer.received] == ["agent-1", "agent-0"]
    d0._pending_completion_notifs.put(b"A:2")
    d0.get_transfer_results()
    assert d0._failed_recv_reqs.empty() and not any(d0.xfer_stats.data["num_failed_transfers"])


@pytest.mark.parametrize("consumer_tp, producer_tp, producer_dcp, pp, alone", [
    (1, 1, 1, 1, True), (1, 2, 1, 1, True), (2, 2, 1, 1, True), (2, 4, 1, 1, True),
    (2, 1, 1, 1, False), (4, 2, 1, 1, False), (2, 2, 2, 1, False), (2, 2, 1, 2, False), (1, 1, 1, 2, False)])
def test_a_consumer_rank_registers_alone_only_where_no_other_rank_reaches_its_writers(
        consumer_tp, producer_tp, producer_dcp, pp, alone):
    """What _push_registers_alone says, checked against vLLM's own handshake
    targets: alone means no other consumer rank handshakes with (and so
    registers with) a producer rank this one does."""
    producer = Links(*(f"agent-{r}" for r in range(producer_tp)))
    ranks = [consumer_rank(producer, r, consumer_tp, producer_tp, producer_dcp) for r in range(consumer_tp)]
    for d in ranks:
        d.pp_size = pp
        d._ensure_handshake("producer", "127.0.0.1", 5601, producer_tp)
    targets = [set(d._remote_agents["producer"].values()) for d in ranks]
    shared = any(t & u for i, t in enumerate(targets) for u in targets[i + 1:]) or pp > 1
    assert [d._push_registers_alone("producer") for d in ranks] == [alone] * consumer_tp
    assert alone is not shared
    assert consumer_rank(producer, 0, 2, producer_tp)._push_registers_alone("producer") is False  # no handshake yet


def test_a_load_in_flight_when_its_producers_agents_are_dropped_fails_instead_of_raising():
    """Load A reached the producer; load B's registration then reached no
    agent (a network blip, not a restart): B fails and the agents are
    dropped, with the engine's transfer info. A's WRITE from the live
    producer still lands: its load fails by policy, counted, instead of its
    post-processing raising KeyError into the engine loop."""
    producer = Links("agent-0")
    d = consumer_rank(producer, 0, 1, producer_tp=1)
    register_load(d, "A")
    producer.down.add((0, "agent-0"))
    register_load(d, "B")
    assert d.get_transfer_results().failed_recving == {"B"}
    assert "producer" not in d._remote_agents

    d._pending_completion_notifs.put(b"A:1")
    assert d.get_transfer_results().failed_recving == {"A"}
    assert d.xfer_stats.data["num_failed_transfers"] == [1]
