"""The demo's store mode, short, on real servers: every store fault caught where it was made.

Runs `python -m kvcs_demo --mode store --ttft-requests 1` (what `make demo
DEMO_ARGS="--mode store"` runs, with one TTFT request each) as a
subprocess: a real mooncake_master, real vLLM OpenAI servers of the patched
tree with MooncakeStoreConnector (A stores, B loads, checksums on; A_off and
B_off without, for TTFT), faults injected through the store's own client.
Then asserts on its report-store.json, which the demo builds from B's
/metrics and log, the master's key list and both servers' outputs; and that
no process it started is left.

Marked e2e: `make test-e2e` runs it with the other end-to-end tests (it
needs the machine's cores). Alone:

    .venv/bin/python -m pytest -p no:cacheprovider -q -s -m e2e tests/e2e/test_store_demo.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from demo_run import processes_left, run_demo

pytestmark = pytest.mark.e2e

# The block positions each fault is injected at (kvcs_demo.store.FAULT_POSITIONS),
# restated: the demo's report must show these, not whatever it chose.
FAULTS = {"flip_bit": [1], "change_entry": [3], "swap_values": [0, 2], "other_prefix": [2]}
BLOCKS, BLOCK = 4, 32


@pytest.fixture(scope="module")
def store_demo(tmp_path_factory):
    if not (Path(sys.executable).parent / "mooncake_master").exists():
        pytest.skip("no mooncake_master next to the venv's python (mooncake-transfer-engine-non-cuda)")
    out = tmp_path_factory.mktemp("demo-store")
    proc, report = run_demo(["--mode", "store", "--ttft-requests", "1"], out, timeout=1200,
                            report_name="report-store.json")
    return proc, report, out


def phase(report: dict, name: str) -> dict:
    [ph] = [p for p in report["phases"] if p["phase"] == name]
    return ph


def n(metrics: dict, name: str) -> int:
    return sum(v for k, v in metrics.items() if k.split("/")[0] == name)


def test_store_demo_passes_and_leaves_no_process(store_demo):
    proc, report, _ = store_demo
    assert report["mode"] == "store"
    assert report["failures"] == [] and report["ok"], report["failures"]
    assert proc.returncode == 0
    assert [p["phase"] for p in report["phases"]] == ["clean", *FAULTS]
    groups = report["process_groups"]
    assert set(groups) == {"mooncake-master", "store-A", "store-B", "store-A_off", "store-B_off"}, groups
    left = processes_left(groups.values())
    assert not left, f"processes left behind: {left}"


def test_clean_prompt_is_loaded_from_the_store_and_verified(store_demo):
    _, report, _ = store_demo
    clean = phase(report, "clean")
    m = clean["metrics"]
    assert clean["fault"] is None and clean["verdict"] == "verified"
    assert n(m, "offloaded_loads_verified") == 1 and n(m, "offloaded_loads_mismatched") == 0, m
    assert n(m, "external_prefix_cache_hits") == BLOCKS * BLOCK, m  # every full block came from the store
    assert clean["reported"] == {} and clean["keys_removed"] == [] and clean["verified_logged"]
    assert clean["status"] == 200 and clean["output_equal"] is True
    assert len(clean["keys"]) == BLOCKS and all("@kv_checksums" in k for k in clean["keys"])


@pytest.mark.parametrize("kind", FAULTS)
def test_store_fault_is_caught_at_its_positions_removed_and_recomputed(store_demo, kind):
    _, report, _ = store_demo
    ph = phase(report, kind)
    want = FAULTS[kind]
    m = ph["metrics"]
    # Injected where the demo says, through the store, on this prompt's own keys.
    assert ph["fault"]["kind"] == kind and ph["fault"]["positions"] == want, ph["fault"]
    assert ph["fault"]["keys"] == [ph["keys"][p] for p in want]
    if kind == "other_prefix":
        assert ph["fault"]["donor_key"] == phase(report, "clean")["keys"][want[0]]
    # Caught: one mismatched load, at exactly those positions (B's log line).
    assert ph["verdict"] == "mismatch" and n(m, "offloaded_loads_mismatched") == 1, m
    assert n(m, "offloaded_mismatched_blocks") == len(want), m
    assert ph["reported"] == {"0": want}, ph["reported"]
    # Removed: B's scheduler asked for exactly those blocks, B's worker removed
    # their keys, and the master no longer lists them (the others stay).
    assert ph["removal_logged"] == want and ph["keys_removed_logged"] == len(want), ph
    assert ph["keys_removed"] == want and ph["other_keys_removed"] == 0, ph
    # Recomputed: B's output is A's.
    assert ph["status"] == 200 and ph["output_equal"] is True, ph


def test_ttft_of_store_hits_on_and_off(store_demo):
    _, report, _ = store_demo
    t = report["ttft"]
    assert t["requests_each"] == 1 and len(t["on_ms"]) == 1 and len(t["off_ms"]) == 1, t
    assert t["on_p50_ms"] > 0 and t["off_p50_ms"] > 0 and t["ratio"] == pytest.approx(
        t["on_p50_ms"] / t["off_p50_ms"]), t
    # Every request (warm-up included) was a store hit of all its full blocks,
    # and every load with checksums verified.
    assert t["store_hits"] == {"on": 2, "off": 2} and t["verified_on"] == 2 and t["mismatched_on"] == 0, t
    servers = report["servers"]
    assert "enable_kv_checksum" not in servers["B_off"]["kv_transfer_config"]
    assert servers["B"]["kv_transfer_config"]["enable_kv_checksum"] is True


def test_startup_logs_say_store_loads_are_checked(store_demo):
    _, report, _ = store_demo
    for name in ("A", "B"):
        lines = " ".join(report["servers"][name]["startup_log"])
        assert "every load from the store is checked" in lines, (name, lines)
    assert "fail-closed" in " ".join(report["servers"]["B"]["startup_log"])
    assert report["servers"]["B_off"]["startup_log"] == []
