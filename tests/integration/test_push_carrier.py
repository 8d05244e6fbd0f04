"""NIXL push carries KV checksums on the WRITE's completion notif, hop by hop.

- P scheduler: the real NixlPushConnector scheduler (pd_harness side) ships
  a finished request's checksums with its blocks, and keeps nothing for a
  request with nothing to push.
- P worker: start_load_kv puts them in the writer's queue item with the
  blocks; the writer keeps them until eviction and builds the notif.
- The notif crosses two real NIXL agents (UCX, CPU memory, loopback) on a
  real WRITE; the consumer worker's code parses it, completes the load and
  reports the checksums with it.

The push workers are built without __init__ (as vLLM's own push tests do):
a full worker needs a running engine's handshake. Only the NIXL base
class's get_transfer_results bookkeeping (polling handles, post-processing
KV) is replaced, by `_base_results`; every push-worker method under test
is the real one.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections import defaultdict
from unittest.mock import MagicMock, patch

import msgspec
import pytest
import torch
from pd_harness import make_side, prefill, prompt_of, stats
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import push_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (KV_CHECKSUM_NOTIF_PREFIX,
                                                                        NIXL_CONNECTOR_VERSION,
                                                                        NixlConnectorMetadata)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats
from vllm.v1.request import RequestStatus

from vllm_kvchecksum.payload import KVChecksumPayload

PUSH = "NixlPushConnector"


def stub_worker(world_size: int = 1) -> NixlPushConnectorWorker:
    """A push worker with the state its notif, queue and results paths use."""
    w = object.__new__(NixlPushConnectorWorker)
    w._push_finished_blocks, w._push_kv_checksums, w._received_kv_checksums = {}, {}, {}
    w._pending_d_registrations = {}
    for name in ("_reg_send_inbox", "_finished_blocks_inbox", "_pending_completion_notifs",
                 "_evict_finished_inbox", "_deferred_push_inbox", "_failed_recv_reqs"):
        setattr(w, name, queue.Queue())
    w._push_writer_wake, w._push_writer_stop = threading.Event(), threading.Event()
    w._sending_transfers, w._send_failures = defaultdict(list), set()
    w._sending_transfers_lock = threading.Lock()
    w._recving_metadata, w._recving_transfers = {}, defaultdict(list)
    w._reqs_to_process, w._reqs_to_send = set(), {}
    w.consumer_notification_counts_by_req = defaultdict(int)
    w.xfer_stats = NixlKVConnectorStats()
    w.transfer_topo = MagicMock()
    w.pcp_rank, w.pcp_dcp_sharded, w.world_size = 0, False, world_size
    w._remote_agents, w._engine_last_active = {}, {}
    w._physical_blocks_per_logical_kv_block = 1
    w._send_heartbeats = lambda metadata: None
    return w


def _base_results(self) -> KVConnectorTransferResults:
    """Stands in for NixlBaseConnectorWorker.get_transfer_results: the notifs
    (the push worker's own _get_new_notifs), then the loads they completed."""
    done_sending = self._get_new_notifs()
    done_recving = set(self._recving_transfers)
    self._recving_transfers.clear()
    for req_id in done_recving:
        self._recving_metadata.pop(req_id)
    return KVConnectorTransferResults(finished_sending=done_sending, finished_recving=done_recving)


def transfer_results(w: NixlPushConnectorWorker) -> KVConnectorTransferResults:
    with patch.object(NixlPushConnectorWorker.__mro__[1], "get_transfer_results", _base_results):
        return w.get_transfer_results()


def payload_bytes(seed: int = 1) -> bytes:
    import numpy as np

    from vllm_kvchecksum.payload import PayloadGroup

    values = np.arange(5, dtype=np.uint64) * 1_000_003 + seed
    return KVChecksumPayload(num_tokens=77, producer_tp_size=1,
                             groups={0: PayloadGroup(fingerprint=3, block_size=16, start=0, values=values)}
                             ).to_bytes()


# -- P scheduler ---------------------------------------------------------------

def test_producer_scheduler_ships_checksums_with_the_finished_blocks():
    P = make_side("kv_producer", connector=PUSH, fail_closed=True)
    req = None
    from pd_harness import forward_of, make_request

    req = make_request(prompt_of(77), remote_decode=True)
    P.scheduler.add_request(req)
    forward = forward_of(P, req)
    for _ in range(4):
        _, outputs = P.step(forward=forward)
        if req.is_finished():
            break
    assert "kv_checksums" not in outputs[req.request_id].kv_transfer_params
    out, _ = P.step()
    meta = out.kv_connector_metadata
    assert isinstance(meta, NixlConnectorMetadata)
    assert set(meta.push_finished_blocks) == set(meta.push_finished_kv_checksums) == {req.request_id}
    payload = KVChecksumPayload.from_bytes(meta.push_finished_kv_checksums[req.request_id])
    assert payload.num_tokens == 77 and set(payload.groups) == {0}
    assert stats(P) == {"sent": 1}
    # Shipped once.
    out, _ = P.step()
    assert not out.kv_connector_metadata.push_finished_kv_checksums


def test_aborted_producer_request_keeps_and_ships_nothing():
    from pd_harness import forward_of, make_request

    P = make_side("kv_producer", connector=PUSH, fail_closed=True)
    req = make_request(prompt_of(77), remote_decode=True)
    req.max_tokens = 4  # still running after its prompt's step
    P.scheduler.add_request(req)
    forward = forward_of(P, req)
    P.step(forward=forward)
    P.scheduler.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    out, _ = P.step()
    assert not out.kv_connector_metadata.push_finished_kv_checksums
    connector_scheduler = P.scheduler.connector.connector_scheduler
    assert connector_scheduler._newly_finished_kv_checksums == {}
    assert "sent" not in stats(P)


def test_send_kv_checksums_refuses_a_request_with_nothing_to_push():
    P = make_side("kv_producer", connector=PUSH)
    from pd_harness import make_request

    req = make_request(prompt_of(16), remote_decode=True)
    assert P.scheduler.connector.send_kv_checksums(req, b"x") is False
    assert P.scheduler.connector.connector_scheduler._newly_finished_kv_checksums == {}


# -- P worker --------------------------------------------------------------------

def test_start_load_kv_queues_checksums_with_the_blocks():
    w = stub_worker()
    meta = NixlConnectorMetadata()
    meta.push_finished_blocks = {"with": ([1, 2],), "without": ([3],)}
    meta.push_finished_kv_checksums = {"with": b"CS"}
    w.start_load_kv(meta)
    items = [w._finished_blocks_inbox.get_nowait() for _ in range(2)]
    assert sorted(items, key=lambda i: i[0]) == [("with", ([1, 2],), b"CS"), ("without", ([3],), None)]


def run_writer_once(w: NixlPushConnectorWorker) -> None:
    """One pass of the real writer loop (it stops after the pass)."""
    w.nixl_wrapper = MagicMock()
    w.nixl_wrapper.get_new_notifs.return_value = {}
    w._push_writer_stop.set()
    w._push_writer_stop.is_set = MagicMock(side_effect=[False, True])
    w._push_writer_loop()


def test_writer_keeps_checksums_until_eviction_and_builds_the_notif():
    w = stub_worker(world_size=2)
    w._finished_blocks_inbox.put(("p-req", ([1],), b"CS"))
    w._finished_blocks_inbox.put(("p-plain", ([2],), None))
    run_writer_once(w)
    assert w._push_kv_checksums == {"p-req": b"CS"}
    notif = w._completion_notif("p-req", "d-req")
    assert notif.startswith(KV_CHECKSUM_NOTIF_PREFIX)
    assert msgspec.msgpack.decode(notif[len(KV_CHECKSUM_NOTIF_PREFIX):]) == ["d-req", 2, b"CS"]
    # Without checksums: the plain form, byte for byte as before.
    assert w._completion_notif("p-plain", "d-plain") == b"d-plain:2"
    w._evict_finished_inbox.put("p-req")
    run_writer_once(w)
    assert w._push_kv_checksums == {}


def test_connector_version_changed_for_the_new_notif_form():
    assert NIXL_CONNECTOR_VERSION == 15


# -- the notif over real NIXL agents, parsed by the consumer ---------------------

@pytest.fixture(scope="module")
def agents():
    """A producer and a consumer NIXL agent (UCX) with 4 KiB of CPU memory each."""
    from nixl._api import nixl_agent, nixl_agent_config

    config = nixl_agent_config(backends=["UCX"])
    p = nixl_agent(f"P-{uuid.uuid4().hex[:8]}", config)
    d = nixl_agent(f"D-{uuid.uuid4().hex[:8]}", config)
    src = torch.arange(1024, dtype=torch.int32)
    dst = torch.zeros(1024, dtype=torch.int32)
    p.register_memory(p.get_reg_descs(src))
    d.register_memory(d.get_reg_descs(dst))
    p.add_remote_agent(d.get_agent_metadata())
    d.add_remote_agent(p.get_agent_metadata())
    yield p, d, src, dst
    p.remove_remote_agent(d.name)
    d.remove_remote_agent(p.name)


def write_with_notif(agents, notif: bytes) -> list[bytes]:
    """WRITE the producer's buffer into the consumer's, with `notif`; the
    notifs the consumer agent then receives."""
    p, d, src, dst = agents
    dst.zero_()
    handle = p.initialize_xfer("WRITE", p.get_xfer_descs(src), p.get_xfer_descs(dst), d.name, notif)
    assert p.transfer(handle) in ("DONE", "PROC")
    received: list[bytes] = []
    deadline = time.monotonic() + 30
    while not received and time.monotonic() < deadline:
        assert p.check_xfer_state(handle) != "ERR"
        for notifs in d.get_new_notifs().values():
            received.extend(notifs)
    p.release_xfer_handle(handle)
    assert torch.equal(dst, src), "the WRITE's data arrived with its notif"
    return received


def consumer_loading(req_id: str, pp_size: int = 1) -> NixlPushConnectorWorker:
    d = stub_worker(world_size=1)
    d._recving_metadata[req_id] = MagicMock(pp_size=pp_size)
    return d


@pytest.mark.parametrize("with_checksums", [True, False], ids=["checksums", "plain"])
def test_real_write_notif_completes_the_load_and_reports_checksums(agents, with_checksums):
    producer = stub_worker(world_size=1)
    checksums = payload_bytes()
    if with_checksums:
        producer._push_kv_checksums["p-1"] = checksums
    notif = producer._completion_notif("p-1", "d-1")
    assert notif.startswith(KV_CHECKSUM_NOTIF_PREFIX) == with_checksums
    received = write_with_notif(agents, notif)
    assert received == [notif]
    consumer = consumer_loading("d-1")
    consumer._pending_completion_notifs.put(received[0])
    results = transfer_results(consumer)
    assert results.finished_recving == {"d-1"}
    assert results.kv_checksums == ({"d-1": checksums} if with_checksums else {})
    assert consumer._received_kv_checksums == {}


def test_two_producer_ranks_complete_once_and_the_first_copy_is_kept(agents):
    """Producer TP 2 -> consumer TP 1: one notif per writing rank; the load
    finishes on the second, with the first copy of the checksums."""
    first, second = stub_worker(world_size=2), stub_worker(world_size=2)
    first._push_kv_checksums["p"] = payload_bytes(1)
    second._push_kv_checksums["p"] = payload_bytes(2)
    consumer = consumer_loading("d")
    consumer._pending_completion_notifs.put(write_with_notif(agents, first._completion_notif("p", "d"))[0])
    results = transfer_results(consumer)
    assert results.finished_recving == set() and results.kv_checksums == {}
    consumer._pending_completion_notifs.put(write_with_notif(agents, second._completion_notif("p", "d"))[0])
    results = transfer_results(consumer)
    assert results.finished_recving == {"d"}
    assert results.kv_checksums == {"d": payload_bytes(1)}


@pytest.mark.parametrize("notif", [
    KV_CHECKSUM_NOTIF_PREFIX + b"\xc1",
    KV_CHECKSUM_NOTIF_PREFIX + msgspec.msgpack.encode(("d", "2", b"x")),
    KV_CHECKSUM_NOTIF_PREFIX + msgspec.msgpack.encode(("d", 1)),
    KV_CHECKSUM_NOTIF_PREFIX + msgspec.msgpack.encode(("d", 0, b"x")),
    KV_CHECKSUM_NOTIF_PREFIX + msgspec.msgpack.encode(("d", 1, b"x" * (push_worker._MAX_KV_CHECKSUM_NOTIF_BYTES))),
], ids=["bad-msgpack", "tp-not-int", "short", "tp-zero", "too-long"])
def test_undecodable_checksum_notif_is_logged_and_counted(notif, caplog):
    consumer = consumer_loading("d")
    consumer._pending_completion_notifs.put(notif)
    with caplog.at_level(logging.ERROR):
        results = transfer_results(consumer)
    assert results.finished_recving == set() and results.kv_checksums == {}
    assert consumer.xfer_stats.data["num_failed_notifications"] == [1]
    assert "does not decode" in caplog.text
    # The load still completes with a good notif afterwards.
    consumer._pending_completion_notifs.put(b"d:1")
    assert transfer_results(consumer).finished_recving == {"d"}


def test_checksums_of_a_load_not_in_flight_are_not_kept():
    producer = stub_worker()
    producer._push_kv_checksums["p"] = payload_bytes()
    consumer = stub_worker()
    consumer._pending_completion_notifs.put(producer._completion_notif("p", "unknown"))
    results = transfer_results(consumer)
    assert results.kv_checksums == {} and consumer._received_kv_checksums == {}


def test_received_checksums_of_a_dropped_load_are_released():
    consumer = consumer_loading("d", pp_size=2)  # waits for 2 notifs
    producer = stub_worker()
    producer._push_kv_checksums["p"] = payload_bytes()
    consumer._pending_completion_notifs.put(producer._completion_notif("p", "d"))
    transfer_results(consumer)
    assert set(consumer._received_kv_checksums) == {"d"}
    del consumer._recving_metadata["d"]  # e.g. the load expired
    transfer_results(consumer)
    assert consumer._received_kv_checksums == {}
