"""Incident lines and the where-join, without vLLM (vllm_kvchecksum.engine.incident)."""

from __future__ import annotations

import json
import logging

from vllm_kvchecksum.engine import incident


def record(**changes):
    base = dict(request_id="c-1", verdict="mismatch", source="producer", groups={1: [4, 2], 0: [7]},
                remote_request_id="p-1", remote_engine_id="eng-p", engine_id="eng-c", connector="NixlConnector",
                carrier="kv_transfer_params", tp_size=2, pp_size=1, block_sizes={0: 16, 1: 32},
                producer_tp_size=4, producer_block_sizes={0: 16}, now=5.0)
    base.update(changes)
    return incident.incident_record(**base)


def test_the_record_has_stable_keys_and_sorted_positions():
    r = record()
    assert set(r) == {"side", "time", "request_id", "verdict", "source", "cause", "remote_request_id", "remote_engine_id",
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
    rechecked = {("p-1", "e"): "changed", ("p-2", "e"): "intact", ("p-3", None): "intact",
                 ("p-5", "e1"): "changed", ("p-5", "e2"): "intact", ("p-6", "e"): "not_rechecked",
                 ("p-8", "e"): incident.AMBIGUOUS}

    def at(**changes):
        return incident.where(record(**{"remote_engine_id": "e", **changes}), set(), rechecked)

    assert at() == incident.CHANGED_ON_PRODUCER
    assert at(remote_request_id="p-2") == incident.INTACT_ON_PRODUCER
    # A release before the read comes first: the re-check at the lease's expiry ran before the read.
    assert incident.where(record(remote_request_id="p-2", remote_engine_id="e"), {"p-2"}, rechecked) == \
        incident.RELEASED_BEFORE_READ
    # A load that names an engine takes that engine's re-check only: another
    # producer's line for the same request id is not this transfer's.
    assert at(remote_engine_id="eng-p") == incident.NOT_RECHECKED
    assert at(remote_request_id="p-3") == incident.NOT_RECHECKED
    assert at(remote_request_id="p-5", remote_engine_id="e2") == incident.INTACT_ON_PRODUCER
    # A load that names none takes the one re-check under its id, of any engine...
    assert at(remote_request_id="p-3", remote_engine_id=None) == incident.INTACT_ON_PRODUCER
    assert at(remote_engine_id=None) == incident.CHANGED_ON_PRODUCER
    # ... and cannot tell two apart.
    assert at(remote_request_id="p-5", remote_engine_id=None) == incident.NOT_RECHECKED
    assert at(remote_request_id="p-6") == incident.NOT_RECHECKED
    assert at(remote_request_id="p-7") == incident.NOT_RECHECKED
    assert at(remote_request_id="p-8") == incident.NOT_RECHECKED


def test_two_rechecks_under_one_key_that_disagree_are_ambiguous():
    def line(verdict, rid="p-1"):
        return incident.INCIDENT_MARK + json.dumps(incident.producer_record(
            request_id=rid, transfer_id=None, result=verdict, groups={}, engine_id="e", connector="NixlConnector",
            carrier="kv_transfer_params", tp_size=1, pp_size=1, block_sizes={0: 16}, reason="", now=0.0))

    # A retry of a mismatched request, sent with the same id to the same producer.
    assert incident.rechecks("\n".join([line("changed"), line("intact")]))[("p-1", "e")] == incident.AMBIGUOUS
    assert incident.rechecks("\n".join([line("intact"), line("intact")]))[("p-1", "e")] == "intact"
    # The same across two producer logs.
    consumer = incident.INCIDENT_MARK + json.dumps(record(remote_engine_id="e"))
    [(_, place)] = incident.attribute([consumer], [line("changed"), line("intact")])
    assert place == incident.NOT_RECHECKED
    [(_, place)] = incident.attribute([consumer], [line("changed"), line("changed", "p-2")])
    assert place == incident.CHANGED_ON_PRODUCER


def test_a_producer_line_is_found_by_its_transfer_id_too():
    line = incident.producer_record(request_id="p-1-prefill", transfer_id="xfer-1", result="changed",
                                    groups={0: [2]}, engine_id="e", connector="MooncakeConnector", carrier="connector",
                                    tp_size=1, pp_size=1, block_sizes={0: 16}, reason="", now=0.0)
    text = "INFO " + incident.INCIDENT_MARK + json.dumps(line)
    found = incident.rechecks(text)
    assert found[("p-1-prefill", "e")] == found[("xfer-1", "e")] == "changed"
    # The third key, its base id (NIXL push's pairing), never equals an id.
    [base] = [k for k, _ in found if k not in ("p-1-prefill", "xfer-1")]
    assert len(found) == 3 and base.startswith("\x00") and base.endswith("p-1-prefill")
    # Consumer lines in a producer's log are not re-checks.
    assert incident.rechecks(incident.INCIDENT_MARK + json.dumps(record())) == {}


def test_attribute_keeps_mismatches_only():
    lines = [incident.INCIDENT_MARK + json.dumps(record(request_id="a")),
             incident.INCIDENT_MARK + json.dumps(record(request_id="b", verdict="unverified"))]
    rows = incident.attribute(["\n".join(lines)], [])
    assert [(r["request_id"], place) for r, place in rows] == [("a", incident.NOT_RECHECKED)]


def producer_line(**changes):
    base = dict(request_id="p-1", transfer_id=None, result="changed", groups={0: [7, 2]}, engine_id="e",
                connector="NixlConnector", carrier="kv_transfer_params", tp_size=1, pp_size=1,
                block_sizes={0: 16}, reason="", now=0.0)
    base.update(changes)
    return incident.producer_record(**base)


def test_a_changed_producer_kv_is_logged_as_an_error(caplog):
    caplog.set_level(logging.DEBUG, logger=incident.INCIDENT_LOGGER)
    for verdict in ("changed", "intact", "not_rechecked"):
        incident.emit(producer_line(request_id=f"p-{verdict}", result=verdict))
    incident.emit(record())
    levels = {json.loads(r.getMessage()[len(incident.INCIDENT_MARK):])["request_id"]: r.levelno
              for r in caplog.records if r.name == incident.INCIDENT_LOGGER}
    assert levels == {"p-changed": logging.ERROR, "p-intact": logging.INFO, "p-not_rechecked": logging.INFO,
                      "c-1": logging.ERROR}


def test_the_producer_line_has_sorted_bounded_positions():
    line = producer_line(groups={1: [9, 3], 0: [5, 1, 4]})
    assert line["groups"] == {"0": [1, 4, 5], "1": [3, 9]} and line["verdict"] == "changed"
    assert len(producer_line(groups={0: range(10_000, 0, -1)})["groups"]["0"]) == incident.MAX_POSITIONS
    assert producer_line(groups={0: range(10_000, 0, -1)})["groups"]["0"][:2] == [1, 2]


def test_attribute_joins_every_producers_log():
    consumer = "\n".join(incident.INCIDENT_MARK + json.dumps(record(request_id=f"c-{p}", remote_request_id=p,
                                                                    remote_engine_id=None))
                         for p in ("p-1", "p-2", "p-3"))
    producers = [incident.INCIDENT_MARK + json.dumps(producer_line(request_id="p-1", engine_id="e1")),
                 EXPIRED.format("p-2"),
                 incident.INCIDENT_MARK + json.dumps(producer_line(request_id="p-3", engine_id="e3", result="intact"))]
    for logs in (producers, producers[::-1]):
        rows = incident.attribute([consumer], logs)
        assert {r["request_id"]: place for r, place in rows} == {
            "c-p-1": incident.CHANGED_ON_PRODUCER, "c-p-2": incident.RELEASED_BEFORE_READ,
            "c-p-3": incident.INTACT_ON_PRODUCER}


def test_the_join_tells_two_producers_of_one_request_id_apart_by_engine():
    logs = [incident.INCIDENT_MARK + json.dumps(producer_line(request_id="p-5", engine_id="e1", result="changed")),
            incident.INCIDENT_MARK + json.dumps(producer_line(request_id="p-5", engine_id="e2", result="intact"))]
    for producers in (logs, logs[::-1]):
        for engine, place in (("e1", incident.CHANGED_ON_PRODUCER), ("e2", incident.INTACT_ON_PRODUCER),
                              (None, incident.NOT_RECHECKED)):
            consumer = incident.INCIDENT_MARK + json.dumps(record(request_id="c-5", remote_request_id="p-5",
                                                                  remote_engine_id=engine))
            [(_, got)] = incident.attribute([consumer], producers)
            assert got == place, (engine, producers)


def test_a_push_consumer_is_paired_with_its_producer_by_base_id():
    """NIXL push: the consumer's load names the proxy's id, not the producer's;
    the two sides' vLLM request ids share their base (get_base_request_id)."""
    producer = incident.producer_record(
        request_id="cmpl-demo.7.r-0-868a704e", transfer_id=None, result="intact", groups={}, engine_id="P",
        connector="NixlPushConnector", carrier="connector", tp_size=1, pp_size=1, block_sizes={0: 32}, reason="",
        now=0.0)
    rechecked = incident.rechecks(incident.INCIDENT_MARK + json.dumps(producer))
    push = record(request_id="cmpl-demo.7.r-0-a13ad2ab", remote_request_id="demo.7.r", remote_engine_id="P",
                  connector="NixlPushConnector", carrier="connector")
    assert incident.where(push, set(), rechecked) == incident.INTACT_ON_PRODUCER
    # Another request's base, or another producer engine, is not it.
    assert incident.where(dict(push, request_id="cmpl-demo.8.r-0-a13ad2ab"), set(), rechecked) == \
        incident.NOT_RECHECKED
    assert incident.where(dict(push, remote_engine_id="Q"), set(), rechecked) == incident.NOT_RECHECKED
    # A pull load names the producer's own id: no pairing by base id there.
    assert incident.where(dict(push, carrier="kv_transfer_params"), set(), rechecked) == incident.NOT_RECHECKED
    # The push producer's lease ran out before the WRITE landed: its expiry line names its own id.
    released = incident.released_requests(EXPIRED.format("cmpl-demo.7.r-0-868a704e"))
    assert incident.where(push, released, rechecked) == incident.RELEASED_BEFORE_READ
    assert incident.where(dict(push, carrier="kv_transfer_params"), released, rechecked) == incident.NOT_RECHECKED
    # The base is vLLM's: only an 8-hex suffix is cut.
    assert incident.base_request_id("cmpl-x-0-868a704e") == "cmpl-x-0"
    assert incident.base_request_id("cmpl-x-0-868a704") == "cmpl-x-0-868a704"
    assert incident.base_request_id("cmpl-x-0-868a704z") == "cmpl-x-0-868a704z"
