"""MultiConnector's Prometheus metrics with a child that has none (patch 0021).

vLLM's PrometheusStatLogger hands the engine's connector stats to
KVConnectorProm.observe. Under MultiConnector they are keyed by child class;
a child that reports stats but registers no Prometheus metrics (MooncakeConnector
in v0.32) hit an assert there, in the API server's output handler, which
then shut the server down: `make soak --mode mooncake` lost its producer at
the first stats interval (its drill connector is a MultiConnector). A lone
connector without Prometheus metrics is skipped (KVConnectorProm.observe);
under MultiConnector it is skipped the same way now.
"""

from __future__ import annotations

from pd_harness import make_config
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.stats import MooncakeKVConnectorStats

MOONCAKE = {"kv_connector": "MooncakeConnector", "kv_role": "kv_both"}


def test_stats_of_a_child_without_prometheus_metrics_do_not_raise():
    config = make_config("kv_both", 1, 1, 16, connector="MultiConnector", connector_extra={"connectors": [MOONCAKE]})
    prom = KVConnectorProm(config, ["model_name", "engine"], {0: ["m", "0"]})
    stats = MooncakeKVConnectorStats()
    assert prom.prom_metrics is not None  # MultiConnector's, with no child registered
    prom.observe({"MooncakeConnector": stats.data}, 0)
