"""A bad block on real servers: recomputed from it, and never reused.

Runs `python -m kvcs_demo.rollback`: one producer and two consumers (the tiny
Llama, NIXL pull over UCX on loopback), the drill connector flipping a bit in
block 5 of 9 when switched on. Fail-closed with kv_load_failure_policy
"recompute", the mismatched load is recomputed from block 5 (101 of the
load's 261 tokens, where vLLM alone would recompute all 261) and gives the
clean load's output. Fail-open, the mismatched load is used by its own
request, and a later request with the same prompt hits blocks 0-4 only.
"""

from __future__ import annotations

import json

import pytest
from demo_run import processes_left, run_demo

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("rollback")
    proc, report = run_demo([], out, timeout=1500, module="kvcs_demo.rollback")
    return proc, report, out


def test_recompute_starts_at_the_first_bad_block(run):
    proc, report, _ = run
    assert report["failures"] == [] and proc.returncode == 0, json.dumps(report, indent=1)
    r = report["recompute"]
    assert r["flipped"]["checksums"]["loads_mismatched"] == 1
    assert r["recomputed_tokens"] == report["prompt_tokens"] - report["position"] * report["block_size"]
    assert r["recomputed_tokens"] < r["whole_prompt_tokens"]
    assert r["flipped"]["text"] == r["reference"] is not None


def test_fail_open_never_lets_another_request_hit_the_bad_block(run):
    _, report, _ = run
    o = report["open"]
    kept = report["position"] * report["block_size"]
    assert o["flipped"]["status"] == 200 and o["flipped"]["checksums"]["loads_mismatched"] == 1
    assert o["local_after_clean"]["vllm"]["prefix_cache_hits"] > kept
    assert o["local_after_flip"]["vllm"]["prefix_cache_hits"] == kept
    assert o["local_after_flip"]["text"] == o["reference"] is not None


def test_no_process_is_left(run):
    _, _, out = run
    assert processes_left(json.loads((out / "process_groups.json").read_text()).values()) == []
