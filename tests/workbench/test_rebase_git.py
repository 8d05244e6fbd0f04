"""make rebase-check against a git ref (VLLM_GIT/VLLM_REF), on a local repository.

The tests reach no real upstream (no network but PyPI), so "upstream" is a
git repository made in the test: its `main` is the series' base, its branch `topic/moved` has moved on so
that one patch needs fuzz and one conflicts.
"""

import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from workbench import checks
from workbench import series as S
from workbench.tree import ROOT


def numbered(name: str) -> str:
    return "".join(f"{name}{i} = {i}\n" for i in range(1, 13))


def edited(name: str, line: int, value: str) -> str:
    return numbered(name).replace(f"{name}{line} = {line}\n", f"{name}{line} = {value}\n")


BASE = {f"vllm/{n}.py": numbered(n) for n in "abc"}
# Each patch changes line 6, so its hunk has lines 3..9 as context.
EDITS = [("edit a", {"vllm/a.py": edited("a", 6, "60")}),
         ("edit b", {"vllm/b.py": edited("b", 6, "60")}),
         ("edit c", {"vllm/c.py": edited("c", 6, "60")}),
         ("add d", {"vllm/d.py": "d = 1\n"})]
# Upstream moved b's outermost context line (fuzz 1) and c's changed line (a conflict).
MOVED = {"vllm/b.py": edited("b", 3, "'moved'"), "vllm/c.py": edited("c", 6, "'moved'")}
BRANCH = "topic/moved"
EXPECTED_MOVED = ["| 0001-edit-a.patch | applies cleanly |  |",
                  "| 0002-edit-b.patch | applies with fuzz | with fuzz 1 |",
                  "| 0003-edit-c.patch | conflicts | vllm/c.py |",
                  "| 0004-add-d.patch | applies cleanly |  |",
                  "", "2 applies cleanly, 1 applies with fuzz, 1 conflicts"]


def table(report: str) -> list[str]:
    """The report from its first patch row on."""
    lines = report.splitlines()
    return lines[lines.index("| --- | --- | --- |") + 1:]


def sha(repo: Path, rev: str) -> str:
    return S.run(["git", "rev-parse", rev], cwd=repo).stdout.strip()


@pytest.fixture
def upstream(synthetic_series, tmp_path) -> tuple[Path, Path]:
    """(a git repository: main = the base, topic/moved = moved on; the series dir)."""
    base, patches = synthetic_series(BASE, EDITS)
    repo = shutil.copytree(base, tmp_path / "upstream")
    S.run(["git", "init", "-q", "-b", "main"], cwd=repo)
    S.run(["git", "add", "-A"], cwd=repo)
    S.run(["git", "commit", "-q", "-m", "base"], cwd=repo)
    S.run(["git", "checkout", "-q", "-b", BRANCH], cwd=repo)
    for rel, text in MOVED.items():
        (repo / rel).write_text(text)
    S.run(["git", "commit", "-q", "-am", "upstream moves on"], cwd=repo)
    S.run(["git", "checkout", "-q", "main"], cwd=repo)
    return repo, patches


def workbench(*args: str) -> subprocess.CompletedProcess:
    """The CLI as ci/rebase-check.sh runs it: from scripts/, with the venv's python."""
    return subprocess.run([sys.executable, "-m", "workbench", *args], cwd=ROOT / "scripts", text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120)


def test_branch_report_then_main_in_the_same_scratch_repo(upstream, tmp_path):
    repo, patches = upstream
    out = tmp_path / "out"
    report, path = checks.rebase_check_git(str(repo), BRANCH, patches_dir=patches, out_dir=out)
    assert path == out / "rebase-check-git-topic-moved.md" and path.read_text() == report
    commit = sha(repo, BRANCH)
    assert report.startswith(f"# Rebase check: the series on vLLM git {BRANCH} ({commit[:12]})\n")
    assert f"Source: `{repo}`, ref `{BRANCH}`, commit `{commit}`." in report
    assert f"`make rebase-check VLLM_GIT={repo} VLLM_REF={BRANCH}`" in report
    assert table(report) == EXPECTED_MOVED
    scratch = out / "rebase" / "git"
    assert S.run(["git", "rev-list", "--count", "HEAD"], cwd=scratch).stdout.strip() == "1"  # shallow
    # The second check reuses the scratch repository the first left patched.
    again, _ = checks.rebase_check_git(str(repo), "main", patches_dir=patches, out_dir=out)
    assert f"commit `{sha(repo, 'main')}`" in again
    assert table(again)[-1] == "4 applies cleanly, 0 applies with fuzz, 0 conflicts"


def test_full_commit_sha_as_ref(upstream, tmp_path):
    repo, patches = upstream
    commit = sha(repo, BRANCH)
    report, path = checks.rebase_check_git(str(repo), commit, patches_dir=patches, out_dir=tmp_path / "out")
    assert path.name == f"rebase-check-git-{commit}.md"
    assert table(report) == EXPECTED_MOVED


def test_release_report_has_the_same_rows(upstream, tmp_path, monkeypatch):
    """The VLLM_VERSION path, on an sdist made of the moved branch."""
    repo, patches = upstream
    S.run(["git", "checkout", "-q", BRANCH], cwd=repo)
    sdist = tmp_path / "vllm-0.34.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        tar.add(repo / "vllm", arcname="vllm-0.34.0/vllm")
    monkeypatch.setattr(checks, "download_sdist", lambda version: sdist)
    report, path = checks.rebase_check("0.34.0", patches_dir=patches, out_dir=tmp_path / "out")
    assert path == tmp_path / "out" / "rebase-check-0.34.0.md"
    assert report.startswith("# Rebase check: the series on vLLM 0.34.0\n\n"
                             "Base of the series: v0.32.0; command: `make rebase-check VLLM_VERSION=0.34.0`.\n")
    assert table(report) == EXPECTED_MOVED


def test_cli_with_a_relative_path(upstream, tmp_path):
    repo, patches = upstream
    # Relative to scripts/, where the CLI runs, not to the scratch repository git fetches in.
    relative = os.path.relpath(repo, ROOT / "scripts")
    result = workbench("rebase-check", "--git", relative, "--ref", BRANCH,
                       "--patches", str(patches), "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    assert f"Source: `{repo}`, ref `{BRANCH}`" in result.stdout
    assert "| 0003-edit-c.patch | conflicts | vllm/c.py |" in result.stdout
    assert f"(written to {tmp_path / 'out' / 'rebase-check-git-topic-moved.md'})" in result.stdout


def one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: "), result.stderr
    return result.stderr


def test_wrong_ref_is_a_one_line_error(upstream, tmp_path):
    repo, patches = upstream
    err = one_line_error(workbench("rebase-check", "--git", str(repo), "--ref", "no-such-branch",
                                   "--patches", str(patches), "--out", str(tmp_path / "out")))
    assert f"{repo} has no ref 'no-such-branch'" in err and "VLLM_REF" in err


def test_unreachable_source_is_a_one_line_error(upstream, tmp_path):
    _, patches = upstream
    missing = tmp_path / "no-such-repo"
    err = one_line_error(workbench("rebase-check", "--git", str(missing), "--ref", "main",
                                   "--patches", str(patches), "--out", str(tmp_path / "out")))
    assert f"cannot fetch 'main' from {missing}" in err and "VLLM_GIT" in err


def test_ref_that_looks_like_an_option_is_not_run(upstream, tmp_path):
    repo, patches = upstream
    marker = tmp_path / "ran"
    with pytest.raises(S.SeriesError, match="cannot fetch"):
        checks.rebase_check_git(str(repo), f"--upload-pack=touch {marker}", patches_dir=patches,
                                out_dir=tmp_path / "out")
    assert not marker.exists()


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except FileNotFoundError:
        return True


def test_hanging_source_is_stopped_with_its_helpers(upstream, tmp_path, monkeypatch):
    _, patches = upstream
    pid_file = tmp_path / "ssh.pid"
    # git runs this for an ssh:// URL: a server that never answers. `exec` keeps
    # the pid it writes; `#` drops the arguments git appends.
    monkeypatch.setenv("GIT_SSH_COMMAND", f"echo $$ >> {pid_file}; exec sleep 60 #")
    source = "ssh://kvcs.invalid/vllm.git"
    start = time.monotonic()
    with pytest.raises(S.SeriesError, match=rf"fetching 'main' from {source}: git fetch took more than 1s"):
        checks.rebase_check_git(source, "main", patches_dir=patches, out_dir=tmp_path / "out", timeout=1)
    assert time.monotonic() - start < 20
    helpers = [int(pid) for pid in pid_file.read_text().split()]
    deadline = time.monotonic() + 5
    while not all(gone(pid) for pid in helpers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(gone(pid) for pid in helpers), f"git's ssh helpers {helpers} outlived the timeout"


@pytest.mark.parametrize("args", [[], ["0.34.0", "--git", "x"], ["0.34.0", "--ref", "main"]],
                         ids=["neither", "both", "ref-without-git"])
def test_release_or_git_not_both(args):
    err = one_line_error(workbench("rebase-check", *args))
    assert "rebase-check" in err and "--git" in err
