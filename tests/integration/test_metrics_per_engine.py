"""With several engines (data parallel) behind one API server, vLLM's
PrometheusStatLogger counts each engine's KV checksum verdicts under that
engine's label, as it does every other per-engine counter.

The logger is vLLM's own, built for engines 0 and 1; each engine's
SchedulerStats reach it through record(..., engine_idx), as the API
server's output handler passes them.
"""

from __future__ import annotations

import prometheus_client
import pytest
from pd_harness import make_config
from vllm.v1.metrics.loggers import PrometheusStatLogger
from vllm.v1.metrics.stats import SchedulerStats

from vllm_kvchecksum.engine import metrics


def sample(name: str, **labels) -> float | None:
    return prometheus_client.REGISTRY.get_sample_value(name, labels)


@pytest.fixture
def two_engine_logger():
    config = make_config("kv_consumer", 1, 1, 16, enable=True)
    logger = PrometheusStatLogger(config, engine_indexes=[0, 1])
    yield logger, config.model_config.served_model_name
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics
    unregister_vllm_metrics()


def test_each_engines_counts_go_to_its_own_label(two_engine_logger):
    logger, model = two_engine_logger

    def record(engine_idx, counts):
        logger.record(scheduler_stats=SchedulerStats(kv_checksum_stats=counts), iteration_stats=None,
                      engine_idx=engine_idx)

    record(1, {metrics.MISMATCHED: 1, metrics.MISMATCHED_BLOCKS: 2,
               metrics.labelled(metrics.UNVERIFIED, "no_producer_checksums"): 3})
    record(0, {metrics.VERIFIED: 4})
    record(1, {metrics.VERIFIED: 5})

    def counts(engine):
        labels = {"model_name": model, "engine": engine}
        return (sample("vllm:kv_checksum_loads_verified_total", **labels),
                sample("vllm:kv_checksum_loads_mismatched_total", **labels),
                sample("vllm:kv_checksum_mismatched_blocks_total", **labels),
                sample("vllm:kv_checksum_loads_unverified_total", **labels, reason="no_producer_checksums"))

    assert counts("0") == (4, 0, 0, 0)
    assert counts("1") == (5, 1, 2, 3)
