"""A consumer's read of KV the producer had already released is counted, once, as the producer's fault.

NIXL pull keeps a finished request's blocks for a lease; when the lease
expires before the consumer's read is done, the producer frees the blocks
and gives them to other requests, and the consumer's read notification
arrives for a request the producer no longer knows. vLLM logs "Potentially
invalid KV blocks for unrecognized request" for it, and for the repeated
notification of a load that failed its check too, so that line counts no
victims. The patched pull worker remembers the requests it released on
expiry (bounded) and reports a late read of one of them in its transfer
results; the model runners hand it to the checksum worker, and the
producer's scheduler counts it in vllm:kv_checksum_producer_read_after_release_total,
logs an error naming the request and writes an incident line the join
(python -m vllm_kvchecksum.engine.where) reads as "released before the read".

The pull workers are built without __init__ (as vLLM's own NIXL tests do for
the parts they test: a full worker needs a running engine's handshake); the
methods under test are the real ones, with a stand-in for the NIXL agent's
notification queue. The scheduler side is the real vLLM Scheduler with
NixlConnector and the real checksum workers (pd_harness).
"""

from __future__ import annotations

import functools
import logging
import queue
import time
from collections import defaultdict
from unittest.mock import MagicMock

import pytest
from log_capture import capture_logger
import pd_harness
from pd_harness import make_side, runner_step, stats

from vllm_kvchecksum.engine import incident, metrics, scheduler as kvcs_scheduler

pytestmark = pytest.mark.skipif(
    not hasattr(__import__("vllm.distributed.kv_transfer.kv_connector.v1.base", fromlist=["x"]
                           ).KVConnectorTransferResults(), "kv_read_after_release"),
    reason="the series' prefixes before the read-after-release patch")

NIXL_LOGGER = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker"


class Notifs:
    """The NIXL agent's notification queue: what the consumers sent since the last poll."""

    def __init__(self):
        self.pending: list[bytes] = []

    def get_new_notifs(self):
        out, self.pending = self.pending, []
        return {"consumer-agent": out}


def pull_worker():
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

    w = object.__new__(NixlPullConnectorWorker)
    w.nixl_wrapper = Notifs()
    w.transfer_topo = MagicMock()
    w.xfer_stats = NixlKVConnectorStats()
    w._reqs_to_send, w._reqs_to_process = {}, set()
    w.consumer_notification_counts_by_req = defaultdict(int)
    w.expected_consumer_notifications_by_req = {}
    w._lease_extension = 30
    # What get_transfer_results reads besides the leases and notifications.
    w._recving_transfers, w._recving_metadata, w._recv_failures = defaultdict(list), {}, set()
    w._replicated_pcp_done_sending, w._failed_recv_reqs = set(), queue.Queue()
    w._pending_recv_notifs = {}
    w.use_host_buffer, w._has_mamba, w.tp_rank = False, False, 0
    w.enable_heterogeneous_attn_post_process = False
    w._TRANSFER_MODE = "offline"  # _cleanup_remote_engines: nothing to clean
    return w


def send(w, req_id: str, *, expires_in: float) -> None:
    """The producer holds `req_id`'s blocks for a transfer, for `expires_in` seconds."""
    w._reqs_to_send[req_id] = time.perf_counter() + expires_in
    w._reqs_to_process.add(req_id)


def expire(w) -> set[str]:
    done: set[str] = set()
    w._reap_expired_send_leases(done)
    return done


def read_done(w, req_id: str, consumers: int = 1) -> None:
    """A consumer worker's notification that it finished reading `req_id`."""
    w.nixl_wrapper.pending.append(f"{req_id}:{consumers}".encode())


def test_a_read_after_the_lease_expired_is_reported_with_the_transfer_results(caplog):
    w = pull_worker()
    send(w, "late", expires_in=-1)
    send(w, "in-time", expires_in=60)
    assert expire(w) == {"late"}
    read_done(w, "in-time")
    read_done(w, "late")
    with capture_logger(caplog, NIXL_LOGGER):
        results = w.get_transfer_results()
    assert results.finished_sending == {"in-time"}
    assert results.kv_read_after_release == {"late"}
    lines = sorted({r.getMessage() for r in caplog.records if r.levelno == logging.ERROR})
    assert len(lines) == 1 and "request late were read by a decode worker after their lease expired" in lines[0]
    assert "kv_lease_duration" in lines[0]
    # Reported once: the next results carry nothing.
    assert w.get_transfer_results().kv_read_after_release == set()


def test_a_late_read_on_an_idle_producer_is_reported_and_still_counted_by_nixl():
    # Nothing else finishes in the step; vLLM's own counter of notifications
    # after expiry still counts it, as before.
    w = pull_worker()
    send(w, "late", expires_in=-1)
    expire(w)
    read_done(w, "late")
    results = w.get_transfer_results()
    assert results.finished_sending == set() and results.kv_read_after_release == {"late"}
    assert len(w.xfer_stats.data["num_notifications_after_expiry"]) == 1


def test_a_repeated_notification_of_a_completed_read_is_no_read_after_release(caplog):
    # A consumer whose load failed its check notifies once more, after the
    # producer freed the request on the first notification.
    w = pull_worker()
    send(w, "r", expires_in=60)
    read_done(w, "r")
    assert w._get_new_notifs() == {"r"}
    read_done(w, "r")
    with capture_logger(caplog, NIXL_LOGGER):
        assert w._get_new_notifs() == set()
    assert w.__dict__.get("_read_after_release_reqs", set()) == set()
    assert "Potentially invalid KV blocks for unrecognized request r" in caplog.text
    assert "after their lease expired" not in caplog.text


def test_each_late_read_of_a_request_is_reported_once():
    # Two consumer workers read the same producer worker (consumer TP 2):
    # one report; the second notification finds the request forgotten.
    w = pull_worker()
    send(w, "r", expires_in=-1)
    expire(w)
    read_done(w, "r", consumers=2)
    read_done(w, "r", consumers=2)
    assert w._get_new_notifs() == set()
    assert w.__dict__.get("_read_after_release_reqs", set()) == {"r"}
    assert "r" not in w._released_on_expiry()


def test_a_read_after_one_of_two_consumers_finished_in_time_is_reported():
    w = pull_worker()
    send(w, "r", expires_in=60)
    read_done(w, "r", consumers=2)
    assert w._get_new_notifs() == set()  # waits for the second consumer worker
    w._reqs_to_send["r"] = time.perf_counter() - 1
    assert expire(w) == {"r"}
    read_done(w, "r", consumers=2)
    w._get_new_notifs()
    assert w.__dict__.get("_read_after_release_reqs", set()) == {"r"}


def test_the_released_requests_kept_are_bounded_by_the_workers_own_count(monkeypatch):
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    monkeypatch.setattr(base_worker, "_MAX_RELEASED_ON_EXPIRY", 3)
    w = pull_worker()
    for i in range(5):
        send(w, f"r{i}", expires_in=-1)
    expire(w)
    assert list(w._released_on_expiry()) == ["r2", "r3", "r4"]
    for i in range(5):
        read_done(w, f"r{i}")
    w._get_new_notifs()
    # The oldest are forgotten: their late reads are no longer told apart.
    assert w.__dict__.get("_read_after_release_reqs", set()) == {"r2", "r3", "r4"}


def test_a_multiconnector_passes_on_every_childs_late_reads():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    class Child:
        def __init__(self, ids):
            self.ids = ids

        def get_transfer_results(self, finished_req_ids):
            return KVConnectorTransferResults(kv_read_after_release=set(self.ids))

    multi = object.__new__(MultiConnector)
    multi._connectors, multi._extra_async_saves = [Child({"a"}), Child({"b"})], {}
    assert multi.get_transfer_results(set()).kv_read_after_release == {"a", "b"}


def test_the_checksum_worker_reports_late_reads_in_every_step_kind():
    from vllm_kvchecksum.engine.runner import checksum_step

    producer = make_side("kv_producer")
    worker = producer.workers[0].checksums
    # Only ids (a connector's set of request ids); anything else is dropped.
    [record] = worker.report_read_after_release({"a", 7, None}).records
    assert record.read_after_release == frozenset({"a"})
    assert worker.report_read_after_release(set()) is None
    # Also in the step whose sends wait for a drafter (sends=False), and with nothing scheduled.
    for sends in (True, False):
        out = checksum_step(worker, None, None, sends=sends, read_after_release={"b"})
        assert [r.read_after_release for r in out.records] == [frozenset({"b"})]
    # Checksums off: no worker, nothing reported, nothing raised.
    assert checksum_step(None, None, None, read_after_release={"b"}) is None


# -- the producer's scheduler -------------------------------------------------


def producer_lines(caplog) -> list[dict]:
    return [r for r in incident.read_incidents("\n".join(
        rec.getMessage() for rec in caplog.records if rec.name == incident.INCIDENT_LOGGER)) if r["side"] == "producer"]


def test_the_producer_counts_a_late_read_once_whichever_workers_report_it(caplog):
    caplog.set_level(logging.INFO, logger=incident.INCIDENT_LOGGER)
    caplog.set_level(logging.ERROR, logger=kvcs_scheduler.logger.name)
    producer = make_side("kv_producer", tp=2)
    # Both TP workers were read late; one reports in this step, the other also in the next.
    producer.step(read_after_release={0: {"p-1"}, 1: {"p-1"}})
    producer.step(read_after_release={1: {"p-1", "p-2"}})
    assert producer.reported_metrics[metrics.PRODUCER_READ_AFTER_RELEASE] == 2
    errors = [r.getMessage() for r in caplog.records
              if r.name == kvcs_scheduler.logger.name and r.levelno == logging.ERROR]
    assert len(errors) == 2 and "producer request p-1 after the connector (NixlConnector)" in errors[0]
    assert "kv_lease_duration" in errors[0]
    lines = producer_lines(caplog)
    assert [(r["request_id"], r["verdict"]) for r in lines] == [("p-1", "read_after_release"),
                                                                  ("p-2", "read_after_release")]
    assert all(r.levelno == logging.ERROR for r in caplog.records if r.name == incident.INCIDENT_LOGGER)
    # Nothing else was counted or held for it.
    assert producer.reported_metrics[metrics.PRODUCER_CHANGED] == 0
    assert producer.reported_metrics[metrics.PRODUCER_INTACT] == 0
    assert stats(producer).get("sent", 0) == 0


def test_the_requests_a_producer_remembers_are_bounded(monkeypatch):
    monkeypatch.setattr(kvcs_scheduler, "MAX_READS_AFTER_RELEASE_KEPT", 2)
    producer = make_side("kv_producer")
    for rid in ("a", "b", "c", "a"):
        producer.step(read_after_release={0: {rid}})
    # "a" was forgotten when "c" came, so its second report counts again.
    assert producer.reported_metrics[metrics.PRODUCER_READ_AFTER_RELEASE] == 4
    assert list(producer.scheduler.kv_checksum._read_after_release) == ["c", "a"]


@pytest.mark.parametrize("runner", pd_harness.MODEL_RUNNERS)
def test_both_model_runners_hand_the_connectors_late_reads_to_the_scheduler(runner):
    producer = make_side("kv_producer")
    runner_step(producer, runner, read_after_release={"p-9"})
    runner_step(producer, runner)
    assert producer.reported_metrics[metrics.PRODUCER_READ_AFTER_RELEASE] == 1


def test_the_prometheus_name():
    """The name dashboards and alerts use (docs: metrics.py)."""
    import prometheus_client

    registry = prometheus_client.CollectorRegistry()
    prom = metrics.KVChecksumProm(True, ["engine"], {0: ["0"]},
                                  functools.partial(prometheus_client.Counter, registry=registry),
                                  functools.partial(prometheus_client.Gauge, registry=registry))
    prom.observe({metrics.PRODUCER_READ_AFTER_RELEASE: 3})
    assert registry.get_sample_value("vllm:kv_checksum_producer_read_after_release_total", {"engine": "0"}) == 3


# -- the join -------------------------------------------------------------------


def consumer_mismatch(remote: str) -> dict:
    return {"side": "consumer", "verdict": "mismatch", "source": "producer", "request_id": "c-1",
            "remote_request_id": remote, "remote_engine_id": None, "carrier": "kv_transfer_params", "groups": {}}


def test_the_join_reads_the_producers_late_read_line_as_released_before_the_read():
    late = incident.producer_record(request_id="p-1", transfer_id=None, result=incident.READ_AFTER_RELEASE,
                                    groups={}, engine_id="P", connector="NixlConnector", carrier=None, tp_size=1,
                                    pp_size=1, block_sizes={0: 16}, reason="", now=0.0)
    # The re-check at the lease's expiry found the KV intact: the late read still wins.
    intact = {**late, "verdict": "intact"}
    log = "\n".join(incident.INCIDENT_MARK + incident.json.dumps(r) for r in (intact, late))
    found = incident.producer_evidence([log])
    assert found.read_after_release == {("p-1", "P")}
    # NIXL's expiry line for another request is a release, not a read after it.
    expiry = ("WARNING [base_worker.py:3044] Releasing expired KV blocks for request p-0 which were retrieved by 0 "
              "remote worker(s) before lease expired.")
    with_expiry = incident.producer_evidence([expiry + "\n" + log])
    assert with_expiry.read_after_release == {("p-1", "P")} and with_expiry.expired == {("p-0", "P")}
    # A late read is no re-check: the re-checks stay unambiguous.
    assert found.rechecked == {("p-1", "P"): "intact"}
    [(_, place)] = incident.attribute([incident.INCIDENT_MARK + incident.json.dumps(consumer_mismatch("p-1"))], [log])
    assert place == incident.RELEASED_BEFORE_READ
    [(_, place)] = incident.attribute([incident.INCIDENT_MARK + incident.json.dumps(consumer_mismatch("p-2"))], [log])
    assert place == incident.NOT_RECHECKED
    # The expiry alone: the read may have completed before it.
    [(_, place)] = incident.attribute([incident.INCIDENT_MARK + incident.json.dumps(consumer_mismatch("p-0"))],
                                      [expiry + "\n" + log])
    assert place == incident.UNKNOWN_RELEASED


def test_a_malformed_late_read_line_is_skipped():
    bad = [{"side": "producer", "verdict": incident.READ_AFTER_RELEASE, "request_id": rid} for rid in (["x"], 7, None)]
    log = "\n".join(incident.INCIDENT_MARK + incident.json.dumps(r) for r in bad)
    found = incident.producer_evidence([log])
    assert found.read_after_release == set() and found.attempts == {}
