"""The upstream regression gate: vLLM's own tests of what the series touches.

`tests/upstream/gate-files.txt` lists the upstream test files. The baseline,
`tests/upstream/baseline.txt`, holds the ids of the tests that passed on the
unpatched v0.32.0 base on this CPU setup (recorded with `--record` on a
pristine tree). The gate runs the files on the patched tree and fails on any
baseline test that does not pass now, naming it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .tree import BUILD, ROOT, TREE, log

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


def gate_files() -> list[str]:
    return [ln.split("#", 1)[0].strip() for ln in GATE_FILES.read_text().splitlines()
            if ln.split("#", 1)[0].strip()]


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


def flaky_ids() -> set[str]:
    if not FLAKY.exists():
        return set()
    return {ln.split("#", 1)[0].strip() for ln in FLAKY.read_text().splitlines()} - {""}


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


def gate_env(tree: Path) -> dict:
    env = dict(os.environ)
    env.update({
        "HF_HOME": str(HF_HOME), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(tree), str(Path(__file__).parent), str(SITE_HOOKS), str(GATE_SITE)]),
        "VLLM_TARGET_DEVICE": "cpu", "TOKENIZERS_PARALLELISM": "false",
        # Each file gets one core; torch must not oversubscribe the two here.
        "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
    })
    return env


def outcome_stem(rel: str) -> str:
    """The name of a file's (or test id's) outcomes and log in the out folder:
    its whole path, so test_config.py of two folders never share one."""
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in rel.replace("/", "__"))


def rerun_alone(tree: Path, nodeid: str, out_dir: Path) -> str:
    """Run one test id by itself on `tree`: its outcome, "not run" when pytest
    recorded none for it (a collection error, an id that no longer exists)."""
    _, results, elapsed, tail = run_file(tree, nodeid, out_dir)
    outcome = results.get(nodeid, "not run")
    log(f"  rerun alone: {nodeid}: {outcome} ({elapsed:.0f} s) | {tail}")
    return outcome


def run_file(tree: Path, rel: str, out_dir: Path) -> tuple[str, dict[str, str], float, str]:
    """Run one upstream test file (or one test id) on `tree`: (rel, outcome by
    test id, seconds, the log's last line)."""
    stem = outcome_stem(rel)
    outcomes = out_dir / (stem + ".txt")
    outcomes.unlink(missing_ok=True)
    env = gate_env(tree)
    env["KVCS_OUTCOMES"] = str(outcomes)
    start = time.monotonic()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "outcomes_plugin",
           "-p", "no:randomly", f"--timeout={TEST_TIMEOUT_S}", rel]
    log_path = out_dir / (stem + ".log")
    with open(log_path, "w") as log_file:
        proc = subprocess.run(cmd, cwd=tree, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    elapsed = time.monotonic() - start
    results = {}
    if outcomes.exists():
        for line in outcomes.read_text().splitlines():
            outcome, _, nodeid = line.partition(" ")
            results[nodeid] = outcome
    tail = log_path.read_text().strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
    return rel, results, elapsed, tail[0]


def pristine_tree() -> Path:
    """A worktree of build/vllm at the unpatched base, with the ops."""
    from .tree import base_worktree

    return base_worktree(BUILD / "upstream-base", "cpu")


def run_gate(record: bool = False, jobs: int = 2, tree: Path | None = None, only: list[str] | None = None) -> int:
    write_hf_cache()
    install_gate_site()
    if tree is None:
        tree = pristine_tree() if record else TREE
    files = only or gate_files()
    out_dir = BUILD / "upstream" / ("base" if record else "patched")
    out_dir.mkdir(parents=True, exist_ok=True)
    log(f"upstream gate on {tree}: {len(files)} files, {jobs} at a time (logs in {out_dir.relative_to(ROOT)})")
    start = time.monotonic()
    # Longest files first, from the last run's timings, so the two lanes finish together.
    timings_path = out_dir / "timings.json"
    timings = json.loads(timings_path.read_text()) if timings_path.exists() else {}
    order = sorted(files, key=lambda f: -timings.get(f, 1e9))
    all_results: dict[str, str] = {}
    counts = {}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for rel, results, elapsed, tail in pool.map(lambda f: run_file(tree, f, out_dir), order):
            timings[rel] = elapsed
            all_results.update(results)
            c = {k: sum(1 for v in results.values() if v == k) for k in sorted(set(results.values()))}
            counts[rel] = c
            log(f"  {rel}: {', '.join(f'{v} {k}' for k, v in c.items()) or 'no results'} ({elapsed:.0f} s) | {tail}")
    timings_path.write_text(json.dumps(timings, indent=1, sort_keys=True))
    (out_dir / "counts.json").write_text(json.dumps(counts, indent=1, sort_keys=True))
    log(f"upstream gate took {time.monotonic() - start:.0f} s")
    flaky = flaky_ids()
    passed = sorted(n for n, o in all_results.items() if o == "passed" and n not in flaky)
    if record:
        BASELINE.write_text("".join(n + "\n" for n in passed))
        dropped = sum(1 for n, o in all_results.items() if o == "passed" and n in flaky)
        log(f"recorded {len(passed)} passing tests in {BASELINE.relative_to(ROOT)}"
            + (f" (left out {dropped} that passed but are listed in {FLAKY.relative_to(ROOT)})" if dropped else ""))
        return 0
    baseline = [ln.strip() for ln in BASELINE.read_text().splitlines() if ln.strip()]
    if only:
        baseline = [n for n in baseline if n.split("::", 1)[0] in files]
    rerun_dir = out_dir / "rerun"
    rerun_dir.mkdir(exist_ok=True)

    regressed, flaky_now = classify_failures(baseline, all_results, lambda n: rerun_alone(tree, n, rerun_dir))
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
