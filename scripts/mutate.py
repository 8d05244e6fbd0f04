#!/usr/bin/env python
"""Run tests against one mutation of the package, in a copy (never in place).

    .venv/bin/python scripts/mutate.py tests/mutations.json [NAME ...]

MUTATIONS.json lists {"name", "file", "old", "new", "tests": [...], "args": [...]}: `old`
must occur exactly once in vllm_kvchecksum/FILE (or, with "tree": "vllm", in
build/vllm/FILE: a patch's own vLLM code, changed in place and restored; "tree":
"vllm-0.34.0" the same in build/vllm-0.34.0, tested on that base; with
"tree": "scripts", in scripts/FILE, copied like the package). Each mutant is a copy of
the package and the tests under /tmp/kvchecksum-mutants/NAME (build/ and
.venv linked), where pytest runs: the copy comes first on sys.path, ahead
of the editable install. Prints one line per mutant: killed (some test
failed) or SURVIVED. tests/mutations.json holds one-line bugs in the
guards of the block rule, the comparison, the scheduler glue and the
workers, each of which some test must catch.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(mutation: dict) -> bool:
    if mutation.get("tree") == "vllm" or str(mutation.get("tree", "")).startswith("vllm-"):
        return run_in_vllm_tree(mutation)
    dest = Path("/tmp/kvchecksum-mutants") / mutation["name"]
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    # "tree": "scripts": a mutant of the scripts (the demo, the soak), copied too.
    in_scripts = mutation.get("tree") == "scripts"
    copied = ("vllm_kvchecksum", "tests", "scripts") if in_scripts else ("vllm_kvchecksum", "tests")
    for tree in copied:
        shutil.copytree(ROOT / tree, dest / tree, ignore=shutil.ignore_patterns("__pycache__"))
    for link in ("build", ".venv", "pyproject.toml", "scripts"):
        if link not in copied:
            (dest / link).symlink_to(ROOT / link)
    path = dest / ("scripts" if in_scripts else "vllm_kvchecksum") / mutation["file"]
    text = path.read_text()
    if text.count(mutation["old"]) != 1:
        raise SystemExit(f"{mutation['name']}: `old` occurs {text.count(mutation['old'])} times in {path}")
    path.write_text(text.replace(mutation["old"], mutation["new"]))
    env = dict(os.environ, PYTHONPATH=str(dest))
    check = subprocess.run([sys.executable, "-c", "import vllm_kvchecksum; print(vllm_kvchecksum.__file__)"],
                           cwd=dest, env=env, capture_output=True, text=True).stdout.strip()
    if not check.startswith(str(dest)):
        raise SystemExit(f"{mutation['name']}: the mutant is not what imports ({check})")
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-x", *mutation.get("args", ()), *mutation["tests"]]
    proc = subprocess.run(cmd, cwd=dest, env=env, capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    summary = lines[-1] if lines else proc.stderr.strip()[-200:]
    killed = proc.returncode != 0
    print(f"{mutation['name']}: {'killed' if killed else 'SURVIVED'} ({summary})", flush=True)
    return killed


def run_in_vllm_tree(mutation: dict) -> bool:
    """A mutant of a patch's vLLM code ("tree": "vllm", `file` relative to
    build/vllm): .venv imports build/vllm itself, so the file is changed in
    place for the run and restored from git after it, whatever happens.
    "tree": "vllm-0.34.0": the same in build/vllm-0.34.0, the tests run as that
    base runs them (its venv, the tree on PYTHONPATH, the Triton switch)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from workbench.bases import get_base

    version = mutation["tree"].partition("-")[2] or None
    base = get_base(version)
    tree = base.tree
    python = str(base.test_python)
    env = dict(os.environ) if base.written_on else dict(os.environ, **base.test_env())
    plugins = [f"-p{p}" for p in base.pytest_plugins]
    path = tree / mutation["file"]
    dirty = subprocess.run(["git", "status", "--porcelain", "--", mutation["file"]], cwd=tree,
                           capture_output=True, text=True, check=True).stdout.strip()
    if dirty:
        raise SystemExit(f"{mutation['name']}: {path} has uncommitted changes; commit or restore it first")
    text = path.read_text()
    if text.count(mutation["old"]) != 1:
        raise SystemExit(f"{mutation['name']}: `old` occurs {text.count(mutation['old'])} times in {path}")
    path.write_text(text.replace(mutation["old"], mutation["new"]))
    try:
        cmd = [python, "-m", "pytest", "-p", "no:cacheprovider", *plugins, "-q", "-x", *mutation.get("args", ()),
               *mutation["tests"]]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    finally:
        subprocess.run(["git", "checkout", "--", mutation["file"]], cwd=tree, check=True)
    lines = proc.stdout.strip().splitlines()
    summary = lines[-1] if lines else proc.stderr.strip()[-200:]
    killed = proc.returncode != 0
    print(f"{mutation['name']}: {'killed' if killed else 'SURVIVED'} ({summary})", flush=True)
    return killed


def main() -> int:
    mutations = json.loads(Path(sys.argv[1]).read_text())
    names = set(sys.argv[2:])
    selected = [m for m in mutations if not names or m["name"] in names]
    killed = sum(run(m) for m in selected)
    print(f"{killed} of {len(selected)} mutants killed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
