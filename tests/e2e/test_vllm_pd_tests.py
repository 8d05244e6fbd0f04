"""vLLM's own P/D end-to-end tests, unmodified, against servers with KV checksums on.

Runs `python -m kvcs_soak.vllm_pd_tests --suite S`: a producer and a consumer
started as vLLM's run script for S starts them (NixlConnector, kv_both),
plus enable_kv_checksum and fail-closed, and vLLM's toy proxy; then the
suite's test file. edge-cases: test_edge_cases.py (a prompt shorter than a
block, a full prefix hit on the consumer only, a partial one), tiny Llama.
mamba-prefix-cache: test_mamba_prefix_cache.py (a hybrid's second load of
the same long prompt transfers less, from a consumer prefix hit), tiny
granite-4.0-h style Mamba2 hybrid. They must pass, and every load the
consumer made must be verified.
"""

from __future__ import annotations

import json

import pytest
from demo_run import processes_left, run_demo

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module", params=["edge-cases", "mamba-prefix-cache"])
def run(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"vllm-pd-{request.param}")
    proc, report = run_demo(["--suite", request.param], out, timeout=1500, module="kvcs_soak.vllm_pd_tests")
    assert report["suite"] == request.param
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
