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


def test_where_each_mismatch_happened():
    released = incident.released_requests(
        "ERROR [pull_worker.py:667] Potentially invalid KV blocks for unrecognized request p-1 were retrieved by "
        "a decode worker. They may have expired.\nPotentially invalid KV blocks for unrecognized request p-2 were "
        "retrieved\n")
    assert released == {"p-1", "p-2"}
    assert incident.where(record(), released) == incident.RELEASED_BEFORE_READ
    assert incident.where(record(remote_request_id="p-3"), released) == incident.NOT_RECHECKED
    # A load that named no producer request is never matched (not even with a None in the set).
    assert incident.where(record(remote_request_id=None), released | {None}) == incident.NOT_RECHECKED
    assert incident.where(record(source="offloaded"), released) == incident.OFFLOADED


def test_attribute_keeps_mismatches_only():
    lines = [incident.INCIDENT_MARK + json.dumps(record(request_id="a")),
             incident.INCIDENT_MARK + json.dumps(record(request_id="b", verdict="unverified"))]
    rows = incident.attribute(["\n".join(lines)], [])
    assert [(r["request_id"], place) for r, place in rows] == [("a", incident.NOT_RECHECKED)]
