"""Incident lines and the where-join, without vLLM (vllm_kvchecksum.incident)."""

from __future__ import annotations

import json
import logging

from vllm_kvchecksum import incident


def record(**changes):
    base = dict(request_id="c-1", verdict="mismatch", source="producer", groups={1: [4, 2], 0: [7]},
                remote_request_id="p-1", remote_engine_id="eng-p", engine_id="eng-c", connector="NixlConnector",
                carrier="kv_transfer_params", tp_size=2, pp_size=1, block_sizes={0: 16, 1: 32},
                producer_tp_size=4, producer_block_sizes={0: 16}, now=5.0)
    base.update(changes)
    return incident.incident_record(**base)


def test_the_record_has_stable_keys_and_sorted_positions():
    r = record()
    assert set(r) == {"side", "time", "request_id", "verdict", "source", "remote_request_id", "remote_engine_id",
                      "engine_id", "connector", "carrier", "tp_size", "pp_size", "block_sizes", "producer_tp_size",
                      "producer_block_sizes", "groups"}
    assert r["groups"] == {"0": [7], "1": [2, 4]} and r["block_sizes"] == {"0": 16, "1": 32}
    many = record(groups={0: range(10_000)})
    assert len(many["groups"]["0"]) == incident.MAX_POSITIONS
    assert record(producer_block_sizes=None)["producer_block_sizes"] is None


def test_ids_from_outside_are_strings_and_bounded():
    assert incident.remote_ids({"remote_request_id": "x" * 999, "remote_engine_id": 5}) == (
        "x" * incident.MAX_ID_CHARS, None)
    assert incident.remote_ids({"transfer_id": "t-1", "remote_engine_id": "e"}) == ("t-1", "e")
    assert incident.remote_ids({"remote_request_id": "", "transfer_id": "t"}) == ("t", None)
    assert incident.remote_ids(None) == (None, None) and incident.remote_ids(["a"]) == (None, None)


def test_emitted_lines_are_read_back_from_any_log_format(caplog):
    caplog.set_level(logging.ERROR, logger=incident.INCIDENT_LOGGER)
    incident.emit(record())
    incident.emit(record(request_id="c-2", source="offloaded"))
    text = "\n".join(f"(EngineCore pid=7) ERROR 12-05 [x.py:1] {r.getMessage()}" for r in caplog.records)
    text += "\nKV checksum incident: {not json\nKV checksum incident: [1, 2]\nanother line"
    got = incident.read_incidents(text)
    assert [g["request_id"] for g in got] == ["c-1", "c-2"]
    assert got[0] == json.loads(json.dumps(record()))


def test_emit_never_raises(caplog):
    incident.emit({"request_id": "c-9", "bad": object()})
    assert any("incident line of request 'c-9'" in r.getMessage() for r in caplog.records)


EXPIRED = ("WARNING [base_worker.py:3033] Releasing expired KV blocks for request {} which were retrieved by 0 "
           "remote worker(s) before lease expired.\n")
UNRECOGNIZED = ("ERROR [pull_worker.py:667] Potentially invalid KV blocks for unrecognized request {} were "
                "retrieved by a decode worker. They may have expired.\n")


def test_where_each_mismatch_happened():
    released = incident.released_requests(EXPIRED.format("p-1") + UNRECOGNIZED.format("p-1") + EXPIRED.format("p-2")
                                          + UNRECOGNIZED.format("p-4"))
    # A notification for a request already freed, with no expiry, is a repeated notification, not a release.
    assert released == {"p-1", "p-2"}
    assert incident.where(record(), released) == incident.RELEASED_BEFORE_READ
    assert incident.where(record(remote_request_id="p-3"), released) == incident.NOT_RECHECKED
    assert incident.where(record(remote_request_id="p-4"), released) == incident.NOT_RECHECKED
    # A load that named no producer request is never matched (not even with a None in the set).
    assert incident.where(record(remote_request_id=None), released | {None}) == incident.NOT_RECHECKED
    assert incident.where(record(source="offloaded"), released) == incident.OFFLOADED


def test_where_with_the_producers_rechecks():
    rechecked = {("p-1", "e"): "changed", ("p-2", "e"): "intact", ("p-3", "other"): "intact",
                 ("p-5", "e1"): "changed", ("p-5", "e2"): "intact", ("p-6", "e"): "not_rechecked"}
    assert incident.where(record(), set(), rechecked) == incident.CHANGED_ON_PRODUCER
    assert incident.where(record(remote_request_id="p-2"), set(), rechecked) == incident.INTACT_ON_PRODUCER
    # A release before the read comes first: the re-check at the lease's expiry ran before the read.
    assert incident.where(record(remote_request_id="p-2"), {"p-2"}, rechecked) == incident.RELEASED_BEFORE_READ
    # The engine the load named need not be the producer's id for it (a router's name): one match is enough...
    assert incident.where(record(remote_request_id="p-3"), set(), rechecked) == incident.INTACT_ON_PRODUCER
    assert incident.where(record(remote_request_id="p-3", remote_engine_id=None), set(), rechecked) == \
        incident.INTACT_ON_PRODUCER
    # ... but two producers with that request id and other engines cannot be told apart.
    assert incident.where(record(remote_request_id="p-5"), set(), rechecked) == incident.NOT_RECHECKED
    assert incident.where(record(remote_request_id="p-5", remote_engine_id="e2"), set(), rechecked) == \
        incident.INTACT_ON_PRODUCER
    assert incident.where(record(remote_request_id="p-6"), set(), rechecked) == incident.NOT_RECHECKED
    assert incident.where(record(remote_request_id="p-7"), set(), rechecked) == incident.NOT_RECHECKED


def test_a_producer_line_is_found_by_its_transfer_id_too():
    line = incident.producer_record(request_id="p-1-prefill", transfer_id="xfer-1", result="changed",
                                    groups={0: [2]}, engine_id="e", connector="MooncakeConnector", carrier="connector",
                                    tp_size=1, pp_size=1, block_sizes={0: 16}, reason="", now=0.0)
    text = "INFO " + incident.INCIDENT_MARK + json.dumps(line)
    assert incident.rechecks(text) == {("p-1-prefill", "e"): "changed", ("xfer-1", "e"): "changed"}
    # Consumer lines in a producer's log are not re-checks.
    assert incident.rechecks(incident.INCIDENT_MARK + json.dumps(record())) == {}


def test_attribute_keeps_mismatches_only():
    lines = [incident.INCIDENT_MARK + json.dumps(record(request_id="a")),
             incident.INCIDENT_MARK + json.dumps(record(request_id="b", verdict="unverified"))]
    rows = incident.attribute(["\n".join(lines)], [])
    assert [(r["request_id"], place) for r, place in rows] == [("a", incident.NOT_RECHECKED)]
