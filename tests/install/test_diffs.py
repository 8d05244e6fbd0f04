"""The in-memory patch reader and applier (vllm_kvchecksum.install.diffs), against `git apply` and by hand."""

from __future__ import annotations

import os
import subprocess

import pytest

from vllm_kvchecksum.install.diffs import PatchError, apply_file_diff, parse_patch


def git_diff(tmp_path, old: bytes | None, new: bytes | None, name: str = "vllm/x.py") -> bytes:
    """A real `git diff` between two versions of one file."""
    repo = tmp_path / "repo"
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tmp_path))
    subprocess.run(["git", "init", "-q", str(repo)], check=True, env=env)
    path = repo / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if old is not None:
        path.write_bytes(old)
        subprocess.run(["git", "add", "-A"], cwd=repo, check=True, env=env)
    if new is None:
        path.unlink()
    else:
        path.write_bytes(new)
    if old is None:  # a new file: in the diff once git intends to add it
        subprocess.run(["git", "add", "-N", name], cwd=repo, check=True, env=env)
    return subprocess.run(["git", "diff", "--full-index"], cwd=repo, check=True, env=env,
                          capture_output=True).stdout


CASES = {
    "middle": (b"".join(b"line %d\n" % i for i in range(40)),
               b"".join(b"line %d\n" % i if i != 20 else b"changed\n" for i in range(40))),
    "two hunks and an insertion": (b"".join(b"l%d\n" % i for i in range(60)),
                                   b"top\n" + b"".join(b"l%d\n" % i for i in range(60) if i not in (10, 50))
                                   + b"end\n"),
    "no newline at the end, before": (b"a\nb\nc", b"a\nB\nc\n"),
    "no newline at the end, after": (b"a\nb\nc\n", b"a\nb\nc"),
    "new file": (None, b"x = 1\ny = 2\n"),
    "deleted file": (b"x = 1\n", None),
    "empty lines in context": (b"a\n\n\nb\n\n\nc\n", b"a\n\n\nB\n\n\nc\n"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_git_diff_applies_to_what_git_made_it_from(tmp_path, case):
    old, new = CASES[case]
    (fd,) = parse_patch(git_diff(tmp_path, old, new), case)
    assert apply_file_diff(fd, old, case) == new


def test_a_hunk_found_away_from_its_line_applies_where_it_matches(tmp_path):
    old = b"".join(b"l%d\n" % i for i in range(30))
    new = old.replace(b"l15\n", b"L15\n")
    (fd,) = parse_patch(git_diff(tmp_path, old, new))
    shifted = b"extra\n" * 7 + old
    assert apply_file_diff(fd, shifted) == b"extra\n" * 7 + new


def test_a_hunk_whose_context_differs_is_refused_naming_the_patch_file_and_hunk(tmp_path):
    old = b"".join(b"l%d\n" % i for i in range(30))
    (fd,) = parse_patch(git_diff(tmp_path, old, old.replace(b"l15\n", b"L15\n")))
    with pytest.raises(PatchError, match=r"0007-x.patch: hunk #1 of vllm/x.py .* does not match"):
        apply_file_diff(fd, old.replace(b"l14\n", b"l14 edited\n"), "0007-x.patch")


def test_creating_a_file_that_exists_and_changing_one_that_does_not_are_refused(tmp_path):
    (new,) = parse_patch(git_diff(tmp_path, None, b"x\n"))
    with pytest.raises(PatchError, match="already exists"):
        apply_file_diff(new, b"x\n")
    (tmp_path / "b").mkdir()
    (change,) = parse_patch(git_diff(tmp_path / "b", b"x\n", b"y\n"))
    with pytest.raises(PatchError, match="does not exist"):
        apply_file_diff(change, None)


@pytest.mark.parametrize("header", [b"diff --git a/../etc/passwd b/../etc/passwd", b"diff --git a//etc/x b//etc/x",
                                    b"diff --git a/vllm/a.py b/vllm/b.py"])
def test_paths_that_leave_the_tree_and_renames_are_refused(header):
    with pytest.raises(PatchError):
        parse_patch(header + b"\n--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n+b\n")


@pytest.mark.parametrize("extra", [b"old mode 100644\nnew mode 100755\n", b"Binary files a/x and b/x differ\n",
                                   b"similarity index 90%\n"])
def test_mode_changes_binary_and_similarity_headers_are_refused(extra):
    with pytest.raises(PatchError, match="not supported"):
        parse_patch(b"diff --git a/vllm/x.py b/vllm/x.py\n" + extra + b"@@ -1 +1 @@\n-a\n+b\n")


def test_a_truncated_hunk_is_refused():
    with pytest.raises(PatchError, match="ends early"):
        parse_patch(b"diff --git a/vllm/x.py b/vllm/x.py\n--- a/vllm/x.py\n+++ b/vllm/x.py\n@@ -1,3 +1,3 @@\n a\n-b\n")
