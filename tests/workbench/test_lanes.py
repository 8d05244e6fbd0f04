"""check-series in lanes: the plan on the real series, and the runner on a tiny series of its own."""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import pytest

from series_building import commit_series
from workbench import lanes as L
from workbench import series as S
from workbench.tree import PATCHES, ROOT


@pytest.fixture(scope="module")
def real_prefixes() -> list[L.Prefix]:
    return L.prefixes_of(S.read_series(PATCHES), ROOT)


def test_the_e2e_prefix_of_the_series_runs_alone_and_no_other(real_prefixes):
    alone = [p.patch.name for p in real_prefixes if p.alone]
    assert alone == [p.patch.name for p in real_prefixes if any(t.startswith("tests/e2e/") for t in p.tests)]
    assert any(name.startswith("0016-") for name in alone)


@pytest.mark.parametrize("text, alone", [
    ("import pytest\npytestmark = pytest.mark.e2e\n", True),
    ("import pytest\npytestmark = [pytest.mark.slow, pytest.mark.e2e]\n", True),
    ("import pytest\n\n\n@pytest.mark.e2e\ndef test_x():\n    pass\n", True),
    ("import pytest\n\n\nclass TestX:\n    @pytest.mark.e2e\n    def test_x(self):\n        pass\n", True),
    ("import pytest\n\n\ndef test_x():\n    pass\n", False),
    ('SOURCE = "import pytest\\npytestmark = pytest.mark.e2e\\n"\n', False),  # only in a string
])
def test_a_test_file_marked_e2e_runs_alone_wherever_it_is(tmp_path, text, alone):
    (tmp_path / "tests" / "integration").mkdir(parents=True)
    (tmp_path / "tests" / "integration" / "test_x.py").write_text(text)
    assert L.runs_alone(("tests/integration/test_x.py",), tmp_path) is alone
    assert L.runs_alone(("tests/integration/test_x.py::test_x",), tmp_path) is alone
    assert L.runs_alone(("tests/e2e/test_y.py",), tmp_path)  # by its place alone, even missing


@pytest.mark.parametrize("jobs", [1, 2, 3])
def test_every_prefix_is_planned_once_the_lanes_in_series_order(real_prefixes, jobs):
    costs = L.estimate_costs(real_prefixes, {})
    plan = L.plan_lanes(real_prefixes, costs, jobs)
    assert len(plan.lanes) == jobs
    planned = [i for lane in plan.lanes for i in lane] + plan.alone
    assert sorted(planned) == [p.index for p in real_prefixes]
    assert all(lane == sorted(lane) for lane in plan.lanes)
    assert not set(plan.alone) & {i for lane in plan.lanes for i in lane}
    assert set(plan.alone) == {p.index for p in real_prefixes if p.alone}


def test_without_timings_the_cost_is_the_number_of_test_files(real_prefixes):
    costs = L.estimate_costs(real_prefixes, {})
    assert costs == {p.index: max(1, len(p.tests)) for p in real_prefixes}
    assert costs[6] == 5  # 0006 names five test files


def test_lanes_balance_by_last_run_seconds(real_prefixes):
    # Seconds from a last run for every prefix but two: those get the median per test file.
    timings = {p.patch.name: 10.0 * p.index for p in real_prefixes[2:]}
    costs = L.estimate_costs(real_prefixes, timings)
    assert costs[27] == 270.0
    per_file = sorted(timings[p.patch.name] / len(p.tests) for p in real_prefixes[2:])
    mid = len(per_file) // 2
    unit = per_file[mid] if len(per_file) % 2 else (per_file[mid - 1] + per_file[mid]) / 2
    assert costs[1] == unit * len(real_prefixes[0].tests)
    plan = L.plan_lanes(real_prefixes, costs, 2)
    loads = plan.lane_costs()
    # Longest first onto the least loaded lane: the lanes end within one prefix of each other.
    assert max(loads) - min(loads) <= max(costs.values())
    assert plan.expected_wall() == max(loads) + sum(costs[i] for i in plan.alone)
    assert plan.expected_wall() < sum(costs.values())


def test_longest_first_onto_the_least_loaded_lane():
    patches = [S.Patch(f"{i:04d}-p.patch", Path(f"{i:04d}-p.patch")) for i in range(1, 6)]
    prefixes = [L.Prefix(i, p, ("tests/t.py",), False) for i, p in enumerate(patches, 1)]
    plan = L.plan_lanes(prefixes, {1: 9.0, 2: 5.0, 3: 4.0, 4: 3.0, 5: 1.0}, 2)
    # 9 -> lane 0; 5 -> lane 1; 4 -> lane 1 (5 < 9); 3 -> lane 0 (9 = 9: the lower lane); 1 -> lane 1.
    assert plan.lanes == [[1, 4], [2, 3, 5]]
    assert plan.lane_costs() == [12.0, 10.0]
    assert plan.expected_wall() == 12.0


def test_jobs_below_one_is_refused(real_prefixes):
    with pytest.raises(ValueError, match="at least 1"):
        L.plan_lanes(real_prefixes, L.estimate_costs(real_prefixes, {}), 0)


@pytest.mark.parametrize("text", ["not json", "[1, 2]", '"x"', "", "\udcff"])
def test_an_unreadable_timings_file_plans_by_test_count(tmp_path, text):
    path = tmp_path / "t.json"
    path.write_text(text, errors="surrogateescape")
    assert L.read_timings(path) == {}


def test_timings_keep_only_finite_non_negative_numbers(tmp_path):
    path = tmp_path / "t.json"
    path.write_text('{"a": 1.5, "b": -1, "c": "7", "d": NaN, "e": Infinity, "f": true, "g": null, "h": 3}')
    assert L.read_timings(path) == {"a": 1.5, "h": 3.0}
    assert L.read_timings(tmp_path / "missing.json") == {}


def test_results_are_shown_in_series_order_with_their_seconds():
    plan = L.Plan([[1, 3], [2]], [], {1: 1.0, 2: 1.0, 3: 1.0})
    results = [L.PrefixResult(3, "0003-c.patch", 0, "1 failed", "0003-c.patch: its tests failed", wall_s=30, cpu_s=25),
               L.PrefixResult(1, "0001-a.patch", 0, "1 passed", None, wall_s=10, cpu_s=8),
               L.PrefixResult(2, "0002-b.patch", 1, "1 failed", "0002-b.patch: its tests failed", wall_s=20, cpu_s=2)]
    outcome = L.Outcome(results, [4], plan, 42.0, 4)
    text = L.render(outcome)
    order = [line.split("]")[0].strip() for line in text.splitlines() if line.strip().startswith("[")]
    assert order == ["[ 1/4", "[ 2/4", "[ 3/4", "[ 4/4"]
    assert "0002-b.patch" in text.splitlines()[3] and "FAILED" in text.splitlines()[3]
    assert "20 s" in text.splitlines()[3] and "CPU      2 s" in text.splitlines()[3]
    assert [r.index for r in outcome.failures] == [2, 3]
    assert outcome.cpu_s == 35


# -- the runner on a tiny series -----------------------------------------------

TEST_OF = {
    # Each test checks the tree is exactly its prefix: what later patches add is absent.
    "tests/test_a.py": "import vllm.a\n\ndef test_a():\n    assert not _has('b')\n",
    "tests/test_b.py": "import vllm.b\n\ndef test_b():\n    assert vllm.b.Y == 3, 'patch 2 says 2'\n",
    "tests/e2e/test_alone.py": "import vllm.a\n\ndef test_alone():\n    assert vllm.a.X == 10 and not _has('c')\n",
    "tests/test_c.py": "def test_c():\n    assert _has('c') and not _has('d')\n",
}
HAS = "import os, vllm\n\ndef _has(m):\n    return os.path.exists(os.path.join(os.path.dirname(vllm.__file__), m + '.py'))\n\n"


def _series(tmp_path: Path, edits: list[tuple[str, dict[str, str], list[str]]]):
    """A base git repo, its patches (one per edit: subject, files, Tests:) and a project root."""
    base = tmp_path / "base"
    (base / "vllm").mkdir(parents=True)
    (base / "vllm" / "__init__.py").write_text("")
    S.init_base_repo(base)
    patches_dir = tmp_path / "patches"
    commit_series(base, [(subject + ("\n\nTests: " + " ".join(tests) if tests else ""), files)
                         for subject, files, tests in edits], patches_dir)
    root = tmp_path / "proj"
    for rel, text in TEST_OF.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(HAS + text)
    (root / "tests" / "e2e" / "test_alone.py").write_text(
        "import pytest\npytestmark = pytest.mark.e2e\n" + (root / "tests" / "e2e" / "test_alone.py").read_text())
    return base, patches_dir, root


def _runner(tmp_path, base, patches_dir, root, jobs, overlaps=None):
    inside, second = [], threading.Event()

    def worktree(n: int) -> Path:
        # `git worktree add` and `prune` on one repository must not race: the runner makes
        # worktrees one at a time. The first call waits a moment for a second to come in.
        inside.append(n)
        if len(inside) > 1:
            second.set()
            if overlaps is not None:
                overlaps.append(tuple(inside))
        else:
            second.wait(1)
        path = tmp_path / f"lane-{n}"
        S.run(["git", "worktree", "add", "-q", "--detach", str(path), S.BASE_TAG], cwd=base)
        inside.remove(n)
        return path

    def env_for(tree: Path) -> dict:
        return dict(os.environ, PYTHONPATH=str(tree))

    return L.LaneRunner(S.read_series(patches_dir), worktree, env_for, root=root, jobs=jobs,
                        timings_path=tmp_path / "timings.json", log_dir=tmp_path / "logs",
                        python=sys.executable, say=lambda m: None)


EDITS = [
    ("Add a", {"vllm/a.py": "X = 1\n"}, ["tests/test_a.py"]),
    ("Add b", {"vllm/b.py": "Y = 2\n"}, ["tests/test_b.py"]),              # its test fails
    ("Change a", {"vllm/a.py": "X = 10\n"}, ["tests/e2e/test_alone.py"]),  # e2e: alone
    ("Add c", {"vllm/c.py": "Z = 3\n"}, ["tests/test_c.py"]),
    ("Add e", {"vllm/e.py": "W = 5\n"}, []),                                # names no tests
    ("Add d", {"vllm/d.py": "raise RuntimeError('d is broken')\n"}, ["tests/test_c.py"]),  # import fails
]


def test_lanes_check_each_prefix_on_its_own_tree_and_report_in_order(tmp_path):
    base, patches_dir, root = _series(tmp_path, EDITS)
    overlaps = []
    outcome = _runner(tmp_path, base, patches_dir, root, jobs=2, overlaps=overlaps).run()
    assert overlaps == []  # the worktrees were made one at a time
    assert outcome.plan.alone == [3] and len(outcome.plan.lanes) == 2
    by_index = {r.index: r for r in outcome.results}
    assert sorted(by_index) == [1, 2, 3, 4, 5, 6] and outcome.unchecked == []
    assert [r.index for r in outcome.failures] == [2, 5, 6]
    assert "its tests failed" in by_index[2].failure and "patch 2 says 2" in by_index[2].failure
    assert "names no tests" in by_index[5].failure
    assert "importing the patched modules failed" in by_index[6].failure and "d is broken" in by_index[6].failure
    # 1, 3 (after a reset of a lane that was further on) and 4 saw exactly their prefix.
    assert by_index[1].failure is by_index[3].failure is by_index[4].failure is None
    assert {by_index[i].lane for i in (1, 2, 4, 5, 6)} == {0, 1}
    # The e2e prefix had the machine to itself.
    alone = by_index[3]
    assert all(r.ended <= alone.started or r.started >= alone.ended for r in outcome.results if r.index != 3)
    assert all(r.wall_s > 0 and r.cpu_s > 0 for r in outcome.results)
    # A prefix with tests is one process: the import check, then pytest in it.
    logs = tmp_path / "logs"
    first = (logs / f"01-{Path(by_index[1].name).stem}.log").read_text()
    assert first.index(L._IMPORTS_LINE) < first.index("1 passed")
    assert not list(logs.glob("01-*.import.log")) and list(logs.glob("05-*.import.log"))
    assert "1 passed" not in (logs / f"06-{Path(by_index[6].name).stem}.log").read_text()
    # Its seconds are the next run's plan.
    timings = json.loads((tmp_path / "timings.json").read_text())
    assert sorted(timings) == sorted(r.name for r in outcome.results)
    lines = [ln for ln in L.render(outcome).splitlines() if ln.strip().startswith("[")]
    assert [ln.split("]")[0].strip() for ln in lines] == [f"[ {i}/6" for i in range(1, 7)]


def test_the_import_check_says_its_seconds_and_a_missing_line_reads_as_none():
    out = f"noise\n{L._IMPORTS_LINE} 12.5 s CPU 20.25 s wall\n3 passed in 9s\n"
    assert L.imports_seconds(out) == (20.25, 12.5)
    assert L.imports_seconds("3 passed\n") == (0.0, 0.0)
    assert L.imports_seconds(f"{L._IMPORTS_LINE} garbled\n") == (0.0, 0.0)


def test_a_patch_that_does_not_apply_fails_and_nothing_after_it_is_checked(tmp_path):
    edits = [EDITS[0], ("Change a", {"vllm/a.py": "X = 2\n"}, ["tests/test_a.py"]),
             EDITS[3], ("Add d", {"vllm/d.py": "V = 4\n"}, ["tests/test_a.py"])]
    base, patches_dir, root = _series(tmp_path, edits)
    # Patch 2 now changes a line the tree does not have.
    second = S.read_series(patches_dir)[1].path
    second.write_text(second.read_text().replace("-X = 1\n", "-X = 7\n", 1))
    outcome = _runner(tmp_path, base, patches_dir, root, jobs=2).run()
    assert [r.index for r in outcome.results] == [1, 2]
    assert outcome.results[0].failure is None
    failure = outcome.results[1].failure
    assert failure.startswith(outcome.results[1].name + ": does not apply after the patches before it")
    assert "vllm/a.py" in failure  # git am's own words name the file
    assert outcome.unchecked == [3, 4]
    assert "not checked" in L.render(outcome).splitlines()[-2]
