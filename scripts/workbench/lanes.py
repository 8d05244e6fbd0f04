"""check-series in lanes: the prefixes of the series checked N at a time.

Each lane is a worktree of its own. A lane applies the patches in series
order (`git am`, cheap next to the tests) up to each prefix it was given,
then imports the modules patched so far and runs the tests that prefix's
patch names. Prefixes are spread over the lanes by what they cost on the
last run (`build/check-series-timings.json`, seconds per patch name; without
it, by the number of test files), longest first onto the least loaded lane.

A prefix that names an end-to-end test (under tests/e2e/, or marked
`pytest.mark.e2e`) runs alone, after the lanes: its real engines never share
the machine with another prefix's, as `make test` runs tests/e2e serially.

Failures mean what they meant in one lane: a patch that does not apply
fails its prefix and no later prefix is checked; every other failing prefix
is reported. Results are printed in series order with each prefix's wall
and CPU seconds (user+sys of its processes, from wait4: on a shared machine
the wall clock says little).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Callable

from .series import Patch, run
from .zygote import ForkServer

# A test module marked e2e as a whole, or a test in it: `pytestmark = ...pytest.mark.e2e...`
# or an `@pytest.mark.e2e` decorator at the start of a line.
E2E_MARK = re.compile(r"^(?:pytestmark\s*=.*|\s*@)pytest\.mark\.e2e\b", re.M)


def patched_modules(patches: list[Patch]) -> list[str]:
    """Importable vllm modules the patches touch (files they add or change)."""
    mods = set()
    for patch in patches:
        for rel in patch.touched_files():
            if rel.startswith("vllm/") and rel.endswith(".py"):
                mod = rel[:-3].replace("/", ".")
                mods.add(mod[: -len(".__init__")] if mod.endswith(".__init__") else mod)
    return sorted(mods)


@dataclass(frozen=True)
class Prefix:
    """The series up to and including `patch`, the `index`-th patch (from 1)."""
    index: int
    patch: Patch
    tests: tuple[str, ...]
    alone: bool


def runs_alone(tests: tuple[str, ...] | list[str], root: Path) -> bool:
    """Whether any of the tests is an end-to-end test: under tests/e2e/, or a file marked e2e."""
    for test in tests:
        rel = test.split("::", 1)[0]
        if Path(rel).parts[:2] == ("tests", "e2e"):
            return True
        path = root / rel
        if path.is_file() and E2E_MARK.search(path.read_text(errors="replace")):
            return True
    return False


def prefixes_of(patches: list[Patch], root: Path) -> list[Prefix]:
    out = []
    for i, patch in enumerate(patches, 1):
        tests = tuple(patch.tests())
        out.append(Prefix(i, patch, tests, runs_alone(tests, root)))
    return out


def read_timings(path: Path) -> dict[str, float]:
    """Seconds per patch name from the last run; {} when missing or unreadable.

    The file is only a hint for the plan: an entry that is not a finite,
    non-negative number is dropped, and a file that is not a JSON object is
    ignored with a note, never fatal.
    """
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        print(f"[workbench] ignoring {path}: not readable JSON ({exc}); planning by test count", flush=True)
        return {}
    if not isinstance(data, dict):
        print(f"[workbench] ignoring {path}: not a JSON object of seconds per patch; planning by test count",
              flush=True)
        return {}
    return {k: float(v) for k, v in data.items()
            if isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(v) and v >= 0}


def write_timings(path: Path, timings: dict[str, float]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({k: round(v, 1) for k, v in sorted(timings.items())}, indent=1) + "\n")
    tmp.replace(path)


def estimate_costs(prefixes: list[Prefix], timings: dict[str, float]) -> dict[int, float]:
    """Expected seconds of each prefix: its last time; else its test files times the
    median seconds per test file of the prefixes with a time (1 s without any)."""
    per_file = [timings[p.patch.name] / max(1, len(p.tests)) for p in prefixes if p.patch.name in timings]
    unit = median(per_file) if per_file else 1.0
    return {p.index: timings.get(p.patch.name, unit * max(1, len(p.tests))) for p in prefixes}


@dataclass
class Plan:
    lanes: list[list[int]]   # the prefixes each lane checks, in series order
    alone: list[int]         # checked one at a time once the lanes are done
    costs: dict[int, float]

    def lane_costs(self) -> list[float]:
        return [sum(self.costs[i] for i in lane) for lane in self.lanes]

    def expected_wall(self) -> float:
        """Seconds the plan takes on a machine with a core per lane, if each prefix costs what it did."""
        return max(self.lane_costs(), default=0.0) + sum(self.costs[i] for i in self.alone)


def plan_lanes(prefixes: list[Prefix], costs: dict[int, float], jobs: int) -> Plan:
    """Spread the prefixes that may share the machine over `jobs` lanes, longest first onto
    the least loaded lane (ties: the lower lane); the e2e ones go alone, after the lanes."""
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, not {jobs}")
    shared = [p.index for p in prefixes if not p.alone]
    lanes: list[list[int]] = [[] for _ in range(max(1, min(jobs, len(shared))))]
    loads = [0.0] * len(lanes)
    for i in sorted(shared, key=lambda i: (-costs[i], i)):
        lane = min(range(len(lanes)), key=lambda n: (loads[n], n))
        lanes[lane].append(i)
        loads[lane] += costs[i]
    return Plan([sorted(lane) for lane in lanes], [p.index for p in prefixes if p.alone], dict(costs))


@dataclass
class PrefixResult:
    index: int
    name: str
    lane: int
    summary: str = ""            # one line: pytest's last line, or what went wrong
    failure: str | None = None   # None: the prefix passed
    wall_s: float = 0.0          # import check + tests
    cpu_s: float = 0.0           # user+sys of those processes and the children they waited for
    import_wall_s: float = 0.0   # of which the import check
    import_cpu_s: float = 0.0
    apply_s: float = 0.0         # git am of the patches this lane applied to reach the prefix
    started: float = 0.0         # time.monotonic() bounds of the import check + tests
    ended: float = 0.0


@dataclass
class Outcome:
    results: list[PrefixResult]          # the prefixes that were checked
    unchecked: list[int]                 # prefixes after a patch that does not apply
    plan: Plan
    wall_s: float
    total: int
    apply_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def failures(self) -> list[PrefixResult]:
        """The failing prefixes, in series order."""
        return sorted((r for r in self.results if r.failure is not None), key=lambda r: r.index)

    @property
    def cpu_s(self) -> float:
        return sum(r.cpu_s for r in self.results)


# The exit status of a check process whose import of the patched modules failed (pytest's are 0-5).
IMPORT_FAILED = 97
_IMPORTS_LINE = "[check-series] imported the patched modules:"


def import_check_code(tree: Path, modules: list[str], pytest_args: list[str] | None = None) -> str:
    """`python -c` code: import vLLM from `tree` and every module in `modules`
    (exit IMPORT_FAILED on any error), then, given pytest_args, run pytest in
    the same process, so a prefix pays for importing torch and vLLM once."""
    code = ("import importlib, os, sys, time, traceback\n"
            "t0, c0 = time.monotonic(), time.process_time()\n"
            "try:\n"
            "    import vllm\n"
            f"    assert vllm.__file__.startswith({str(tree)!r}), vllm.__file__\n"
            f"    for m in {modules!r}:\n"
            "        importlib.import_module(m)\n"
            "except BaseException:\n"
            "    traceback.print_exc()\n"
            f"    sys.exit({IMPORT_FAILED})\n"
            f"print({_IMPORTS_LINE!r}, round(time.process_time() - c0, 1), 's CPU',"
            " round(time.monotonic() - t0, 1), 's wall', flush=True)\n")
    if pytest_args is not None:
        code += f"import pytest\nsys.exit(int(pytest.main({pytest_args!r})))\n"
    return code


def imports_seconds(output: str) -> tuple[float, float]:
    """(wall s, CPU s) the import check printed; zeros when it printed none."""
    for line in output.splitlines():
        if line.startswith(_IMPORTS_LINE):
            words = line[len(_IMPORTS_LINE):].split()
            try:
                return float(words[3]), float(words[0])
            except (IndexError, ValueError):
                break
    return 0.0, 0.0


def import_failure(name: str, output: str) -> str:
    return f"{name}: importing the patched modules failed:\n{output[-3000:]}"


def run_measured(cmd: list[str], cwd: Path, env: dict, log_path: Path) -> tuple[int, str, float, float]:
    """Run cmd with its output in log_path: (exit code, output, wall s, CPU s of it and its reaped children)."""
    start = time.monotonic()
    with open(log_path, "w") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.monotonic() - start
    return proc.returncode, log_path.read_text(errors="replace"), wall, usage.ru_utime + usage.ru_stime


class _Lane:
    """One worktree and how many patches of the series it has applied."""

    def __init__(self, number: int, tree: Path):
        self.number = number
        self.tree = tree
        self.base = run(["git", "rev-parse", "HEAD"], cwd=tree).stdout.strip()
        self.applied = 0
        self.am_output = ""   # what `git am` said when a patch did not apply
        self.server: ForkServer | None = None  # the lane's fork server (zygote.py), when it has one


class LaneRunner:
    """Checks each prefix of `patches` in lanes: worktree(n) gives lane n a worktree at the
    base, without any patch (called one lane at a time); env_for(tree) the environment its
    imports and tests run in."""

    def __init__(self, patches: list[Patch], worktree: Callable[[int], Path], env_for: Callable[[Path], dict],
                 *, root: Path, timings_path: Path, log_dir: Path, jobs: int = 2,
                 pytest_args: list[str] | None = None, python: str = sys.executable,
                 say: Callable[[str], None] = lambda m: print(f"[workbench] {m}", flush=True),
                 fork_server: bool = True):
        self.patches = patches
        self.worktree = worktree
        self.env_for = env_for
        self.root = root
        self.timings_path = timings_path
        self.log_dir = log_dir
        self.jobs = jobs
        self.pytest_args = list(pytest_args or [])
        self.python = python
        self.say = say
        self.fork_server = fork_server  # prefixes forked from a server per lane (zygote.py)
        self._lock = threading.Lock()
        self._results: dict[int, PrefixResult] = {}
        self._first_bad: int | None = None   # the first patch found not to apply

    # -- one lane ---------------------------------------------------------
    def _seek(self, lane: _Lane, index: int) -> int | None:
        """Bring the lane to patches 1..index; the number of a patch that does not apply, or None."""
        if lane.applied > index:
            run(["git", "reset", "-q", "--hard", lane.base], cwd=lane.tree)
            lane.applied = 0
        while lane.applied < index:
            patch = self.patches[lane.applied]
            result = run(["git", "-c", "gc.auto=0", "-c", "maintenance.auto=false", "am", "-q",
                          "--committer-date-is-author-date", str(patch.path.resolve())], cwd=lane.tree, check=False)
            if result.returncode != 0:
                lane.am_output = (result.stdout + result.stderr).strip()
                run(["git", "am", "--abort"], cwd=lane.tree, check=False)
                return lane.applied + 1
            lane.applied += 1
        return None

    def _skip(self, index: int) -> bool:
        with self._lock:
            return self._first_bad is not None and index > self._first_bad

    def _record(self, result: PrefixResult) -> None:
        with self._lock:
            self._results.setdefault(result.index, result)
        r = result
        self.say(f"lane {r.lane}: [{r.index}/{len(self.patches)}] {r.name}: {r.summary} "
                 f"({r.wall_s:.0f} s, CPU {r.cpu_s:.0f} s)")

    def _check(self, lane: _Lane, prefix: Prefix) -> None:
        name = prefix.patch.name
        t0 = time.monotonic()
        bad = self._seek(lane, prefix.index)
        apply_s = time.monotonic() - t0
        if bad is not None:
            with self._lock:
                if self._first_bad is None or bad < self._first_bad:
                    self._first_bad = bad
            self._record(PrefixResult(bad, self.patches[bad - 1].name, lane.number, "does not apply",
                                      f"{self.patches[bad - 1].name}: does not apply after the patches before it "
                                      f"(git am in {lane.tree}):\n{lane.am_output[-2000:]}",
                                      apply_s=apply_s))
            return
        res = PrefixResult(prefix.index, name, lane.number, apply_s=apply_s, started=time.monotonic())
        env = self.env_for(lane.tree)
        stem = f"{prefix.index:02d}-{Path(name).stem}"
        mods = patched_modules(self.patches[:prefix.index])
        if not prefix.tests:
            rc, out, wall, cpu = self._measured(lane, import_check_code(lane.tree, mods), env,
                                                self.log_dir / f"{stem}.import.log")
            res.wall_s, res.cpu_s = res.import_wall_s, res.import_cpu_s = wall, cpu
            if rc != 0:
                res.summary, res.failure = "import failed", import_failure(name, out)
            else:
                res.summary = "names no tests"
                res.failure = f"{name}: names no tests (add a 'Tests:' line to its message)"
        else:
            # One process: the import check, then pytest in it (vLLM and torch imported once).
            pytest_args = ["-q", "-p", "no:cacheprovider", *prefix.tests, *self.pytest_args]
            rc, out, wall, cpu = self._measured(lane, import_check_code(lane.tree, mods, pytest_args), env,
                                                self.log_dir / f"{stem}.log")
            res.wall_s, res.cpu_s = wall, cpu
            res.import_wall_s, res.import_cpu_s = imports_seconds(out)
            tail = out.strip().splitlines()[-1:] or [f"exit {rc}"]
            if rc == IMPORT_FAILED:
                res.summary, res.failure = "import failed", import_failure(name, out)
            else:
                res.summary = f"imported {len(mods)} modules; {' '.join(prefix.tests)}: {tail[0]}"
                if rc != 0:
                    res.failure = f"{name}: its tests failed:\n{out[-4000:]}"
        res.ended = time.monotonic()
        self._record(res)

    def _measured(self, lane: _Lane, code: str, env: dict, log_path: Path) -> tuple[int, str, float, float]:
        """`python -c code` in the project root, forked from the lane's fork server
        when it has one (torch and the libraries imported once per lane), else a
        new process: (exit status, output, wall s, CPU s)."""
        start = time.monotonic()
        ran = lane.server.run(code, self.root, log_path) if lane.server is not None else None
        if ran is None:
            return run_measured([self.python, "-c", code], self.root, env, log_path)
        return ran[0], log_path.read_text(errors="replace"), time.monotonic() - start, ran[1]

    def _run_lane(self, lane: _Lane, indices: list[int]) -> None:
        for index in indices:
            if self._skip(index):
                return
            self._check(lane, self._prefixes[index - 1])

    # -- the whole series -------------------------------------------------
    def run(self) -> Outcome:
        start = time.monotonic()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._prefixes = prefixes_of(self.patches, self.root)
        timings = read_timings(self.timings_path)
        plan = plan_lanes(self._prefixes, estimate_costs(self._prefixes, timings), self.jobs)
        known = sum(1 for p in self._prefixes if p.patch.name in timings)
        for n, lane in enumerate(plan.lanes):
            self.say(f"lane {n}: prefixes {', '.join(map(str, lane)) or '-'} "
                     f"(expected {plan.lane_costs()[n]:.0f} s)")
        if plan.alone:
            self.say(f"alone, after the lanes (end-to-end tests): prefixes {', '.join(map(str, plan.alone))}")
        self.say(f"plan: expected {plan.expected_wall():.0f} s with {len(plan.lanes)} lane(s), from "
                 + (f"{self.timings_path.name} ({known} of {len(self._prefixes)} prefixes timed)" if known
                    else "test file counts (no timings yet)"))
        lanes: list[_Lane] = []
        made = threading.Lock()

        def lane_run(n: int) -> None:
            # Worktrees are made one at a time (git worktree add/prune on one repository),
            # each in its lane's thread: lane 0 starts checking while lane 1's is made.
            with made:
                lane = _Lane(n, self.worktree(n))
                lanes.append(lane)
            if self.fork_server:
                # The lane's environment is the same for all its prefixes (its worktree's path).
                lane.server = ForkServer(self.python, self.env_for(lane.tree),
                                         self.log_dir / f"fork-server-lane-{n}.log")
            self._run_lane(lane, plan.lanes[n])

        try:
            with ThreadPoolExecutor(max_workers=len(plan.lanes)) as pool:
                list(pool.map(lane_run, range(len(plan.lanes))))
            self._run_lane(next(lane for lane in lanes if lane.number == 0), plan.alone)
        finally:
            for lane in lanes:
                if lane.server is not None:
                    lane.server.close()
        results = [self._results[i] for i in sorted(self._results)]
        unchecked = [p.index for p in self._prefixes if p.index not in self._results]
        for r in results:
            if r.summary != "does not apply":
                timings[r.name] = r.wall_s
        write_timings(self.timings_path, timings)
        outcome = Outcome(results, unchecked, plan, time.monotonic() - start, len(self.patches),
                          apply_s=sum(r.apply_s for r in results))
        write_report(self.log_dir / "report.json", outcome, self.jobs)
        return outcome


def write_report(path: Path, outcome: Outcome, jobs: int) -> None:
    """The run's figures as JSON: per prefix (series order) and in all."""
    rows = [{"index": r.index, "patch": r.name, "lane": r.lane, "passed": r.failure is None,
             "wall_s": round(r.wall_s, 1), "cpu_s": round(r.cpu_s, 1), "import_wall_s": round(r.import_wall_s, 1),
             "import_cpu_s": round(r.import_cpu_s, 1), "apply_s": round(r.apply_s, 1)}
            for r in sorted(outcome.results, key=lambda r: r.index)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "jobs": jobs, "lanes": outcome.plan.lanes, "alone": outcome.plan.alone,
        "expected_wall_s": round(outcome.plan.expected_wall(), 1), "wall_s": round(outcome.wall_s, 1),
        "cpu_s": round(outcome.cpu_s, 1), "prefix_wall_s": round(sum(r.wall_s for r in outcome.results), 1),
        "apply_s": round(outcome.apply_s, 1), "unchecked": outcome.unchecked, "prefixes": rows}, indent=1) + "\n")


def render(outcome: Outcome) -> str:
    """The results in series order, each prefix's seconds, then the totals."""
    lines = ["", f"check-series results, in series order ({len(outcome.plan.lanes)} lane(s)):"]
    for r in sorted(outcome.results, key=lambda r: r.index):
        mark = "FAILED" if r.failure is not None else "ok"
        lines.append(f"  [{r.index:>2}/{outcome.total}] {mark:<6} {r.wall_s:6.0f} s  CPU {r.cpu_s:6.0f} s  "
                     f"(import {r.import_cpu_s:.0f} s)  lane {r.lane}  {r.name}: {r.summary}")
    for i in outcome.unchecked:
        lines.append(f"  [{i:>2}/{outcome.total}] not checked (an earlier patch does not apply)")
    lines.append(f"  prefixes: wall {sum(r.wall_s for r in outcome.results):.0f} s summed, "
                 f"CPU {outcome.cpu_s:.0f} s; git am {outcome.apply_s:.0f} s; "
                 f"check-series took {outcome.wall_s:.0f} s (the plan expected {outcome.plan.expected_wall():.0f} s)")
    return "\n".join(lines)
