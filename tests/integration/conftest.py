import logging
import sys
from pathlib import Path

import pytest

# The independent NumPy reference of the definition lives with the unit tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))


@pytest.fixture
def logs(caplog):
    """The checksum logs, at debug level and up."""
    logger = logging.getLogger("vllm.kv_checksum")
    logger.addHandler(caplog.handler)  # vLLM's loggers do not propagate to the root
    caplog.handler.setLevel(logging.DEBUG)
    old = logger.level
    logger.setLevel(logging.DEBUG)
    yield caplog
    logger.setLevel(old)
    logger.removeHandler(caplog.handler)
