"""vLLM's own P/D end-to-end tests, unmodified, against servers with KV checksums on.

Runs `python -m kvcs_soak.vllm_pd_tests`: a producer and a consumer started as
vLLM's run_edge_case_test.sh starts them (NixlConnector, kv_both), plus
enable_kv_checksum and fail-closed, and vLLM's toy proxy; then vLLM's
test_edge_cases.py (a prompt shorter than a block, a full prefix hit on the
consumer only, a partial one). They must pass, and every load the consumer
made must be verified.
"""

from __future__ import annotations

import json

import pytest
from demo_run import processes_left, run_demo

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm-pd")
    proc, report = run_demo([], out, timeout=1500, module="kvcs_soak.vllm_pd_tests")
    return proc, report, out


def test_vllm_pd_tests_pass_and_every_load_is_verified(run):
    proc, report, _ = run
    assert report["ok"] and proc.returncode == 0, json.dumps(report, indent=1)
    counts = report["consumer_checksums"]
    assert counts.get("loads_verified", 0) >= 1
    assert not any(k.startswith(("loads_mismatched", "loads_unverified", "loads_not_compared")) for k in counts)


def test_no_process_is_left(run):
    _, _, out = run
    assert processes_left(json.loads((out / "process_groups.json").read_text()).values()) == []
