import sys
from pathlib import Path

import pytest
from log_capture import capture_logger

# The independent NumPy reference of the definition lives with the unit tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))


@pytest.fixture
def logs(caplog):
    """The checksum logs, at debug level and up."""
    with capture_logger(caplog, "vllm.kv_checksum"):
        yield caplog


@pytest.fixture
def fault_logs(caplog):
    """The drill connector's log lines (vllm.kv_checksum.fault), debug level and up."""
    with capture_logger(caplog, "vllm.kv_checksum.fault"):
        yield caplog


@pytest.fixture
def multi(tmp_path):
    """A real MultiConnector (scheduler role): ExampleConnector, then NixlConnector."""
    from pd_harness import scheduler_connector

    return scheduler_connector(connectors=[
        {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
         "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}},
        {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
    ])
