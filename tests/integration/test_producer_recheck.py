"""The producer re-checks its KV when the transfer completes, before it frees the blocks.

Real vLLM schedulers (NixlConnector pull, NixlPushConnector, MooncakeConnector
scheduler sides) and checksum workers; the tests play the connectors' worker
halves: they copy the producer's blocks into the consumer's (the transfer)
and report the producer's request finished sending. A producer block changed
after the checksums were sent and before the completion is reported as
"changed" (counter, error line, incident line); an unchanged one as
"intact"; the blocks stay allocated until the re-check's step has run.
"""

from __future__ import annotations

import functools
import json
import logging

import pd_harness
import pytest
from pd_harness import (CONNECTORS, carrier_maker, forward_of, load, make_request, make_side, prefill, prompt_of,
                        stats)

from vllm_kvchecksum.engine import incident, metrics

PROMPT = 77


@pytest.fixture(autouse=True)
def incident_lines(caplog):
    # An intact re-check's line is at INFO.
    caplog.set_level(logging.INFO, logger=incident.INCIDENT_LOGGER)


@pytest.fixture(params=sorted(CONNECTORS))
def make(request):
    return carrier_maker(request.param, functools.partial(make_side, producer_recheck=True))


def incidents(caplog, side: str) -> list[dict]:
    return [line for line in incident.read_incidents("\n".join(
        r.getMessage() for r in caplog.records if r.name == incident.INCIDENT_LOGGER)) if line["side"] == side]


def free_blocks(side) -> int:
    return side.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def complete(producer, preq) -> None:
    """The connector reports the transfer complete; the next step re-checks; the blocks go."""
    rid = preq.request_id
    free_before = free_blocks(producer)
    out, _ = producer.step(finished_sending={rid})
    # Held for the re-check: still the scheduler's, still allocated, still a send in flight.
    assert rid in producer.scheduler.requests and free_blocks(producer) == free_before
    assert producer.reported_gauges[metrics.SENDS_IN_FLIGHT] == 1
    out, _ = producer.step()
    assert rid in out.kv_checksum_scheduled.reqs_to_recheck
    assert rid not in producer.scheduler.requests and free_blocks(producer) > free_before


def test_intact_kv_is_counted_and_the_blocks_are_freed_after_the_recheck(make, caplog):
    P, C = make("kv_producer"), make("kv_consumer")
    preq, params = prefill(P, prompt_of(PROMPT))
    load(C, P, preq, params)
    assert P.reported_gauges[metrics.SENDS_IN_FLIGHT] == 1
    complete(P, preq)
    assert stats(C) == {"verified": 1}
    assert P.reported_metrics[metrics.PRODUCER_INTACT] == 1
    assert P.reported_metrics[metrics.PRODUCER_CHANGED] == 0
    [line] = incidents(caplog, "producer")
    assert line["verdict"] == "intact" and line["request_id"] == preq.request_id and line["groups"] == {}
    assert line["engine_id"] == P.scheduler.vllm_config.kv_transfer_config.engine_id
    kv = P.scheduler.vllm_config.kv_transfer_config
    assert line["connector"] == kv.kv_connector
    assert line["carrier"] == P.scheduler.connector.kv_checksum_carrier(preq, False).value
    assert (line["tp_size"], line["pp_size"]) == (1, 1)
    assert P.reported_gauges[metrics.SENDS_IN_FLIGHT] == 0


def test_a_producer_request_that_decodes_into_a_new_block_is_rechecked(caplog):
    """A prefill leg run with max_tokens 3, not 1: its prompt fills 5 whole
    blocks, so its decode writes a sixth before its transfer completes. The
    re-check reads the blocks of the prompt's tokens, those the checksums
    were sent for: intact, not "blocks moved"."""
    P, C = make_side("kv_producer", producer_recheck=True), make_side("kv_consumer")
    prompt = prompt_of(5 * 16)
    preq = make_request(prompt, params=dict(do_remote_decode=True, do_remote_prefill=False), max_tokens=3)
    P.scheduler.add_request(preq)
    forward, params = forward_of(P, preq), None
    for _ in range(8):
        _, outputs = P.step(forward=forward)
        if preq.request_id in outputs and outputs[preq.request_id].kv_transfer_params is not None:
            params = dict(outputs[preq.request_id].kv_transfer_params)
            break
    assert params is not None and preq.num_output_tokens == 3
    assert len(P.scheduler.kv_cache_manager.get_block_ids(preq.request_id)[0]) == 6
    load(C, P, preq, params)
    complete(P, preq)
    assert stats(C) == {"verified": 1}
    assert P.reported_metrics[metrics.PRODUCER_INTACT] == 1
    assert not P.reported_metrics.get(metrics.labelled(metrics.PRODUCER_NOT_RECHECKED, "blocks_moved"))


def test_kv_changed_before_the_completion_is_the_producers(make, caplog):
    P, C = make("kv_producer"), make("kv_consumer")
    preq, params = prefill(P, prompt_of(PROMPT))
    # A write into the producer's held blocks after the checksums were sent:
    # the consumer reads the changed KV.
    P.corrupt(preq.request_id, position=2)
    P.corrupt(preq.request_id, position=4, worker=0)
    load(C, P, preq, params)
    assert stats(C) == {"mismatch": 1}
    complete(P, preq)
    assert P.reported_metrics[metrics.PRODUCER_CHANGED] == 1
    assert P.reported_metrics[metrics.PRODUCER_CHANGED_BLOCKS] == 2
    assert P.reported_metrics[metrics.PRODUCER_INTACT] == 0
    [line] = incidents(caplog, "producer")
    assert line["verdict"] == "changed" and line["groups"] == {"0": [2, 4]}
    errors = [r.getMessage() for r in caplog.records if r.name == "vllm.kv_checksum" and r.levelname == "ERROR"]
    assert any(preq.request_id in m and "changed before its transfer completed" in m and "group 0 blocks 2, 4" in m
               for m in errors)
    # The join names the producer.
    consumer_log = "\n".join(r.getMessage() for r in caplog.records if r.name == incident.INCIDENT_LOGGER)
    [(_, place)] = incident.attribute([consumer_log], [consumer_log])
    assert place == incident.CHANGED_ON_PRODUCER


def test_kv_bad_on_the_consumer_reads_intact_on_the_producer(caplog):
    P, C = make_side("kv_producer", producer_recheck=True), make_side("kv_consumer")
    preq, params = prefill(P, prompt_of(PROMPT))
    load(C, P, preq, params, tamper=lambda req: C.corrupt(req.request_id, position=1))
    complete(P, preq)
    assert stats(C) == {"mismatch": 1}
    log = "\n".join(r.getMessage() for r in caplog.records if r.name == incident.INCIDENT_LOGGER)
    [(_, place)] = incident.attribute([log], [log])
    assert place == incident.INTACT_ON_PRODUCER
    # Without the producer's log the join cannot tell.
    [(_, place)] = incident.attribute([log], [])
    assert place == incident.NOT_RECHECKED


def test_with_a_batch_queue_the_blocks_stay_until_the_rechecks_own_step(caplog):
    """Step N+1 is scheduled before step N's output: the re-check asked for
    in N's update runs in a later step, and only that step's update frees."""
    P = make_side("kv_producer", batch_queue=True, producer_recheck=True)
    C = make_side("kv_consumer")
    preq, params = prefill(P, prompt_of(PROMPT))
    rid = preq.request_id
    P.corrupt(rid, position=3)
    load(C, P, preq, params)
    free_before = free_blocks(P)
    out_n = P.scheduler.schedule()
    out_n1 = P.scheduler.schedule()
    P.update(out_n, P.run_workers(out_n, finished_sending={rid}))
    assert not out_n1.kv_checksum_scheduled or rid not in out_n1.kv_checksum_scheduled.reqs_to_recheck
    P.update(out_n1, P.run_workers(out_n1))
    assert rid in P.scheduler.requests and free_blocks(P) == free_before
    out_n2 = P.scheduler.schedule()
    assert rid in out_n2.kv_checksum_scheduled.reqs_to_recheck
    P.update(out_n2, P.run_workers(out_n2))
    assert rid not in P.scheduler.requests and free_blocks(P) > free_before
    assert P.reported_metrics[metrics.PRODUCER_CHANGED] == 1
    [line] = incidents(caplog, "producer")
    assert line["groups"] == {"0": [3]}


def test_a_recheck_no_worker_reported_is_not_rechecked_and_still_frees(caplog):
    P, C = make_side("kv_producer", tp=2, producer_recheck=True), make_side("kv_consumer", tp=2)
    preq, params = prefill(P, prompt_of(PROMPT))
    load(C, P, preq, params)
    rid = preq.request_id
    P.step(finished_sending={rid})
    out = P.scheduler.schedule()
    merged = P.run_workers(out)
    # One worker's record of the re-check is lost.
    records = merged.kv_connector_output.kv_checksums.finalize()
    for record in records:
        if record.tp_rank == 1:
            record.requests.pop(rid, None)
    P.update(out, merged)
    assert rid not in P.scheduler.requests
    assert P.reported_metrics[metrics.labelled(metrics.PRODUCER_NOT_RECHECKED, "sum_failed")] == 1
    assert P.reported_metrics[metrics.PRODUCER_INTACT] == 0
    [line] = incidents(caplog, "producer")
    assert line["verdict"] == "not_rechecked"
    assert (line["tp_size"], line["pp_size"]) == (2, 1)


def test_blocks_no_longer_those_sent_are_not_rechecked(monkeypatch, caplog):
    P, C = make_side("kv_producer", producer_recheck=True), make_side("kv_consumer")
    preq, params = prefill(P, prompt_of(PROMPT))
    load(C, P, preq, params)
    rid = preq.request_id
    real = P.scheduler.kv_cache_manager.get_block_ids

    def moved(request_id):
        ids = real(request_id)
        return tuple([*group[:1], group[2], group[1], *group[3:]] for group in ids)

    monkeypatch.setattr(P.scheduler.kv_cache_manager, "get_block_ids", moved)
    P.step(finished_sending={rid})
    # Not held: a re-check of other blocks than those sent would be a false alarm.
    assert rid not in P.scheduler.requests
    assert P.reported_metrics[metrics.labelled(metrics.PRODUCER_NOT_RECHECKED, "blocks_moved")] == 1
    assert P.reported_metrics[metrics.PRODUCER_CHANGED] == 0


def test_a_request_whose_checksums_were_not_sent_is_freed_at_once():
    P, C = make_side("kv_producer", producer_recheck=True), make_side("kv_consumer")
    preq, params = prefill(P, prompt_of(PROMPT))
    # Its sent entry is gone (as for a request that sent no checksums).
    P.scheduler.kv_checksum.release_send(preq.request_id)
    P.step(finished_sending={preq.request_id})
    assert preq.request_id not in P.scheduler.requests
    assert P.reported_metrics[metrics.PRODUCER_INTACT] == 0


def test_off_by_default_the_blocks_go_at_once(caplog):
    P, C = make_side("kv_producer"), make_side("kv_consumer")
    preq, params = prefill(P, prompt_of(PROMPT))
    P.corrupt(preq.request_id, position=2)
    load(C, P, preq, params)
    assert P.reported_gauges.get(metrics.SENDS_IN_FLIGHT, 0) == 0
    P.step(finished_sending={preq.request_id})
    assert preq.request_id not in P.scheduler.requests
    assert not any(k.startswith("producer_") for k in P.reported_metrics)
    assert incidents(caplog, "producer") == []


def test_the_config_key():
    from vllm.config import KVTransferConfig

    nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    assert KVTransferConfig(**nixl, enable_kv_checksum=True).kv_checksum_producer_recheck is False
    assert KVTransferConfig(**nixl, enable_kv_checksum=True,
                            kv_checksum_producer_recheck=True).kv_checksum_producer_recheck is True
    with pytest.raises(ValueError, match="kv_checksum_producer_recheck=True needs enable_kv_checksum=True"):
        KVTransferConfig(**nixl, kv_checksum_producer_recheck=True)


# -- the drill connector's faults on a producer's sends (target "sends") ------

@pytest.fixture
def send_drill(monkeypatch, tmp_path):
    """A producer whose scheduler runs the drill connector (target "sends",
    wrapping NixlConnector) and the drill's worker half over its worker's
    caches (wrapping a stand-in child); a plain consumer."""
    import test_fault_connector as tfc

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    log = tmp_path / "injections.jsonl"
    cfg = {"kinds": ["flip_bit"], "rate": 1.0, "seed": 3, "log_path": str(log), "target": "sends"}
    plain = pd_harness.make_config

    def make_config(role, tp, pp, block_size, **kw):
        if role != "kv_producer" or "connector_extra" in kw:  # (fault_config's own call)
            return plain(role, tp, pp, block_size, **kw)
        kw.pop("connector", None)
        return tfc.fault_config(role, block_size, faults_cfg=cfg, tp=tp, pp=pp, **kw)

    monkeypatch.setattr(pd_harness, "make_config", make_config)
    P = make_side("kv_producer", producer_recheck=True)
    C = make_side("kv_consumer")
    worker_half = tfc.create(tfc.fault_config(faults_cfg=cfg, connectors=[tfc.STUB]), KVConnectorRole.WORKER,
                             P.scheduler.kv_cache_config)
    worker_half.register_kv_caches(P.workers[0].caches)
    return P, C, worker_half, log


def test_a_drill_fault_in_a_held_send_is_found_by_both_sides(send_drill, caplog):
    P, C, worker_half, log = send_drill
    preq, params = prefill(P, prompt_of(PROMPT))
    # The step after the request finished carries the fault to the workers.
    out, _ = P.step()
    assert set(out.kv_connector_metadata.send_fault_plans) == {preq.request_id}
    worker_half.bind_connector_metadata(out.kv_connector_metadata)
    [record] = [json.loads(line) for line in log.read_text().splitlines()]
    assert record["request_id"] == preq.request_id and record["expect"] == "mismatch"
    load(C, P, preq, params)
    assert stats(C) == {"mismatch": 1}
    complete(P, preq)
    [line] = incidents(caplog, "producer")
    assert line["verdict"] == "changed" and line["groups"] == {str(record["group"]): record["positions"]}
    log_text = "\n".join(r.getMessage() for r in caplog.records if r.name == incident.INCIDENT_LOGGER)
    [(consumer_line, place)] = incident.attribute([log_text], [log_text])
    assert place == incident.CHANGED_ON_PRODUCER
    assert consumer_line["groups"] == line["groups"]


def test_a_send_fault_is_planned_only_for_blocks_held_for_a_transfer(send_drill, monkeypatch):
    P, C, worker_half, log = send_drill
    connector = P.scheduler.connector
    # Only the child's answer changes: the drill's own hook still runs after it.
    monkeypatch.setattr(type(connector.sub_connectors[0]), "request_finished_all_groups",
                        lambda self, request, block_ids: (False, None))
    preq, _ = prefill_no_params(P)
    out, _ = P.step()
    assert not out.kv_connector_metadata.send_fault_plans
    [record] = [json.loads(line) for line in log.read_text().splitlines()]
    assert record["request_id"] == preq.request_id and record["skipped"] and record["expect"] == "verified"


def prefill_no_params(P):
    """A producer request run to its end, when its connector returns no kv_transfer_params."""
    req = make_request(prompt_of(PROMPT), remote_decode=True, block_size=P.block_size)
    P.scheduler.add_request(req)
    forward = forward_of(P, req)
    for _ in range(8):
        P.step(forward=forward)
        if req.is_finished():
            return req, None
    raise AssertionError("the producer request did not finish")


def test_blocks_freed_at_once_leave_nothing_to_recheck(monkeypatch):
    """A connector that returns the checksums but does not hold the blocks
    (delay_free False): the Scheduler frees them when the request finishes,
    and nothing of the send stays behind (no finished_sending will come)."""
    P, C = make_side("kv_producer", producer_recheck=True), make_side("kv_consumer")
    connector = type(P.scheduler.connector)
    real = connector.request_finished_all_groups
    monkeypatch.setattr(connector, "request_finished_all_groups",
                        lambda self, request, block_ids: (False, real(self, request, block_ids)[1]))
    preq, params = prefill(P, prompt_of(PROMPT))
    assert "kv_checksums" in params and preq.request_id not in P.scheduler.requests
    P.step()
    assert P.scheduler.kv_checksum.gauges()[metrics.SENDS_IN_FLIGHT] == 0
    assert not any(k.startswith("producer_") for k in P.reported_metrics)


def test_with_a_batch_queue_each_step_judges_only_its_own_rechecks(caplog):
    """A re-check asked for while another's step is in flight is judged in
    its own step: judged earlier it has no records yet, and its blocks
    would be freed before the workers read them."""
    P = make_side("kv_producer", batch_queue=True, producer_recheck=True)
    a, _ = prefill(P, prompt_of(PROMPT, seed=1))
    b, _ = prefill(P, prompt_of(PROMPT, seed=2))
    out1, out2 = P.scheduler.schedule(), P.scheduler.schedule()
    P.update(out1, P.run_workers(out1, finished_sending={a.request_id}))
    out3 = P.scheduler.schedule()
    assert set(out3.kv_checksum_scheduled.reqs_to_recheck) == {a.request_id}
    P.update(out2, P.run_workers(out2, finished_sending={b.request_id}))
    out4 = P.scheduler.schedule()
    assert set(out4.kv_checksum_scheduled.reqs_to_recheck) == {b.request_id}
    P.update(out3, P.run_workers(out3))
    assert a.request_id not in P.scheduler.requests and b.request_id in P.scheduler.requests
    P.update(out4, P.run_workers(out4))
    assert b.request_id not in P.scheduler.requests
    assert P.reported_metrics[metrics.PRODUCER_INTACT] == 2
    assert not any(k.startswith(metrics.PRODUCER_NOT_RECHECKED) for k in P.reported_metrics)
    assert P.scheduler.kv_checksum.gauges()[metrics.SENDS_IN_FLIGHT] == 0


@pytest.mark.parametrize("repeated", ["before_the_recheck_is_scheduled", "while_the_recheck_runs"])
def test_a_completion_reported_twice_frees_the_blocks_once(repeated, caplog):
    """The connector reports the transfer complete again while the re-check
    waits (batch queue: the next step's update): the blocks are freed then,
    nothing of the request stays behind, and the re-check is dropped."""
    P = make_side("kv_producer", batch_queue=True, producer_recheck=True)
    preq, _ = prefill(P, prompt_of(PROMPT))
    rid = preq.request_id
    out1, out2 = P.scheduler.schedule(), P.scheduler.schedule()
    P.update(out1, P.run_workers(out1, finished_sending={rid}))
    assert rid in P.scheduler.requests
    out3 = P.scheduler.schedule() if repeated == "while_the_recheck_runs" else None
    P.update(out2, P.run_workers(out2, finished_sending={rid}))
    assert rid not in P.scheduler.requests
    if out3 is None:
        out3 = P.scheduler.schedule()
        assert not out3.kv_checksum_scheduled or rid not in out3.kv_checksum_scheduled.reqs_to_recheck
    else:
        assert rid in out3.kv_checksum_scheduled.reqs_to_recheck
    P.update(out3, P.run_workers(out3))
    P.step()
    assert P.scheduler.kv_checksum.gauges()[metrics.SENDS_IN_FLIGHT] == 0
    assert P.reported_gauges[metrics.SENDS_IN_FLIGHT] == 0
    assert incidents(caplog, "producer") == []


def test_blocks_that_cannot_be_read_at_the_completion_are_not_rechecked(monkeypatch, caplog):
    import vllm_kvchecksum.engine.scheduler as checksum_scheduler

    P, C = make_side("kv_producer", producer_recheck=True), make_side("kv_consumer")
    preq, params = prefill(P, prompt_of(PROMPT))
    load(C, P, preq, params)

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(checksum_scheduler, "request_blocks", broken)
    P.step(finished_sending={preq.request_id})
    # Blocks it cannot name may not be those sent: freed at once, never "changed".
    assert preq.request_id not in P.scheduler.requests
    assert P.reported_metrics[metrics.labelled(metrics.PRODUCER_NOT_RECHECKED, "blocks_moved")] == 1
    assert P.reported_metrics[metrics.PRODUCER_CHANGED] == P.reported_metrics[metrics.PRODUCER_INTACT] == 0
    assert any(r.exc_info and preq.request_id in r.getMessage() for r in caplog.records)


def run_workers_with_a_drafter(side, out, finished_sending=frozenset()):
    """Each worker as a model runner with a drafter runs the step: the
    loads after the forward (sends=False), the sends and re-checks after
    the drafter (finalize_kv_connector: recvs=False)."""
    from vllm.v1.outputs import KVConnectorOutput

    from vllm_kvchecksum.core.records import KVChecksumOutput
    from vllm_kvchecksum.engine.runner import checksum_step

    outputs = []
    for w in side.workers:
        first = checksum_step(w.checksums, out.kv_checksum_scheduled, set(), sends=False)
        second = checksum_step(w.checksums, out.kv_checksum_scheduled, None, recvs=False)
        kv_out = KVConnectorOutput(finished_sending=set(finished_sending) or None,
                                   kv_checksums=KVChecksumOutput.aggregate([first, second]))
        outputs.append(side.runner_output(out, kv_out))
    return side.aggregator.aggregate(outputs, 0)


def test_with_a_drafter_each_recheck_is_summed_once(caplog):
    P, C = make_side("kv_producer", tp=2, producer_recheck=True), make_side("kv_consumer", tp=2)
    preq, params = prefill(P, prompt_of(PROMPT))
    load(C, P, preq, params)
    rid = preq.request_id
    out = P.scheduler.schedule()
    P.update(out, run_workers_with_a_drafter(P, out, finished_sending={rid}))
    out = P.scheduler.schedule()
    assert rid in out.kv_checksum_scheduled.reqs_to_recheck
    P.update(out, run_workers_with_a_drafter(P, out))
    assert rid not in P.scheduler.requests
    assert P.reported_metrics[metrics.PRODUCER_INTACT] == 1
    [line] = incidents(caplog, "producer")
    assert line["verdict"] == "intact", line["reason"]


def test_the_producer_counters_prometheus_names():
    """The names and labels dashboards and alerts use (docs: metrics.py)."""
    import prometheus_client

    registry = prometheus_client.CollectorRegistry()
    prom = metrics.KVChecksumProm(True, ["engine"], {0: ["0"]},
                                  functools.partial(prometheus_client.Counter, registry=registry),
                                  functools.partial(prometheus_client.Gauge, registry=registry))
    prom.observe({"producer_intact": 3, "producer_changed": 2, "producer_changed_blocks": 5,
                  "producer_not_rechecked/blocks_moved": 1, "producer_not_rechecked/sum_failed": 4})

    def sample(name, **labels):
        return registry.get_sample_value(name, {"engine": "0", **labels})

    assert sample("vllm:kv_checksum_producer_intact_total") == 3
    assert sample("vllm:kv_checksum_producer_changed_total") == 2
    assert sample("vllm:kv_checksum_producer_changed_blocks_total") == 5
    assert sample("vllm:kv_checksum_producer_not_rechecked_total", reason="blocks_moved") == 1
    assert sample("vllm:kv_checksum_producer_not_rechecked_total", reason="sum_failed") == 4


def test_a_send_fault_goes_to_the_workers_once(send_drill):
    """Sent again, the same flip would land again on the same bit and undo itself."""
    P, C, worker_half, log = send_drill
    preq, _ = prefill(P, prompt_of(PROMPT))
    out, _ = P.step()
    assert set(out.kv_connector_metadata.send_fault_plans) == {preq.request_id}
    out, _ = P.step()
    assert out.kv_connector_metadata.send_fault_plans == {}


def test_an_aborted_request_gets_no_send_fault(send_drill, monkeypatch):
    """A connector that holds an aborted request's blocks: no checksums were
    sent for it, so no re-check would see a fault there."""
    from vllm.v1.request import RequestStatus

    P, C, worker_half, log = send_drill
    connector = P.scheduler.connector
    monkeypatch.setattr(type(connector.sub_connectors[0]), "request_finished_all_groups",
                        lambda self, request, block_ids: (True, None))
    req = make_request(prompt_of(PROMPT), remote_decode=True, block_size=P.block_size)
    P.scheduler.add_request(req)
    out = P.scheduler.schedule()
    forward_of(P, req)(out)
    P.scheduler.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    P.update(out, P.run_workers(out))
    out, _ = P.step()
    assert not out.kv_connector_metadata.send_fault_plans
    [record] = [json.loads(line) for line in log.read_text().splitlines()]
    assert record["request_id"] == req.request_id and record["skipped"] and record["expect"] == "verified"
