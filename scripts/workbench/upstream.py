"""The upstream regression gate: vLLM's own tests of what the series touches.

`tests/upstream/gate-files.txt` lists the upstream test files. The baseline,
`tests/upstream/baseline.txt`, holds the ids of the tests that passed on the
unpatched v0.32.0 base on this CPU setup (recorded with `--record` on a
pristine tree). The gate runs the files on the patched tree and fails on any
baseline test that does not pass now, naming it.

Each vLLM release the series is kept for is a base (BASES): v0.32.0, the
default, with its files in tests/upstream/ and .venv's Python; v0.34.0 with
its files in tests/upstream/v0.34.0/, build/venv-0.34.0's Python (`make
setup-0.34`) and the triton_switch plugin (`--base 0.34.0`).
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .series import SeriesError
from .tree import BUILD, ROOT, TREE, download_sdist, log, unpack_sdist
from .zygote import ForkServer

UPSTREAM = ROOT / "tests" / "upstream"
GATE_FILES = UPSTREAM / "gate-files.txt"
BASELINE = UPSTREAM / "baseline.txt"
HF_CONFIGS = UPSTREAM / "hf-configs"
HF_HOME = BUILD / "hf-home"
# Test ids the recorder leaves out of the baseline (flaky here), one a line, `#` comments.
FLAKY = UPSTREAM / "flaky.txt"
# Start-up hook of the test processes (sitecustomize.py), on their PYTHONPATH only.
SITE_HOOKS = UPSTREAM / "site"
# Packages only the gate's test processes see (pip --target, on their PYTHONPATH).
# torchvision: vLLM imports it through transformers' image processors (llava,
# pixtral); `make setup` uninstalls it from the venv (it breaks `import
# torchvision` beside torch+cpu), and site/sitecustomize.py makes it importable.
GATE_SITE = BUILD / "upstream-site"
GATE_ONLY_PACKAGES = ("torchvision==0.28.0",)
# One test may not hold the gate hostage (a hang waiting on a peer, say).
TEST_TIMEOUT_S = 600


@dataclass(frozen=True)
class Base:
    """One vLLM release the gate runs against: where its lists are and what
    else its test processes get; its Python, pytest plugins and set-up
    command are the series base's (bases.py)."""

    version: str
    dir: Path  # gate-files.txt, baseline.txt, flaky.txt
    out: Path  # build/upstream*/{base,patched}: logs, outcomes, timings
    # Folders put after the tree and scripts/workbench on the test processes' PYTHONPATH.
    extra_path: tuple[Path, ...] = ()

    @property
    def _series_base(self):
        from .bases import get_base as get_series_base

        return get_series_base(self.version)

    @property
    def python(self) -> Path:
        """The interpreter of the test processes."""
        return self._series_base.test_python

    @property
    def plugins(self) -> tuple[str, ...]:
        """pytest -p plugins (modules in scripts/workbench)."""
        return self._series_base.pytest_plugins

    @property
    def setup_hint(self) -> str:
        """What makes `python` exist."""
        return self._series_base.setup

    @property
    def gate_files_path(self) -> Path:
        return self.dir / "gate-files.txt"

    @property
    def baseline_path(self) -> Path:
        return self.dir / "baseline.txt"

    @property
    def flaky_path(self) -> Path:
        return self.dir / "flaky.txt"


DEFAULT_BASE = "0.32.0"
BASES = {
    # Today's gate, unchanged: .venv runs it (the Python running the workbench).
    "0.32.0": Base("0.32.0", UPSTREAM, BUILD / "upstream", extra_path=(SITE_HOOKS, GATE_SITE)),
    # vLLM 0.34.0: build/venv-0.34.0 (torchvision that loads beside its torch:
    # no site hook, no gate-only packages) and the Triton switch.
    "0.34.0": Base("0.34.0", UPSTREAM / "v0.34.0", BUILD / "upstream-0.34.0"),
}


def get_base(version: str | None) -> Base:
    version = version or DEFAULT_BASE
    if version not in BASES:
        raise SeriesError(f"no upstream gate for vLLM {version!r}: the bases are {', '.join(BASES)}")
    return BASES[version]


def read_list(path: Path) -> list[str]:
    """The entries of a gate list: one a line, `#` comments and blank lines dropped."""
    return [ln.split("#", 1)[0].strip() for ln in path.read_text().splitlines() if ln.split("#", 1)[0].strip()]


def gate_files(base: Base | None = None) -> list[str]:
    return read_list((base or get_base(None)).gate_files_path)


def write_hf_cache() -> Path:
    """Config-only Hugging Face cache entries, so upstream tests resolve models offline.

    Each folder `hf-configs/ORG__NAME/` holds the public config files of one
    model (no weights); it becomes `hub/models--ORG--NAME/snapshots/<rev>/`.
    """
    hub = HF_HOME / "hub"
    rev = "0" * 40
    for model in sorted(p for p in HF_CONFIGS.iterdir() if p.is_dir()) if HF_CONFIGS.exists() else []:
        org, _, name = model.name.partition("__")
        repo = hub / f"models--{org}--{name}"
        snap = repo / "snapshots" / rev
        snap.mkdir(parents=True, exist_ok=True)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(rev)
        for f in model.iterdir():
            if f.is_file() and (not (snap / f.name).exists() or (snap / f.name).read_bytes() != f.read_bytes()):
                (snap / f.name).write_bytes(f.read_bytes())
    return HF_HOME


def flaky_ids(base: Base | None = None) -> set[str]:
    path = (base or get_base(None)).flaky_path
    return set(read_list(path)) if path.exists() else set()


def install_gate_site() -> Path:
    """pip-install GATE_ONLY_PACKAGES (no deps) into GATE_SITE, unless already there."""
    stamp = GATE_SITE / ".kvcs-packages"
    wanted = "\n".join(GATE_ONLY_PACKAGES) + "\n"
    if stamp.exists() and stamp.read_text() == wanted:
        return GATE_SITE
    if GATE_SITE.exists():
        import shutil

        shutil.rmtree(GATE_SITE)
    log(f"installing {', '.join(GATE_ONLY_PACKAGES)} for the gate's test processes into "
        f"{GATE_SITE.relative_to(ROOT)}")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(GATE_SITE),
                    *GATE_ONLY_PACKAGES], check=True)
    stamp.write_text(wanted)
    return GATE_SITE


def gate_env(tree: Path, base: Base | None = None) -> dict:
    base = base or get_base(None)
    env = dict(os.environ)
    env.update({
        "HF_HOME": str(HF_HOME), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(tree), str(Path(__file__).parent), *map(str, base.extra_path)]),
        "VLLM_TARGET_DEVICE": "cpu", "TOKENIZERS_PARALLELISM": "false",
        # Each file gets one core; torch must not oversubscribe the two here.
        "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
    })
    return env


def outcome_stem(rel: str) -> str:
    """The name of a file's (or test id's) outcomes and log in the out folder:
    its whole path, so test_config.py of two folders never share one."""
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in rel.replace("/", "__"))


def rerun_alone(tree: Path, nodeid: str, out_dir: Path, base: Base | None = None) -> str:
    """Run one test id by itself on `tree`: its outcome, "not run" when pytest
    recorded none for it (a collection error, an id that no longer exists)."""
    _, results, elapsed, tail = run_file(tree, nodeid, out_dir, base)
    outcome = results.get(nodeid, "not run")
    log(f"  rerun alone: {nodeid}: {outcome} ({elapsed:.0f} s) | {tail}")
    return outcome


def pytest_command(rel: str, base: Base | None = None) -> list[str]:
    """The command line of one test process: the base's Python, its plugins.
    `gc_freeze` keeps vLLM's per-test cleanup from re-walking every import
    (gc_freeze.py); baseline and gate runs both load it."""
    base = base or get_base(None)
    plugins = [a for p in base.plugins for a in ("-p", p)]
    return [str(base.python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "outcomes_plugin",
            "-p", "gc_freeze", *plugins,
            "-p", "no:randomly", f"--timeout={TEST_TIMEOUT_S}", rel]


def run_file(tree: Path, rel: str, out_dir: Path, base: Base | None = None,
             server: ForkServer | None = None) -> tuple[str, dict[str, str], float, str]:
    """Run one upstream test file (or one test id) on `tree`: (rel, outcome by
    test id, seconds, the log's last line). With a fork server (zygote.py, started
    with gate_env(tree, base)) the file runs in a fork of it, else in a new process."""
    stem = outcome_stem(rel)
    outcomes = out_dir / (stem + ".txt")
    outcomes.unlink(missing_ok=True)
    start = time.monotonic()
    cmd = pytest_command(rel, base)
    log_path = out_dir / (stem + ".log")
    ran = None
    if server is not None:
        code = f"import sys, pytest\nsys.exit(pytest.main({cmd[3:]!r}))\n"  # after `python -m pytest`
        ran = server.run(code, tree, log_path, {"KVCS_OUTCOMES": str(outcomes)})
    if ran is None:
        env = gate_env(tree, base)
        env["KVCS_OUTCOMES"] = str(outcomes)
        with open(log_path, "w") as log_file:
            proc = subprocess.run(cmd, cwd=tree, env=env, stdout=log_file, stderr=subprocess.STDOUT)
        ran = (proc.returncode, 0.0)
    elapsed = time.monotonic() - start
    results = {}
    if outcomes.exists():
        for line in outcomes.read_text().splitlines():
            outcome, _, nodeid = line.partition(" ")
            results[nodeid] = outcome
    tail = log_path.read_text().strip().splitlines()[-1:] or [f"exit {ran[0]}"]
    return rel, results, elapsed, tail[0]


def pristine_tree(base: Base | None = None) -> Path:
    """The unpatched base: for v0.32.0 a worktree of build/vllm at the base
    with the ops; for another release its PyPI sdist unpacked under build/
    (made once, then left as it is)."""
    base = base or get_base(None)
    if base.version == DEFAULT_BASE:
        from .tree import base_worktree

        return base_worktree(BUILD / "upstream-base", "cpu")
    dest = BUILD / f"upstream-base-{base.version}"
    if not (dest / "vllm" / "__init__.py").is_file():
        log(f"unpacking the vLLM {base.version} sdist as {dest.relative_to(ROOT)} (the unpatched base)")
        unpack_sdist(download_sdist(base.version), dest)
    return dest


def tree_version(tree: Path) -> str | None:
    """The vLLM release a source tree says it is (its sdist's PKG-INFO), or None."""
    info = tree / "PKG-INFO"
    if not info.is_file():
        return None
    for line in info.read_text(errors="replace").splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    return None


def check_tree(tree: Path, base: Base) -> None:
    """A tree the gate can run: a vLLM source tree of the base's release."""
    if not (tree / "vllm" / "__init__.py").is_file():
        raise SeriesError(f"{tree} is no vLLM source tree (no vllm/__init__.py): pass --tree a checkout or "
                          f"unpacked sdist of vLLM {base.version}")
    found = tree_version(tree)
    if found is not None and found.split("+", 1)[0] != base.version:
        raise SeriesError(f"{tree} is vLLM {found} (its PKG-INFO), not {base.version}: "
                          f"pass --base {found.split('+', 1)[0]}, or --tree a {base.version} tree")


# What the gate's fork servers import beyond zygote.PRELOAD: vLLM itself, from the one tree
# every file of a gate run uses (the baseline's runs preload the unpatched tree the same way).
GATE_PRELOAD = ("vllm", "vllm.config", "vllm.v1.core.sched.scheduler")


def run_order(files: list[str], timings: dict[str, float], tree: Path) -> list[str]:
    """Longest first, so the jobs finish together: by the last run's seconds (a
    file without any first); on a fresh clone, with none, by the test file's size."""
    if not timings:
        def size(rel: str) -> int:
            path = tree / rel.split("::", 1)[0]
            return path.stat().st_size if path.is_file() else 0

        return sorted(files, key=lambda f: -size(f))
    return sorted(files, key=lambda f: -timings.get(f, 1e9))


def check_python(base: Base) -> None:
    if not base.python.is_file():
        raise SeriesError(f"the vLLM {base.version} gate runs its tests with {base.python}, which does not exist: "
                          f"run `{base.setup_hint}` first")


def run_gate(record: bool = False, jobs: int = 2, tree: Path | None = None, only: list[str] | None = None,
             base: str | None = None) -> int:
    b = get_base(base)
    check_python(b)
    if tree is None and not record and b.version != DEFAULT_BASE:
        # The maintainer's tree of that base: its sdist + its series (make setup-0.34).
        tree = b._series_base.tree
        if not (tree / "vllm" / "__init__.py").exists():
            raise SeriesError(f"the vLLM {b.version} gate runs on the patched tree {tree}, which does not "
                              f"exist: run `make setup-0.34`, or name a tree with --tree PATH")
    write_hf_cache()
    if GATE_SITE in b.extra_path:
        install_gate_site()
    if tree is None:
        tree = pristine_tree(b) if record else TREE
    tree = tree.resolve()
    check_tree(tree, b)
    files = only or gate_files(b)
    out_dir = b.out / ("base" if record else "patched")
    out_dir.mkdir(parents=True, exist_ok=True)
    log(f"upstream gate (vLLM {b.version} base) on {tree}: {len(files)} files, {jobs} at a time "
        f"(logs in {out_dir.relative_to(ROOT)})")
    start = time.monotonic()
    # Longest files first, from the last run's timings, so the two lanes finish together.
    timings_path = out_dir / "timings.json"
    timings = json.loads(timings_path.read_text()) if timings_path.exists() else {}
    order = run_order(files, timings, tree)
    all_results: dict[str, str] = {}
    counts = {}
    # One fork server per job (zygote.py): torch and the other libraries imported once each.
    servers: queue.SimpleQueue = queue.SimpleQueue()
    for n in range(jobs):
        servers.put(ForkServer(b.python, gate_env(tree, b), out_dir / f"fork-server-{n + 1}.log", also=GATE_PRELOAD))

    def run_one(rel: str):
        server = servers.get()
        try:
            return run_file(tree, rel, out_dir, b, server)
        finally:
            servers.put(server)

    try:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            for rel, results, elapsed, tail in pool.map(run_one, order):
                timings[rel] = elapsed
                all_results.update(results)
                c = {k: sum(1 for v in results.values() if v == k) for k in sorted(set(results.values()))}
                counts[rel] = c
                log(f"  {rel}: {', '.join(f'{v} {k}' for k, v in c.items()) or 'no results'} ({elapsed:.0f} s) | {tail}")
    finally:
        while not servers.empty():
            servers.get().close()
    timings_path.write_text(json.dumps(timings, indent=1, sort_keys=True))
    (out_dir / "counts.json").write_text(json.dumps(counts, indent=1, sort_keys=True))
    log(f"upstream gate took {time.monotonic() - start:.0f} s")
    flaky = flaky_ids(b)
    passed = sorted(n for n, o in all_results.items() if o == "passed" and n not in flaky)
    if record:
        if only:  # the other files' entries stay as they were
            passed = merge_baseline(read_list(b.baseline_path) if b.baseline_path.exists() else [], passed, only)
        b.baseline_path.write_text("".join(n + "\n" for n in passed))
        dropped = sum(1 for n, o in all_results.items() if o == "passed" and n in flaky)
        log(f"recorded {len(passed)} passing tests in {b.baseline_path.relative_to(ROOT)}"
            + (f" (left out {dropped} that passed but are listed in {b.flaky_path.relative_to(ROOT)})"
               if dropped else ""))
        return 0
    baseline = [ln.strip() for ln in b.baseline_path.read_text().splitlines() if ln.strip()]
    if only:
        baseline = [n for n in baseline if n.split("::", 1)[0] in files]
    rerun_dir = out_dir / "rerun"
    rerun_dir.mkdir(exist_ok=True)

    regressed, flaky_now = classify_failures(baseline, all_results, lambda n: rerun_alone(tree, n, rerun_dir, b))
    total = sum(1 for o in all_results.values() if o == "passed")
    if flaky_now:
        print(f"\nupstream gate: {len(flaky_now)} baseline test(s) failed once and passed when rerun alone "
              "(flaky here, not a regression):", flush=True)
        for n in flaky_now:
            print(f"  flaky ({all_results.get(n, 'not run')}, then passed alone): {n}", flush=True)
    if regressed:
        print(f"\nupstream gate FAILED: {len(regressed)} of {len(baseline)} baseline tests do not pass "
              "on the patched tree:", flush=True)
        for n in regressed:
            print(f"  {all_results.get(n, 'not run')}: {n}", flush=True)
        return 1
    print(f"\nupstream gate: {len(baseline)} passed, 0 failed (baseline tests; {total} passed in all"
          + (f", {len(flaky_now)} of them on a rerun alone" if flaky_now else "") + ")", flush=True)
    return 0


def merge_baseline(old: list[str], passed: list[str], only: list[str]) -> list[str]:
    """The baseline after `--record --only ONLY`: the old entries that none of
    ONLY (files or test ids) covers, and what passed in this run."""
    def covered(nodeid: str) -> bool:
        return any(nodeid == o or nodeid.startswith(o + "::") or nodeid.startswith(o + "[") for o in only)

    return sorted({n for n in old if not covered(n)} | set(passed))


# More baseline failures than this in one run is no flake: they are not rerun.
MAX_RERUNS = 10


def classify_failures(baseline: list[str], results: dict[str, str], rerun) -> tuple[list[str], list[str]]:
    """(regressed, flaky): a baseline test that did not pass is rerun alone
    once (`rerun(nodeid)` gives its outcome); passing then, it is flaky (a
    timeout under load, say), else a regression. With more than MAX_RERUNS
    failures nothing is rerun and every one is a regression."""
    failed = [n for n in baseline if results.get(n) != "passed"]
    if len(failed) > MAX_RERUNS:
        return failed, []
    regressed, flaky = [], []
    for n in failed:
        (flaky if rerun(n) == "passed" else regressed).append(n)
    return regressed, flaky
