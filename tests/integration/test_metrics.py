"""KV checksum counters: from the real Scheduler's verdicts to Prometheus.

The path under test is the one a server takes: KVChecksumScheduler counts,
Scheduler.make_stats puts the step's counts in SchedulerStats, vLLM's
PrometheusStatLogger adds them to the vllm:kv_checksum_* counters. The
scheduler side runs the real consumer/producer of pd_harness; the logger is
vLLM's own, reading what make_stats returned.
"""

from __future__ import annotations

import prometheus_client
import pytest
from pd_harness import forward_of, load, make_config, make_request, make_side, prefill, prompt_of
from vllm.v1.metrics.loggers import PrometheusStatLogger
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.request import RequestStatus

from vllm_kvchecksum.engine import metrics
from vllm_kvchecksum.core.verdicts import UnverifiedReason
from vllm_kvchecksum.engine.metrics import KVChecksumProm

BS = 16


def taken(side) -> dict:
    """The counts the side's SchedulerStats reported since the last call."""
    counts = dict(side.reported_metrics)
    side.reported_metrics.clear()
    return counts


def test_counts_of_each_verdict_reach_scheduler_stats():
    producer, consumer = make_side("kv_producer", block_size=BS), make_side("kv_consumer", block_size=BS)
    taken(consumer)
    preq, params = prefill(producer, prompt_of(50, seed=1))
    assert taken(producer) == {metrics.SENT: 1}
    producer.step()
    assert taken(producer) == {}, "counts are reported once"

    load(consumer, producer, preq, params)
    assert taken(consumer) == {metrics.VERIFIED: 1}

    preq, params = prefill(producer, prompt_of(50, seed=2))
    load(consumer, producer, preq, params,
         tamper=lambda req: consumer.corrupt(req.request_id, position=1) or consumer.corrupt(req.request_id,
                                                                                             position=3))
    assert taken(consumer) == {metrics.MISMATCHED: 1, metrics.MISMATCHED_BLOCKS: 2,
                               metrics.labelled(metrics.MISMATCH_CAUSES, "corrupt"): 1}

    preq, params = prefill(producer, prompt_of(50, seed=3))
    stripped = {k: v for k, v in params.items() if k != "kv_checksums"}
    load(consumer, producer, preq, stripped)
    assert taken(consumer) == {
        metrics.labelled(metrics.UNVERIFIED, UnverifiedReason.NO_PRODUCER_CHECKSUMS.value): 1}


def start_load(seed: int):
    """A consumer whose load of a producer request started (counts taken)."""
    producer, consumer = make_side("kv_producer", block_size=BS), make_side("kv_consumer", block_size=BS)
    preq, params = prefill(producer, prompt_of(40, seed=seed))
    req = make_request(preq.prompt_token_ids, params=dict(params), block_size=BS)
    consumer.scheduler.add_request(req)
    consumer.step()
    taken(consumer)
    return consumer, req


def test_gauges_follow_what_the_scheduler_holds():
    producer, consumer = make_side("kv_producer", block_size=BS), make_side("kv_consumer", block_size=BS)
    preq, params = prefill(producer, prompt_of(50, seed=2))
    req = make_request(preq.prompt_token_ids, params=dict(params), block_size=BS)
    consumer.scheduler.add_request(req)
    consumer.step()
    assert consumer.reported_gauges[metrics.LOADS_IN_FLIGHT] == 1
    consumer.write_tokens(req.request_id, 0, req.num_computed_tokens, source=producer,
                          source_id=preq.request_id)
    consumer.step(finished_recving={req.request_id})
    assert consumer.reported_gauges == {metrics.LOADS_IN_FLIGHT: 0}  # the others never moved
    # Reported when they change, not every step.
    consumer.reported_gauges.clear()
    consumer.step()
    assert consumer.reported_gauges == {}
    # A request that ends while its load is in flight takes its load with it.
    req = make_request(prompt_of(50, seed=3), params=dict(params), block_size=BS)
    consumer.scheduler.add_request(req)
    consumer.step()
    assert consumer.reported_gauges[metrics.LOADS_IN_FLIGHT] == 1
    consumer.scheduler.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    consumer.step()
    assert consumer.reported_gauges[metrics.LOADS_IN_FLIGHT] == 0
    # A producer request that decodes on after its prompt's KV was checksummed.
    req = make_request(prompt_of(50, seed=4), remote_decode=True, block_size=BS)
    req.max_tokens = req.sampling_params.max_tokens = 3
    producer.scheduler.add_request(req)
    producer.step(forward=forward_of(producer, req))
    assert producer.reported_gauges[metrics.SENDS_IN_FLIGHT] == 1
    while not req.is_finished():
        producer.step(forward=forward_of(producer, req))
    assert producer.reported_gauges[metrics.SENDS_IN_FLIGHT] == 0


def test_a_load_the_connector_failed_is_counted_not_compared():
    consumer, req = start_load(seed=4)
    consumer.step(finished_recving={req.request_id}, failed_recving={req.request_id})
    assert taken(consumer) == {metrics.labelled(metrics.NOT_COMPARED, "load_failed"): 1}
    assert consumer.scheduler.kv_checksum._recvs == {}


def test_a_request_ended_before_its_load_finished_is_counted_not_compared():
    consumer, req = start_load(seed=5)
    consumer.scheduler.finish_requests(req.request_id, type(req.status).FINISHED_ABORTED)
    consumer.step()
    assert taken(consumer) == {metrics.labelled(metrics.NOT_COMPARED, "request_ended"): 1}


def sample(name: str, **labels) -> float | None:
    return prometheus_client.REGISTRY.get_sample_value(name, labels)


@pytest.fixture
def prom_logger():
    config = make_config("kv_consumer", 1, 1, BS, enable=True)
    logger = PrometheusStatLogger(config)
    yield logger, config.model_config.served_model_name
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics
    unregister_vllm_metrics()


def test_vllm_prometheus_logger_exports_the_counts(prom_logger):
    logger, model = prom_logger
    labels = {"model_name": model, "engine": "0"}
    assert sample("vllm:kv_checksum_loads_verified_total", **labels) == 0
    # Labelled counters show every known reason at 0 from the start.
    assert sample("vllm:kv_checksum_loads_unverified_total", **labels, reason="missing_workers") == 0

    def record(counts):
        logger.record(scheduler_stats=SchedulerStats(kv_checksum_stats=counts), iteration_stats=None)

    record({metrics.VERIFIED: 2, metrics.SENT: 1})
    record({metrics.VERIFIED: 1, metrics.MISMATCHED: 1, metrics.MISMATCHED_BLOCKS: 3,
            metrics.labelled(metrics.UNVERIFIED, "no_producer_checksums"): 1,
            metrics.labelled(metrics.NOT_COMPARED, "load_failed"): 1,
            metrics.labelled(metrics.NOT_SENT, "not_carried"): 2,
            # From a newer scheduler, or forged: ignored, never a new label value.
            "loads_unverified/not_a_reason": 5, "no_such_counter": 1})
    record(None)
    assert sample("vllm:kv_checksum_loads_verified_total", **labels) == 3
    assert sample("vllm:kv_checksum_loads_mismatched_total", **labels) == 1
    assert sample("vllm:kv_checksum_mismatched_blocks_total", **labels) == 3
    assert sample("vllm:kv_checksum_sent_total", **labels) == 1
    assert sample("vllm:kv_checksum_not_sent_total", **labels, reason="not_carried") == 2
    assert sample("vllm:kv_checksum_loads_unverified_total", **labels, reason="no_producer_checksums") == 1
    assert sample("vllm:kv_checksum_loads_unverified_total", **labels, reason="not_a_reason") is None
    assert sample("vllm:kv_checksum_loads_not_compared_total", **labels, reason="load_failed") == 1
    # Gauges hold the last value reported, and a later update without them keeps it.
    assert sample("vllm:kv_checksum_loads_in_flight", **labels) == 0
    record({metrics.LOADS_IN_FLIGHT: 4, metrics.HELD_BLOCKS: 2, metrics.SENDS_IN_FLIGHT: 1})
    record({metrics.LOADS_IN_FLIGHT: 1, metrics.VERIFIED: 1})
    record({metrics.VERIFIED: 1})
    assert sample("vllm:kv_checksum_loads_in_flight", **labels) == 1
    assert sample("vllm:kv_checksum_held_blocks", **labels) == 2
    assert sample("vllm:kv_checksum_sends_in_flight", **labels) == 1
    record({metrics.LOADS_IN_FLIGHT: 0, metrics.HELD_BLOCKS: 0, metrics.SENDS_IN_FLIGHT: 0})
    assert sample("vllm:kv_checksum_loads_in_flight", **labels) == 0
    assert sample("vllm:kv_checksum_held_blocks", **labels) == 0


def test_rollback_counters_reach_prometheus(prom_logger):
    logger, model = prom_logger
    labels = {"model_name": model, "engine": "0"}
    for scope in ("from_first_bad_block", "whole_prompt"):
        assert sample("vllm:kv_checksum_loads_recomputed_total", **labels, rollback=scope) == 0
    logger.record(scheduler_stats=SchedulerStats(kv_checksum_stats={
        "loads_recomputed/whole_prompt": 1, "loads_recomputed/from_first_bad_block": 2, "recomputed_tokens": 90}),
        iteration_stats=None)
    assert sample("vllm:kv_checksum_loads_recomputed_total", **labels, rollback="whole_prompt") == 1
    assert sample("vllm:kv_checksum_loads_recomputed_total", **labels, rollback="from_first_bad_block") == 2
    assert sample("vllm:kv_checksum_recomputed_tokens_total", **labels) == 90


def test_no_counters_when_checksums_are_off():
    config = make_config("kv_consumer", 1, 1, BS, enable=False)
    PrometheusStatLogger(config)
    try:
        names = {m.name for m in prometheus_client.REGISTRY.collect()}
        assert not any(n.startswith("vllm:kv_checksum") for n in names)
        assert "vllm:num_requests_running" in names
    finally:
        from vllm.v1.metrics.prometheus import unregister_vllm_metrics
        unregister_vllm_metrics()


def test_prom_observe_ignores_nonpositive_and_disabled():
    class Counter:
        made = []

        def __init__(self, **kw):
            self.kw, self.children = kw, {}
            Counter.made.append(self)

        def labels(self, *values):
            return self.children.setdefault(values, _Child())

    class _Child:
        value = 0

        def inc(self, n):
            self.value += n

    off = KVChecksumProm(False, ["model_name", "engine"], {0: ["m", "0"]}, Counter)
    off.observe({metrics.VERIFIED: 1})
    assert not Counter.made and not off.enabled
    on = KVChecksumProm(True, ["model_name", "engine"], {0: ["m", "0"]}, Counter)
    on.observe({metrics.VERIFIED: 0, metrics.MISMATCHED: -3})
    verified = next(c for c in Counter.made if c.kw["name"] == "vllm:kv_checksum_loads_verified")
    assert verified.children[("m", "0")].value == 0
