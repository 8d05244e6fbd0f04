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
STARTS = "(EngineCore pid=5) INFO [base_scheduler.py:99] Initializing NIXL Scheduler {}\n"


def line_of(**changes) -> str:
    """A producer's incident line (re-check or read after the release) in its log."""
    return "INFO " + incident.INCIDENT_MARK + json.dumps(producer_line(**changes)) + "\n"


def evidence(*logs):
    return incident.producer_evidence(logs)


def test_a_pull_loads_release_is_a_read_after_it_not_the_lease_expiry_alone():
    """NIXL's lease-expiry line says the blocks were released, not that the
    read came after: a read that completed first was of intact KV. Only the
    producer's own read-after-release line says so."""
    late = line_of(result=incident.READ_AFTER_RELEASE, groups={})
    for logs, place in [
            ((EXPIRED.format("p-1"),), incident.UNKNOWN_RELEASED),
            ((EXPIRED.format("p-1") + line_of(result="intact"),), incident.UNKNOWN_RELEASED),
            ((EXPIRED.format("p-1") + line_of(result="changed"),), incident.CHANGED_ON_PRODUCER),
            ((EXPIRED.format("p-1") + line_of(result="intact") + late,), incident.RELEASED_BEFORE_READ),
            ((late,), incident.RELEASED_BEFORE_READ),
            # A notification for a request already freed, with no expiry, is a repeated notification.
            ((UNRECOGNIZED.format("p-1"),), incident.NOT_RECHECKED),
            ((UNRECOGNIZED.format("p-1") + line_of(result="intact"),), incident.INTACT_ON_PRODUCER)]:
        assert incident.where(record(remote_engine_id="e"), evidence(*logs)) == place, logs
        assert incident.where(record(remote_engine_id=None), evidence(*logs)) == place, logs
    # Another request's lines are not this one's.
    assert incident.where(record(remote_request_id="p-3"), evidence(EXPIRED.format("p-1"), late)) == \
        incident.NOT_RECHECKED
    # A load that named no producer request is never matched.
    assert incident.where(record(remote_request_id=None), evidence(late)) == incident.NOT_RECHECKED
    assert incident.where(record(source="offloaded"), evidence(late)) == incident.OFFLOADED


def test_a_release_by_another_producer_engine_is_not_this_loads():
    """Released ids carry no engine: the engine whose log holds the line
    (its "Initializing NIXL" line, or the one engine its incident lines name)
    is the one that released it."""
    e1 = STARTS.format("e1") + EXPIRED.format("p-1") + line_of(result=incident.READ_AFTER_RELEASE, engine_id="e1")
    e2 = STARTS.format("e2") + line_of(result="intact", engine_id="e2")
    for logs in ((e1, e2), (e2, e1)):
        assert incident.where(record(remote_engine_id="e2"), evidence(*logs)) == incident.INTACT_ON_PRODUCER
        assert incident.where(record(remote_engine_id="e1"), evidence(*logs)) == incident.RELEASED_BEFORE_READ
        assert incident.where(record(remote_engine_id="e3"), evidence(*logs)) == incident.NOT_RECHECKED
    # A push load (paired by base id): the expiry of e1's attempt is not the one e2 wrote.
    push = record(request_id="cmpl-x.1-0-aaaaaaaa", remote_request_id="x.1", carrier="connector",
                  connector="NixlPushConnector", remote_engine_id="e2")
    e1 = STARTS.format("e1") + EXPIRED.format("cmpl-x.1-0-11111111")
    e2 = STARTS.format("e2") + line_of(request_id="cmpl-x.1-0-22222222", result="intact", engine_id="e2")
    assert incident.where(push, evidence(e1, e2)) == incident.INTACT_ON_PRODUCER
    assert incident.where(dict(push, remote_engine_id="e1"), evidence(e1, e2)) == incident.RELEASED_BEFORE_READ
    # Without an "Initializing" line, the one engine the log's incident lines name wrote it.
    e1 = EXPIRED.format("cmpl-x.1-0-11111111") + line_of(request_id="cmpl-x.0-0-33333333", engine_id="e1")
    assert incident.where(push, evidence(e1, e2)) == incident.INTACT_ON_PRODUCER
    # A log that says no engine: whose release it was is unknown.
    anonymous = EXPIRED.format("cmpl-x.1-0-22222222")
    assert incident.where(push, evidence(anonymous, e2)) == incident.UNKNOWN_RELEASED
    # Nor does one whose incident lines name two engines and no "Initializing" line.
    two = (EXPIRED.format("cmpl-x.1-0-22222222") + line_of(request_id="cmpl-x.0-0-33333333", engine_id="e1")
           + line_of(request_id="cmpl-x.2-0-44444444", engine_id="e2"))
    assert incident.where(push, evidence(two, e2)) == incident.UNKNOWN_RELEASED
    # Two engines' lines interleaved in one log (not one after the other): the order says nothing.
    mixed = (STARTS.format("e1") + STARTS.format("e2") + EXPIRED.format("cmpl-x.1-0-22222222")
             + line_of(request_id="cmpl-x.0-0-33333333", engine_id="e1"))
    assert incident.where(push, evidence(mixed, e2)) == incident.UNKNOWN_RELEASED
    # A restarted producer: each line is the engine's that started last before it.
    restarted = (STARTS.format("e1") + EXPIRED.format("cmpl-x.1-0-11111111") + STARTS.format("e2")
                 + line_of(request_id="cmpl-x.1-0-22222222", result="intact", engine_id="e2"))
    assert incident.where(push, evidence(restarted)) == incident.INTACT_ON_PRODUCER


def test_a_push_retry_is_answered_from_its_own_attempt_or_unknown():
    """NIXL push pairs a consumer with its producer by X-Request-Id (the base
    id) alone: a retry under the same id has two producer attempts, and the
    logs name neither as this load's. Attempt 1's release or re-check is
    never taken for attempt 2."""
    push = record(request_id="cmpl-x.1-0-aaaaaaaa", remote_request_id="x.1", carrier="connector",
                  connector="NixlPushConnector", remote_engine_id="e")
    first, second = "cmpl-x.1-0-11111111", "cmpl-x.1-0-22222222"
    # (a) attempt 1 released, attempt 2 (this load's) re-checked intact.
    log = STARTS.format("e") + EXPIRED.format(first) + line_of(request_id=second, result="intact")
    assert incident.where(push, evidence(log)) == incident.UNKNOWN_ATTEMPT
    # (d) attempt 1 intact, attempt 2 not re-checked (its release: the only line of it).
    log = STARTS.format("e") + line_of(request_id=first, result="intact") + EXPIRED.format(second)
    assert incident.where(push, evidence(log)) == incident.UNKNOWN_ATTEMPT
    log = (STARTS.format("e") + line_of(request_id=first, result="intact")
           + line_of(request_id=second, result="not_rechecked"))
    assert incident.where(push, evidence(log)) == incident.UNKNOWN_ATTEMPT
    # One attempt: its own evidence.
    assert incident.where(push, evidence(STARTS.format("e") + line_of(request_id=second, result="intact"))) == \
        incident.INTACT_ON_PRODUCER
    assert incident.where(push, evidence(STARTS.format("e") + EXPIRED.format(second))) == \
        incident.RELEASED_BEFORE_READ
    assert incident.where(push, evidence(STARTS.format("e") + line_of(request_id=second, result="not_rechecked"))) \
        == incident.NOT_RECHECKED
    # Another engine's attempt of the same id is not one of this engine's.
    other = STARTS.format("f") + line_of(request_id=first, result="intact", engine_id="f")
    assert incident.where(push, evidence(other, STARTS.format("e") + line_of(request_id=second, result="intact"))) \
        == incident.INTACT_ON_PRODUCER
    # A load that names no engine counts every engine's attempts.
    assert incident.where(dict(push, remote_engine_id=None), evidence(
        other, STARTS.format("e") + line_of(request_id=second, result="intact"))) == incident.UNKNOWN_ATTEMPT


def test_where_with_the_producers_rechecks():
    logs = [line_of(request_id="p-1", engine_id="e", result="changed"),
            line_of(request_id="p-2", engine_id="e", result="intact"),
            line_of(request_id="p-3", engine_id=None, result="intact"),
            line_of(request_id="p-5", engine_id="e1", result="changed"),
            line_of(request_id="p-5", engine_id="e2", result="intact"),
            line_of(request_id="p-6", engine_id="e", result="not_rechecked"),
            line_of(request_id="p-8", engine_id="e", result="changed") + line_of(request_id="p-8", engine_id="e",
                                                                                result="intact")]
    found = evidence(*logs)

    def at(**changes):
        return incident.where(record(**{"remote_engine_id": "e", **changes}), found)

    assert at() == incident.CHANGED_ON_PRODUCER
    assert at(remote_request_id="p-2") == incident.INTACT_ON_PRODUCER
    # A load that names an engine takes that engine's re-check only: another
    # producer's line for the same request id is not this transfer's.
    assert at(remote_engine_id="eng-p") == incident.NOT_RECHECKED
    assert at(remote_request_id="p-3") == incident.NOT_RECHECKED
    assert at(remote_request_id="p-5", remote_engine_id="e2") == incident.INTACT_ON_PRODUCER
    # A load that names none takes the one re-check under its id, of any engine...
    assert at(remote_request_id="p-3", remote_engine_id=None) == incident.INTACT_ON_PRODUCER
    assert at(remote_engine_id=None) == incident.CHANGED_ON_PRODUCER
    # ... and cannot tell two apart.
    assert at(remote_request_id="p-5", remote_engine_id=None) == incident.UNKNOWN_ATTEMPT
    assert at(remote_request_id="p-6") == incident.NOT_RECHECKED
    assert at(remote_request_id="p-7") == incident.NOT_RECHECKED
    # Two re-checks of one id on one engine that disagree (a reused id): which was this load's is unknown.
    assert at(remote_request_id="p-8") == incident.UNKNOWN_ATTEMPT


def test_two_rechecks_under_one_key_that_disagree_are_ambiguous():
    # A retry of a mismatched request, sent with the same id to the same producer.
    assert evidence(line_of(result="changed") + line_of(result="intact")).rechecked[("p-1", "e")] == \
        incident.AMBIGUOUS
    assert evidence(line_of(result="intact") + line_of(result="intact")).rechecked[("p-1", "e")] == "intact"
    # The same across two producer logs.
    consumer = incident.INCIDENT_MARK + json.dumps(record(remote_engine_id="e"))
    [(_, place)] = incident.attribute([consumer], [line_of(result="changed"), line_of(result="intact")])
    assert place == incident.UNKNOWN_ATTEMPT
    [(_, place)] = incident.attribute([consumer], [line_of(result="changed"), line_of(result="changed",
                                                                                         request_id="p-2")])
    assert place == incident.CHANGED_ON_PRODUCER


def test_a_producer_line_is_found_by_its_transfer_id_too():
    line = incident.producer_record(request_id="p-1-prefill", transfer_id="xfer-1", result="changed",
                                    groups={0: [2]}, engine_id="e", connector="MooncakeConnector", carrier="connector",
                                    tp_size=1, pp_size=1, block_sizes={0: 16}, reason="", now=0.0)
    found = evidence("INFO " + incident.INCIDENT_MARK + json.dumps(line))
    assert found.rechecked == {("p-1-prefill", "e"): "changed", ("xfer-1", "e"): "changed"}
    mooncake = record(request_id="cmpl-c-0-aaaaaaaa", remote_request_id="xfer-1", carrier="connector",
                      remote_engine_id="e")
    assert incident.where(mooncake, found) == incident.CHANGED_ON_PRODUCER
    # Consumer lines in a producer's log are not re-checks.
    assert evidence(incident.INCIDENT_MARK + json.dumps(record())).rechecked == {}


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
                 EXPIRED.format("p-2") + line_of(request_id="p-2", engine_id="e2", groups={},
                                                 result=incident.READ_AFTER_RELEASE),
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
                              (None, incident.UNKNOWN_ATTEMPT)):
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
    rechecked = evidence(incident.INCIDENT_MARK + json.dumps(producer))
    push = record(request_id="cmpl-demo.7.r-0-a13ad2ab", remote_request_id="demo.7.r", remote_engine_id="P",
                  connector="NixlPushConnector", carrier="connector")
    assert incident.where(push, rechecked) == incident.INTACT_ON_PRODUCER
    # Another request's base, or another producer engine, is not it.
    assert incident.where(dict(push, request_id="cmpl-demo.8.r-0-a13ad2ab"), rechecked) == incident.NOT_RECHECKED
    assert incident.where(dict(push, remote_engine_id="Q"), rechecked) == incident.NOT_RECHECKED
    # A pull load names the producer's own id: no pairing by base id there.
    assert incident.where(dict(push, carrier="kv_transfer_params"), rechecked) == incident.NOT_RECHECKED
    # The push producer's lease ran out before the WRITE landed: its expiry line names its own id.
    released = evidence(STARTS.format("P") + EXPIRED.format("cmpl-demo.7.r-0-868a704e"))
    assert incident.where(push, released) == incident.RELEASED_BEFORE_READ
    assert incident.where(dict(push, carrier="kv_transfer_params"), released) == incident.NOT_RECHECKED
    # The base is vLLM's: only an 8-hex suffix is cut.
    assert incident.base_request_id("cmpl-x-0-868a704e") == "cmpl-x-0"
    assert incident.base_request_id("cmpl-x-0-868a704") == "cmpl-x-0-868a704"
    assert incident.base_request_id("cmpl-x-0-868a704z") == "cmpl-x-0-868a704z"
