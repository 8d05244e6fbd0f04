"""Incident lines on real schedulers, and the join that says where a mismatch happened.

A mismatched load writes one JSON incident line (vllm_kvchecksum.engine.incident)
naming the consumer's request, the producer's request and engine as the
load named them, the connector, carrier, sizes and positions; a verified or
unverified load writes none. The joiner reads them with a producer's log.
"""

from __future__ import annotations

import json

from pd_harness import load, make_side, prefill, prompt_of, stats

from vllm_kvchecksum.engine import incident

PROMPT = 77


def incidents(caplog) -> list[dict]:
    return incident.read_incidents("\n".join(r.getMessage() for r in caplog.records
                                             if r.name == incident.INCIDENT_LOGGER))


def test_a_mismatch_writes_one_incident_line(caplog):
    P = make_side("kv_producer", fail_closed=True)
    C = make_side("kv_consumer", fail_closed=True)
    preq, params = prefill(P, prompt_of(PROMPT))
    result = load(C, P, preq, params, tamper=lambda req: (C.corrupt(req.request_id, position=1),
                                                            C.corrupt(req.request_id, position=3)))
    assert stats(C) == {"mismatch": 1}
    [line] = incidents(caplog)
    assert line["side"] == "consumer" and line["verdict"] == "mismatch" and line["source"] == "producer"
    assert line["request_id"] == result.request.request_id
    assert line["remote_request_id"] == params["remote_request_id"] == preq.request_id
    assert line["remote_engine_id"] == params["remote_engine_id"]
    assert line["engine_id"] == C.scheduler.vllm_config.kv_transfer_config.engine_id
    assert line["connector"] == "NixlConnector" and line["carrier"] == "kv_transfer_params"
    assert (line["tp_size"], line["pp_size"], line["producer_tp_size"]) == (1, 1, 1)
    assert line["block_sizes"] == {"0": 16} and line["producer_block_sizes"] == {"0": 16}
    assert line["groups"] == {"0": [1, 3]}


def test_verified_and_unverified_loads_write_none(caplog):
    P = make_side("kv_producer")
    C = make_side("kv_consumer")
    preq, params = prefill(P, prompt_of(PROMPT))
    load(C, P, preq, params)
    preq, params = prefill(P, prompt_of(PROMPT, seed=2))
    params.pop("kv_checksums")
    load(C, P, preq, params)
    assert stats(C) == {"verified": 1, "unverified": 1}
    assert incidents(caplog) == []


def test_ids_from_the_client_are_bounded(caplog):
    P = make_side("kv_producer")
    C = make_side("kv_consumer")
    preq, params = prefill(P, prompt_of(PROMPT))
    params = dict(params, remote_request_id="r" * 100_000, remote_engine_id=12345)
    load(C, P, preq, params, tamper=lambda req: C.corrupt(req.request_id, position=0))
    [line] = incidents(caplog)
    assert line["remote_request_id"] == "r" * incident.MAX_ID_CHARS and line["remote_engine_id"] is None


def test_the_join_names_a_read_after_release_on_the_producer(caplog, tmp_path, capsys):
    P = make_side("kv_producer")
    C = make_side("kv_consumer")
    reads = []
    for seed in (1, 2):
        preq, params = prefill(P, prompt_of(PROMPT, seed=seed))
        load(C, P, preq, params, tamper=lambda req: C.corrupt(req.request_id, position=2))
        reads.append(preq.request_id)
    consumer_log = tmp_path / "consumer.log"
    consumer_log.write_text("\n".join(f"(EngineCore pid=1) ERROR 12-05 01:00:00 [scheduler.py:1] {r.getMessage()}"
                                      for r in caplog.records if r.name == incident.INCIDENT_LOGGER))
    producer_log = tmp_path / "producer.log"
    # vLLM NIXL's line when a request's lease runs out before its read, and the
    # producer's own line for the read that came after; the second request's
    # notification after its release alone is no evidence.
    late = incident.producer_record(request_id=reads[0], transfer_id=None, result=incident.READ_AFTER_RELEASE,
                                    groups={}, engine_id=P.scheduler.vllm_config.kv_transfer_config.engine_id,
                                    connector="NixlConnector", carrier=None, tp_size=1,
                                    pp_size=1, block_sizes={0: 16}, reason="", now=0.0)
    expired = (f"(Worker pid=2) WARNING 12-05 01:00:00 [base_worker.py:3033] Releasing expired KV blocks for "
               f"request {reads[0]} which were retrieved by 0 remote worker(s) before lease expired.\n")
    producer_log.write_text(expired +
                            f"(EngineCore pid=2) ERROR 12-05 01:00:00 [scheduler.py:1] {incident.INCIDENT_MARK}"
                            f"{json.dumps(late)}\n"
                            f"(Worker pid=2) ERROR 12-05 01:00:00 [pull_worker.py:667] Potentially invalid KV "
                            f"blocks for unrecognized request {reads[1]} were retrieved by a decode worker. They "
                            f"may have expired.\n")
    rows = incident.attribute([consumer_log.read_text()], [producer_log.read_text()])
    assert [place for _, place in rows] == [incident.RELEASED_BEFORE_READ, incident.NOT_RECHECKED]
    # The expiry alone does not say the read came after it.
    assert [place for _, place in incident.attribute([consumer_log.read_text()], [expired])] == [
        incident.UNKNOWN_RELEASED, incident.NOT_RECHECKED]
    assert incident.where_main(["--consumer", str(consumer_log), "--producer", str(producer_log)]) == 0
    out = capsys.readouterr().out
    assert "2 mismatches: 1 changed on the producer: released before the read, 1 producer not re-checked" in out
    incident.where_main(["--consumer", str(consumer_log), "--json"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["where"] for x in lines] == [incident.NOT_RECHECKED] * 2


def test_the_joins_base_id_is_nixl_pushs_own():
    """The join pairs a push consumer with its producer as NIXL push does."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import get_base_request_id

    for rid in ("cmpl-demo.7.r-0-868a704e", "cmpl-x-0-ABCDEF01", "cmpl-x-0-868a704", "r", "a-12345678-87654321"):
        assert incident.base_request_id(rid) == get_base_request_id(rid), rid
