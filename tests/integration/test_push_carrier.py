"""NIXL push carries KV checksums on the WRITE's completion notif, hop by hop.

- P scheduler: the real NixlPushConnector scheduler (pd_harness side) ships
  a finished request's checksums with its blocks, and keeps nothing for a
  request with nothing to push.
- P worker: start_load_kv puts them in the writer's queue item with the
  blocks; the writer keeps them until eviction and builds the notif.
- The notif crosses two real NIXL agents (UCX, CPU memory, loopback) on a
  real WRITE (in a child process, nixl_write.py: agents crash an
  interpreter at exit); the consumer worker's code parses the notif the
  agent received, completes the load and reports the checksums with it.
- The generic connector-owned carrier this patch adds: MultiConnector's
  forwarding, both model runners passing delivered checksums to the
  checksum worker, and the consumer scheduler taking the first copy and
  decoding it like any untrusted payload.

The push workers are built without __init__ (as vLLM's own push tests do):
a full worker needs a running engine's handshake. Only the NIXL base
class's get_transfer_results bookkeeping (polling handles, post-processing
KV) is replaced, by `_base_results`; every push-worker method under test
is the real one.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import queue
import re
import subprocess
import sys
import threading
from collections import defaultdict
from pathlib import Path
from unittest.mock import MagicMock, patch

import msgpack
import msgspec
import numpy as np
import pytest
import pd_harness
from pd_harness import (CONNECTORS, carrier_request, forward_of, load, make_request, make_side, prefill, prompt_of,
                        runner_step, scheduler_connector, stats)
from test_verified_loads import PROMPT, nested
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorTransferResults
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import push_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (KV_CHECKSUM_NOTIF_PREFIX,
                                                                        NIXL_CONNECTOR_VERSION,
                                                                        NixlConnectorMetadata)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from vllm_kvchecksum.core.payload import KVChecksumPayload, PayloadGroup
from vllm_kvchecksum.engine.carrier import KVChecksumCarrier
from vllm_kvchecksum.engine.runner import checksum_step
from vllm_kvchecksum.engine.scheduler import _carrier_name

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
    values = np.arange(5, dtype=np.uint64) * 1_000_003 + seed
    return KVChecksumPayload(num_tokens=77, producer_tp_size=1,
                             groups={0: PayloadGroup(fingerprint=3, block_size=16, start=0, values=values)}
                             ).to_bytes()


# -- P scheduler ---------------------------------------------------------------

def test_producer_scheduler_ships_checksums_with_the_finished_blocks():
    P = make_side("kv_producer", connector=PUSH, fail_closed=True)
    req = None
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
    # The series' own entry is the newest of metadata.py's version history
    # (15 on vLLM 0.32, 17 on 0.34), so mixed versions fail the handshake.
    import inspect

    import vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata as metadata

    history = re.findall(r"^#\s+(\d+): (.*)$", inspect.getsource(metadata), re.M)
    newest, what = max(history, key=lambda h: int(h[0]))
    assert int(newest) == NIXL_CONNECTOR_VERSION
    assert "KV checksums" in what


# -- the notif over real NIXL agents, parsed by the consumer ---------------------

def write_with_notif(notif: bytes) -> list[bytes]:
    """A real WRITE between two real NIXL agents carrying `notif`; the notifs
    the consumer agent received. The agents live in a child process
    (nixl_write.py: they crash an interpreter at exit)."""
    script = Path(__file__).with_name("nixl_write.py")
    done = subprocess.run([sys.executable, str(script), notif.hex()], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["data_equal"], "the WRITE's data arrived with its notif"
    return [bytes.fromhex(n) for n in result["notifs"]]


def consumer_loading(req_id: str, pp_size: int = 1) -> NixlPushConnectorWorker:
    d = stub_worker(world_size=1)
    d._recving_metadata[req_id] = MagicMock(pp_size=pp_size)
    return d


@pytest.mark.parametrize("with_checksums", [True, False], ids=["checksums", "plain"])
def test_real_write_notif_completes_the_load_and_reports_checksums(with_checksums):
    producer = stub_worker(world_size=1)
    checksums = payload_bytes()
    if with_checksums:
        producer._push_kv_checksums["p-1"] = checksums
    notif = producer._completion_notif("p-1", "d-1")
    assert notif.startswith(KV_CHECKSUM_NOTIF_PREFIX) == with_checksums
    received = write_with_notif(notif)
    assert received == [notif]
    consumer = consumer_loading("d-1")
    consumer._pending_completion_notifs.put(received[0])
    results = transfer_results(consumer)
    assert results.finished_recving == {"d-1"}
    assert results.kv_checksums == ({"d-1": checksums} if with_checksums else {})
    assert consumer._received_kv_checksums == {}


def test_two_producer_ranks_complete_once_and_the_first_copy_is_kept():
    """Producer TP 2 -> consumer TP 1: one notif per writing rank; the load
    finishes on the second, with the first copy of the checksums."""
    first, second = stub_worker(world_size=2), stub_worker(world_size=2)
    first._push_kv_checksums["p"] = payload_bytes(1)
    second._push_kv_checksums["p"] = payload_bytes(2)
    consumer = consumer_loading("d")
    consumer._pending_completion_notifs.put(write_with_notif(first._completion_notif("p", "d"))[0])
    results = transfer_results(consumer)
    assert results.finished_recving == set() and results.kv_checksums == {}
    consumer._pending_completion_notifs.put(write_with_notif(second._completion_notif("p", "d"))[0])
    results = transfer_results(consumer)
    assert results.finished_recving == {"d"}
    assert results.kv_checksums == {"d": payload_bytes(1)}


@pytest.mark.parametrize("notif", [
    KV_CHECKSUM_NOTIF_PREFIX + b"\xc1",
    KV_CHECKSUM_NOTIF_PREFIX + msgspec.msgpack.encode(("d", "2", b"x")),
    KV_CHECKSUM_NOTIF_PREFIX + msgspec.msgpack.encode(("d", 0, b"x")),
], ids=["bad-msgpack", "tp-not-int", "tp-zero"])
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


@pytest.mark.parametrize("notif", [
    KV_CHECKSUM_NOTIF_PREFIX + msgspec.msgpack.encode(("d", 1)),
    KV_CHECKSUM_NOTIF_PREFIX + msgspec.msgpack.encode(("d", 1, b"x" * (push_worker._MAX_KV_CHECKSUM_NOTIF_BYTES))),
    KV_CHECKSUM_NOTIF_PREFIX + msgspec.msgpack.encode(("d", 1, payload_bytes()))[:-3],
    KV_CHECKSUM_NOTIF_PREFIX + msgspec.msgpack.encode(("d", 1, 12345)),
], ids=["no-checksums", "too-long", "truncated", "checksums-not-bytes"])
def test_notif_whose_checksums_do_not_decode_still_completes_its_load(notif, caplog):
    """The request id and TP size are read without the checksums: the load
    completes (it would otherwise wait forever, holding its blocks) with
    empty checksums, which the scheduler finds invalid (unverified)."""
    if os.environ.get("KVCS_VLLM_TREE") and not hasattr(push_worker, "_kv_checksum_notif_head"):
        pytest.skip("make check-series: a later patch of the series reads an unreadable notif's id")
    consumer = consumer_loading("d")
    consumer._pending_completion_notifs.put(notif)
    with caplog.at_level(logging.ERROR):
        results = transfer_results(consumer)
    assert results.finished_recving == {"d"}
    assert results.kv_checksums == {"d": b""}
    assert "do not decode" in caplog.text and "request d" in caplog.text


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


# -- the generic carrier ---------------------------------------------------------

connector, request = scheduler_connector, carrier_request


def test_nixl_push_carries_them_in_its_own_messages():
    c = connector("NixlPushConnector")
    assert c.can_carry_kv_checksums()
    assert c.kv_checksum_carrier(request(do_remote_decode=True), receiving=False) is KVChecksumCarrier.CONNECTOR
    assert c.kv_checksum_carrier(request(do_remote_prefill=True), receiving=True) is KVChecksumCarrier.CONNECTOR
    assert c.kv_checksum_carrier(request(), receiving=False) is None


def test_default_connector_sends_no_checksums():
    assert KVConnectorBase_V1.send_kv_checksums(None, request(), b"x") is False


class _Child:
    """A sub-connector that records what MultiConnector forwards to it."""

    def __init__(self, carrier, sends=True, results=None):
        self.carrier, self.sends, self.results, self.sent = carrier, sends, results, []

    def kv_checksum_carrier(self, request, receiving):
        return self.carrier

    def send_kv_checksums(self, request, checksums):
        self.sent.append((request.request_id, checksums))
        return self.sends

    def get_transfer_results(self, finished_req_ids):
        return self.results or KVConnectorTransferResults()


def test_multi_connector_sends_through_the_carrying_child(multi):
    children = [_Child(None), _Child(KVChecksumCarrier.CONNECTOR), _Child(KVChecksumCarrier.CONNECTOR)]
    multi._connectors = children
    assert multi.send_kv_checksums(request(do_remote_decode=True), b"CS") is True
    assert [c.sent for c in children] == [[], [("r", b"CS")], []]
    children[1].sends = False
    assert multi.send_kv_checksums(request(do_remote_decode=True), b"CS") is False
    multi._connectors = [_Child(None)]
    assert multi.send_kv_checksums(request(do_remote_decode=True), b"CS") is False


def test_multi_connector_merges_childrens_checksums(multi):
    multi._connectors = [
        _Child(None, results=KVConnectorTransferResults(finished_recving={"a"}, kv_checksums={"a": b"1"})),
        _Child(None, results=KVConnectorTransferResults(finished_recving={"b"},
                                                        kv_checksums={"b": b"2", "a": b"other"})),
    ]
    results = multi.get_transfer_results(set())
    assert results.finished_recving == {"a", "b"}
    assert results.kv_checksums == {"a": b"1", "b": b"2"}


def test_startup_line_names_the_push_carrier():
    assert _carrier_name(connector("NixlPushConnector")) == "connector"


@pytest.mark.parametrize("runner", pd_harness.MODEL_RUNNERS)
def test_connector_delivered_checksums_pass_through_each_model_runner(runner, logs):
    """NIXL push: the workers' connector reports the producer's checksums
    with the finished load; each runner hands them to the checksum worker."""
    P = make_side("kv_producer", tp=2, connector=CONNECTORS["push"])
    C = make_side("kv_consumer", tp=2, fail_closed=True, policy="recompute", connector=CONNECTORS["push"])
    for delivered, verdict in ((True, "verified"), (False, "unverified")):
        preq, params = prefill(P, prompt_of(PROMPT, seed=int(delivered)))
        carried = params.pop("kv_checksums")
        req = make_request(preq.prompt_token_ids, params=dict(params))
        C.scheduler.add_request(req)
        runner_step(C, runner)
        C.write_tokens(req.request_id, 0, req.num_computed_tokens, source=P, source_id=preq.request_id)
        runner_step(C, runner, finished_recving={req.request_id},
                    received={req.request_id: carried} if delivered else None)
        assert stats(C).get(verdict) == 1, logs.text


@pytest.mark.parametrize("bad", [
    b"", b"\xc1", nested(5000), msgpack.packb([2, [1, 1, []]]), b"\x92" + b"\x01" * 64,
], ids=["empty", "bad-msgpack", "deep", "version-2", "junk"])
def test_malformed_connector_checksums_never_raise(bad, logs):
    """Bytes a connector-owned carrier delivers come from another host."""
    P = make_side("kv_producer", connector=CONNECTORS["push"])
    C = make_side("kv_consumer", connector=CONNECTORS["push"], fail_closed=True, policy="recompute")
    preq, params = prefill(P, prompt_of(PROMPT))
    params["kv_checksums"] = bad
    result = load(C, P, preq, params)
    assert stats(C) == {"unverified": 1}
    assert "connector message" in logs.text
    assert result.next_scheduled == PROMPT


def changed_value(payload: bytes) -> bytes:
    """The payload with block position 2 of group 0 changed."""
    decoded = KVChecksumPayload.from_bytes(payload)
    group = decoded.groups[0]
    values = group.values.copy()
    values[2] ^= 1
    groups = {**decoded.groups, 0: PayloadGroup(group.fingerprint, group.block_size, group.start, values)}
    return KVChecksumPayload(decoded.num_tokens, decoded.producer_tp_size, groups).to_bytes()


def push_load_awaiting_checksums(C, P):
    """A push load whose blocks the consumer has scheduled and whose KV the
    producer wrote, not yet reported finished: (request, the producer's
    checksums as a connector-owned carrier delivers them)."""
    preq, params = prefill(P, prompt_of(PROMPT))
    payload = params.pop("kv_checksums")
    req = make_request(preq.prompt_token_ids, params=dict(params), block_size=C.block_size)
    C.scheduler.add_request(req)
    C.step()
    C.write_tokens(req.request_id, 0, req.num_computed_tokens, source=P, source_id=preq.request_id)
    return req, payload


@pytest.mark.parametrize("copies, verdict", [(("wrong", "good"), "mismatch"), (("good", "wrong"), "verified"),
                                              ((None, "good"), "unverified")])
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_only_the_first_workers_copy_of_connector_checksums_counts(logs, copies, verdict, tp, pp):
    """Each worker's connector delivers the load's checksums; only the first
    worker's copy travels to the scheduler (one copy per load), whatever the
    others received. A producer that sends them to other workers only gets
    an unverified load, never a verified one."""
    P = make_side("kv_producer", connector=CONNECTORS["push"], tp=2)
    C = make_side("kv_consumer", connector=CONNECTORS["push"], tp=tp, pp=pp)
    assert [(w.checksums.pp_rank, w.checksums.tp_rank) for w in C.workers][0] == (0, 0)
    req, good = push_load_awaiting_checksums(C, P)
    payloads = {"good": good, "wrong": changed_value(good)}
    out = C.scheduler.schedule()
    outputs, carried = [], []
    for w, copy in zip(C.workers, copies):
        received = {req.request_id: payloads[copy]} if copy else None
        checksums = checksum_step(w.checksums, out.kv_checksum_scheduled, {req.request_id}, received=received)
        carried.append(sum(len(r.received) for r in checksums.records))
        outputs.append(C.runner_output(out, KVConnectorOutput(finished_recving={req.request_id},
                                                              kv_checksums=checksums)))
    assert carried == [1 if copies[0] else 0, 0]
    C.update(out, C.aggregator.aggregate(outputs, 0))
    assert stats(C) == {verdict: 1}, logs.text


@pytest.mark.parametrize("params_carry, verdict", [("checksums", "verified"), ("none", "unverified")])
def test_received_checksums_of_a_params_carried_load_are_ignored(logs, params_carry, verdict):
    """A pull load compares with its kv_transfer_params; bytes a worker
    reports for it (a misbehaving connector) change nothing, also when the
    params carried no checksums (the load stays unverified, never verified
    by bytes it was not meant to take)."""
    P = make_side("kv_producer")
    C = make_side("kv_consumer", fail_closed=True)
    preq, params = prefill(P, prompt_of(PROMPT))
    good = base64.b64decode(params["kv_checksums"])
    received = changed_value(good)
    if params_carry == "none":
        del params["kv_checksums"]
        received = good
    req = make_request(preq.prompt_token_ids, params=dict(params), block_size=C.block_size)
    C.scheduler.add_request(req)
    C.step()
    C.write_tokens(req.request_id, 0, req.num_computed_tokens, source=P, source_id=preq.request_id)
    C.step(finished_recving={req.request_id}, received={req.request_id: received})
    assert stats(C) == {verdict: 1}, logs.text


def test_a_first_copy_that_does_not_decode_is_not_replaced_by_a_later_one(logs):
    """The first copy decides even when it is invalid: a later copy that
    decodes (from a rank that should not carry it) does not verify the load."""
    P = make_side("kv_producer", connector=CONNECTORS["push"])
    C = make_side("kv_consumer", connector=CONNECTORS["push"], fail_closed=True, policy="recompute")
    req, good = push_load_awaiting_checksums(C, P)
    C.step(received={req.request_id: good[:-3]})
    C.step(finished_recving={req.request_id}, received={req.request_id: good})
    assert stats(C) == {"unverified": 1}, logs.text
    assert "invalid" in logs.text


@pytest.mark.parametrize("first, later, verdict", [("good", "wrong", "verified"), ("wrong", "good", "mismatch")])
def test_a_copy_delivered_in_a_later_step_does_not_replace_the_first(logs, first, later, verdict):
    """The carrier's copy can arrive a step before the load is reported
    finished (one rank's notif came, another's not yet); a copy delivered
    later (a repeated notif) changes nothing: the first one decides."""
    P = make_side("kv_producer", connector=CONNECTORS["push"])
    C = make_side("kv_consumer", connector=CONNECTORS["push"], fail_closed=True, policy="recompute")
    req, good = push_load_awaiting_checksums(C, P)
    payloads = {"good": good, "wrong": changed_value(good)}
    C.step(received={req.request_id: payloads[first]})
    assert stats(C) == {}, logs.text
    C.step(finished_recving={req.request_id}, received={req.request_id: payloads[later]})
    assert stats(C) == {verdict: 1}, logs.text
