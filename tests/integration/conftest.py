import contextlib
import logging
import sys
from pathlib import Path

import pytest

# The independent NumPy reference of the definition lives with the unit tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))


@contextlib.contextmanager
def capture_logger(caplog, name: str):
    """caplog gets logger `name`'s records, debug level and up, in the block."""
    logger = logging.getLogger(name)
    logger.addHandler(caplog.handler)  # vLLM's loggers do not propagate to the root
    caplog.handler.setLevel(logging.DEBUG)
    old = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        yield caplog
    finally:
        logger.setLevel(old)
        logger.removeHandler(caplog.handler)


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
