"""The upstream gate's verdict on baseline tests that fail: rerun alone once,
a pass then is reported as flaky, a second failure is a regression."""

from workbench.upstream import MAX_RERUNS, classify_failures

BASELINE = ["t.py::a", "t.py::b", "t.py::c", "t.py::d"]


def test_a_failure_that_passes_alone_is_flaky_and_one_that_fails_again_regressed():
    results = {"t.py::a": "passed", "t.py::b": "failed", "t.py::c": "error"}  # d did not run
    reruns = []

    def rerun(nodeid):
        reruns.append(nodeid)
        return {"t.py::b": "passed", "t.py::c": "failed", "t.py::d": "passed"}[nodeid]

    regressed, flaky = classify_failures(BASELINE, results, rerun)
    assert reruns == ["t.py::b", "t.py::c", "t.py::d"]  # only what did not pass, each once
    assert regressed == ["t.py::c"] and flaky == ["t.py::b", "t.py::d"]


def test_all_passing_reruns_nothing():
    def rerun(nodeid):
        raise AssertionError(f"{nodeid} passed: no rerun")

    assert classify_failures(BASELINE, dict.fromkeys(BASELINE, "passed"), rerun) == ([], [])


def test_many_failures_are_regressions_without_reruns():
    baseline = [f"t.py::x{i}" for i in range(MAX_RERUNS + 1)]

    def rerun(nodeid):
        raise AssertionError("no rerun past MAX_RERUNS failures")

    assert classify_failures(baseline, {}, rerun) == (baseline, [])
