"""The CI-sized soak on real servers: load, pressure and the lease race, judged by ground truth.

Runs `python -m kvcs_soak --ci` (what `make soak` runs, smaller): a real NIXL
pull pair of the tiny Llama under 32 requests in flight, KV caches small
enough to preempt, a 2 s KV lease with consumer stalls past it (the
read-after-reuse race), clients hanging up at random and mid-transfer. The
soak itself checks every line (docs/soak.md); this test asserts on its
report, and that no process it started is left.
"""

from __future__ import annotations

import json

import pytest
from demo_run import processes_left, run_demo

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def soak(tmp_path_factory):
    out = tmp_path_factory.mktemp("soak")
    proc, report = run_demo(["--ci"], out, timeout=1500, module="kvcs_soak")
    return proc, report, out


def test_every_check_of_the_soak_passes(soak):
    proc, report, _ = soak
    assert report["ok"] and proc.returncode == 0, json.dumps(report["failures"], indent=1)


def test_every_victim_is_a_mismatch_and_no_clean_load_is(soak):
    _, report, _ = soak
    det = report["detection"]
    # A victim whose client hung up and whose own drill line says its request
    # ended before its load was judged is excused (nobody used that KV): how
    # many there are depends on timing, and a loaded machine makes one now
    # and then. Never more than the consumer counted not_compared{request_ended}.
    excused = det["victims_ended_unjudged"]
    assert det["victims_missed"] == [] and det["victims_caught"] + len(excused) == det["victim"]
    ended = det["loads_ended_unjudged"]
    assert len(excused) <= ended["witnessed"] <= ended["counted"], ended
    # The race was made: a consumer read KV its producer had released. Whether
    # the producer reused those blocks before the read (a victim) is timing;
    # every victim is among these reads (the soak checks that in pull mode).
    assert report["producer_read_after_release"]["reads"] > 0, report["producer_read_after_release"]
    # How many clean loads a lease expiry turns into victims depends on the
    # machine's speed (a slow consumer's queue outlasts the lease in the
    # waves too); loads judged against the ground truth do not.
    assert det["false_alarms"] == [] and det["clean"] > 0, det
    assert det["clean"] + det["victim"] >= report["settings"]["min_judged"] >= 150, det


def test_counters_reconcile_and_the_caches_were_under_pressure(soak):
    _, report, _ = soak
    assert report["consumer"]["difference"] == 0 and report["producer"]["difference"] == 0
    assert report["preemptions"]["consumer"] + report["preemptions"]["producer"] > 0
    assert all(report["engines_alive"].values())


def test_no_process_is_left(soak):
    _, _, out = soak
    groups = json.loads((out / "process_groups.json").read_text()).values()
    assert processes_left(groups) == []


def test_nothing_is_held_after_the_traffic_and_the_run_is_pictured(soak):
    _, report, out = soak
    held = report["held_after_traffic"]
    assert set(held) == {"producer", "consumer"}
    assert all(v == 0 for gauges in held.values() for v in gauges.values()), held
    # The sampler saw the run (its gauges every 2 s; whether one catches a
    # load in flight depends on the machine's speed, so that is not asserted).
    timeline = [row for row in report["timeline"] if row.get("consumer")]
    assert len(timeline) >= 2
    assert timeline[-1]["consumer"]["loads_verified"] > timeline[0]["consumer"]["loads_verified"]
    assert all(row["consumer"]["rss_mb"] > 0 for row in timeline)
    for name in ("soak-verdicts.png", "soak-held.png", "soak-latency.png"):
        assert (out / name).stat().st_size > 1000


def test_the_producer_rechecked_every_send_and_found_none_changed(soak):
    """The soak changes no producer KV: every transfer's re-check at its
    completion (lease expiries included) must find the KV as sent."""
    _, report, _ = soak
    rechecks = report["producer_rechecks"]
    assert rechecks.get("changed", 0) == 0
    assert sum(rechecks.values()) == report["producer"]["sent"] > 0
    # Re-checks that could not compare (not_rechecked) judge nothing: most
    # must have found the KV as sent.
    assert rechecks.get("intact", 0) * 2 > report["producer"]["sent"], rechecks
