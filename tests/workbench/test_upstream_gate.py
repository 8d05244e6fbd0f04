"""The upstream gate's verdict on baseline tests that fail: rerun alone once,
a pass then is reported as flaky, a second failure is a regression."""

import pytest
from workbench.upstream import MAX_RERUNS, classify_failures, outcome_stem, rerun_alone

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


def test_exactly_max_reruns_failures_are_each_rerun():
    baseline = [f"t.py::x{i}" for i in range(MAX_RERUNS)]
    reruns = []

    def rerun(nodeid):
        reruns.append(nodeid)
        return "passed"

    assert classify_failures(baseline, {}, rerun) == ([], baseline) and reruns == baseline


def test_outcome_files_of_same_named_test_files_differ():
    assert outcome_stem("tests/v1/core/test_config.py") != outcome_stem("tests/v1/kv_connector/unit/test_config.py")
    assert outcome_stem("tests/a.py::test_b[x-1]") == "tests__a.py__test_b_x-1_"


@pytest.fixture
def tiny_tree(tmp_path):
    tree = tmp_path / "tree"
    (tree / "tests").mkdir(parents=True)
    (tree / "tests" / "test_t.py").write_text("def test_ok():\n    pass\n\n\ndef test_bad():\n    assert False\n")
    out = tmp_path / "out"
    out.mkdir()
    return tree, out


def test_rerun_alone_runs_one_real_test_id_and_reports_its_outcome(tiny_tree):
    tree, out = tiny_tree
    assert rerun_alone(tree, "tests/test_t.py::test_ok", out) == "passed"
    assert rerun_alone(tree, "tests/test_t.py::test_bad", out) == "failed"
    # An id pytest cannot find records nothing: not a pass.
    assert rerun_alone(tree, "tests/test_t.py::test_gone", out) == "not run"
