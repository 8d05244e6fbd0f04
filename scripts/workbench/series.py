"""The patch series and the vLLM trees it applies to.

`patches/series` lists the patches in order, one file name a line (quilt's
format; `#` starts a comment). Each patch is a `git format-patch` file, so a
git checkout takes the series as commits (`git am`) and a plain tree takes it
as diffs (`git apply`).

The state of a tree is found from its files, not from a marker: a tree has
the first k patches applied when reversing patches k..1 in a scratch copy of
the files they touch succeeds and patch k+1 (if any) applies forward.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

BASE_VERSION = "0.32.0"
# The series applies on BASE_TAG: the sdist (SDIST_TAG) plus, where the
# runtime needs it, the wheel's versions of Python files its compiled ops
# depend on (runtime.overlay_files); the patches touch none of those.
BASE_TAG = "kvchecksum-base"
SDIST_TAG = "kvchecksum-sdist"
# Fixed identity and dates make the base commit and the applied series
# reproducible, so `make refresh` does not churn when nothing changed.
GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "vllm-kvchecksum",
    "GIT_AUTHOR_EMAIL": "vllm-kvchecksum@localhost",
    "GIT_COMMITTER_NAME": "vllm-kvchecksum",
    "GIT_COMMITTER_EMAIL": "vllm-kvchecksum@localhost",
}
BASE_DATE = "2026-01-01T00:00:00+00:00"


class SeriesError(Exception):
    """A tree or the series is not in a state the command can work with.

    The message says what was found and what to do.
    """


@dataclass(frozen=True)
class Patch:
    name: str
    path: Path

    @property
    def subject(self) -> str:
        """The commit subject (the Subject: header, `[PATCH]` prefix dropped)."""
        text = self.path.read_text()
        match = re.search(r"^Subject: (.*(?:\n[ \t].*)*)", text, re.M)
        if not match:
            raise SeriesError(f"{self.path}: no Subject: header; is it a git format-patch file?")
        subject = re.sub(r"\s*\n[ \t]+", " ", match.group(1))
        return re.sub(r"^\[PATCH[^\]]*\]\s*", "", subject).strip()

    def touched_files(self) -> list[str]:
        files = []
        for line in self.path.read_text().splitlines():
            if line.startswith("diff --git a/"):
                a, _, b = line[len("diff --git a/"):].partition(" b/")
                files.extend({a, b})
        return files

    def tests(self) -> list[str]:
        """Test paths the patch names in its `Tests:` trailer lines."""
        found = []
        for line in self.path.read_text().split("\n---\n", 1)[0].splitlines():
            if line.startswith("Tests:"):
                found.extend(line[len("Tests:"):].split())
        return found


def read_series(patches_dir: Path) -> list[Patch]:
    series_file = patches_dir / "series"
    if not series_file.exists():
        raise SeriesError(f"{series_file} is missing")
    patches = []
    for raw in series_file.read_text().splitlines():
        name = raw.split("#", 1)[0].strip()
        if not name:
            continue
        path = patches_dir / name
        if not path.exists():
            raise SeriesError(f"{series_file} lists {name}, which is not in {patches_dir}")
        patches.append(Patch(name, path))
    return patches


def series_digest(patches: list[Patch]) -> str:
    digest = hashlib.sha256()
    for patch in patches:
        digest.update(patch.name.encode() + b"\0" + patch.path.read_bytes() + b"\0")
    return digest.hexdigest()


def run(cmd: list[str], cwd: Path | None = None, check: bool = True, env: dict | None = None,
        input: str | None = None) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    full_env.update(GIT_IDENTITY)
    if env:
        full_env.update(env)
    result = subprocess.run(cmd, cwd=cwd, env=full_env, text=True, input=input,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if check and result.returncode != 0:
        raise SeriesError(
            f"command failed ({result.returncode}): {' '.join(cmd)} in {cwd}\n"
            f"{result.stdout}{result.stderr}".rstrip())
    return result


def is_git_tree(tree: Path) -> bool:
    """True when `tree` is the top of its own git work tree."""
    result = run(["git", "rev-parse", "--show-toplevel"], cwd=tree, check=False,
                 env={"GIT_CEILING_DIRECTORIES": str(tree.resolve().parent)})
    return result.returncode == 0 and Path(result.stdout.strip()).resolve() == tree.resolve()


def _plain_env(tree: Path) -> dict:
    # A plain tree may sit inside someone else's repository; stop git from
    # finding it, so `git apply` works on the tree's own paths.
    return {"GIT_CEILING_DIRECTORIES": str(tree.resolve().parent)}


def tree_version(tree: Path) -> str:
    """The vLLM version of a source tree, from the files an sdist or checkout has."""
    pkg_info = tree / "PKG-INFO"
    if pkg_info.exists():
        match = re.search(r"^Version: (\S+)", pkg_info.read_text(), re.M)
        if match:
            return match.group(1)
    version_py = tree / "vllm" / "_version.py"
    if version_py.exists():
        match = re.search(r"^__version__ = version = ['\"]([^'\"]+)", version_py.read_text(), re.M)
        if match:
            return match.group(1)
    if is_git_tree(tree):
        result = run(["git", "describe", "--tags", "--exact-match", "HEAD"], cwd=tree, check=False)
        if result.returncode == 0:
            return result.stdout.strip().lstrip("v")
    if not (tree / "vllm" / "__init__.py").exists():
        raise SeriesError(f"{tree} is not a vLLM source tree (no vllm/__init__.py)")
    raise SeriesError(
        f"cannot tell the vLLM version of {tree}: no PKG-INFO, vllm/_version.py or "
        f"release tag; the series needs a v{BASE_VERSION} tree")


def check_base_version(tree: Path) -> None:
    version = tree_version(tree)
    # A base release may carry a local suffix (0.32.0+cpu); the release must match.
    if version.split("+", 1)[0] != BASE_VERSION:
        raise SeriesError(
            f"{tree} is vLLM {version}; the series applies to v{BASE_VERSION} only. "
            f"Use a v{BASE_VERSION} tree, or see how the series fares on {version} with "
            f"`make rebase-check VLLM_VERSION={version.split('+', 1)[0]}`.")


def _git_apply_check(tree: Path, patch: Patch, reverse: bool = False) -> bool:
    cmd = ["git", "apply", "--check"] + (["-R"] if reverse else []) + [str(patch.path.resolve())]
    return run(cmd, cwd=tree, check=False, env=_plain_env(tree)).returncode == 0


def _scratch_copy(tree: Path, patches: list[Patch], dest: Path) -> None:
    for rel in sorted({f for p in patches for f in p.touched_files()}):
        src = tree / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def applied_count(tree: Path, patches: list[Patch]) -> int | None:
    """How many leading patches of the series the tree has; None if no prefix fits.

    None means the tree's files match no prefix of the series: some other
    change touched the same lines, or only some later patches are in.
    """
    if not patches:
        return 0
    for k in range(len(patches), -1, -1):
        if k < len(patches) and not _git_apply_check(tree, patches[k]):
            continue
        with tempfile.TemporaryDirectory(prefix="kvcs-scratch-") as scratch:
            scratch_dir = Path(scratch)
            _scratch_copy(tree, patches, scratch_dir)
            ok = True
            for patch in reversed(patches[:k]):
                result = run(["git", "apply", "-R", str(patch.path.resolve())], cwd=scratch_dir,
                             check=False, env=_plain_env(scratch_dir))
                if result.returncode != 0:
                    ok = False
                    break
            if ok:
                return k
    return None


def _dirty(tree: Path) -> str:
    return run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=tree).stdout.strip()


def apply_series(tree: Path, patches: list[Patch], *, as_commits: bool | None = None) -> str:
    """Apply the whole series to a v0.32.0 tree; returns what was done, for the user.

    A git work tree gets one commit per patch (`git am`), a plain tree the
    diffs. Refuses a wrong base, a dirty git tree, or a partial series.
    """
    tree = tree.resolve()
    if not tree.is_dir():
        raise SeriesError(f"{tree} does not exist or is not a directory")
    check_base_version(tree)
    git = is_git_tree(tree) if as_commits is None else as_commits
    if git:
        dirty = _dirty(tree)
        if dirty:
            raise SeriesError(
                f"{tree} has uncommitted changes to tracked files:\n{dirty}\n"
                "Commit or stash them first; the series is applied as commits on a clean tree.")
    count = applied_count(tree, patches)
    if count == len(patches):
        return f"already applied: all {len(patches)} patches of the series are in {tree}"
    if count is None:
        raise SeriesError(
            f"{tree} matches no prefix of the series: its files differ where the patches "
            "apply (another change, or some patches applied by hand out of order). Start from "
            f"a pristine v{BASE_VERSION} tree.")
    if count:
        raise SeriesError(
            f"{tree} has the series partially applied: patches 1..{count} are in, "
            f"{count + 1}..{len(patches)} are not (next: {patches[count].name}). "
            "Run `make unapply VLLM_SRC=...` to remove them, then apply again.")
    for patch in patches:
        if git:
            result = run(["git", "am", "--committer-date-is-author-date", "--keep-cr",
                          str(patch.path.resolve())], cwd=tree, check=False)
            if result.returncode != 0:
                run(["git", "am", "--abort"], cwd=tree, check=False)
                raise SeriesError(f"{patch.name} does not apply to {tree}:\n{result.stdout}{result.stderr}")
        else:
            result = run(["git", "apply", str(patch.path.resolve())], cwd=tree, check=False,
                         env=_plain_env(tree))
            if result.returncode != 0:
                raise SeriesError(
                    f"{patch.name} does not apply to {tree}:\n{result.stderr}"
                    "The tree is left with the patches before it applied; `make unapply` removes them.")
    how = "as commits" if git else "as diffs"
    return f"applied {len(patches)} patches {how} to {tree}"


def unapply_series(tree: Path, patches: list[Patch]) -> str:
    """Remove the series from a tree that has all or a prefix of it."""
    tree = tree.resolve()
    count = applied_count(tree, patches)
    if count is None:
        raise SeriesError(f"{tree} matches no prefix of the series; nothing was changed.")
    if count == 0:
        return f"not applied: {tree} has none of the series"
    if is_git_tree(tree):
        dirty = _dirty(tree)
        if dirty:
            raise SeriesError(f"{tree} has uncommitted changes to tracked files:\n{dirty}\nCommit or stash them first.")
        subjects = run(["git", "log", f"-{count}", "--format=%s"], cwd=tree).stdout.splitlines()
        expected = [p.subject for p in reversed(patches[:count])]
        if subjects == expected:
            run(["git", "reset", "--keep", f"HEAD~{count}"], cwd=tree)
            return f"removed {count} series commits from {tree}"
        # The series is in, but not as the top commits: revert it as one commit.
        for patch in reversed(patches[:count]):
            run(["git", "apply", "-R", "--index", str(patch.path.resolve())], cwd=tree)
        run(["git", "commit", "-q", "-m", f"Revert the vllm-kvchecksum series ({count} patches)"], cwd=tree)
        return f"reverted {count} patches of the series in {tree} with one commit"
    for patch in reversed(patches[:count]):
        run(["git", "apply", "-R", str(patch.path.resolve())], cwd=tree, env=_plain_env(tree))
    return f"removed {count} patches from {tree}"


def init_base_repo(tree: Path, version: str = BASE_VERSION) -> None:
    """Make an unpacked base tree a git repository with one reproducible commit."""
    run(["git", "init", "-q", "-b", "series"], cwd=tree)
    run(["git", "config", "core.autocrlf", "false"], cwd=tree)
    run(["git", "add", "-A", "-f"], cwd=tree)
    env = {"GIT_AUTHOR_DATE": BASE_DATE, "GIT_COMMITTER_DATE": BASE_DATE}
    run(["git", "commit", "-q", "--no-verify", "-m", f"vLLM v{version} (PyPI sdist)"], cwd=tree, env=env)
    run(["git", "tag", SDIST_TAG], cwd=tree)
    run(["git", "tag", BASE_TAG], cwd=tree)


def commit_overlay(tree: Path, files: dict[str, bytes], source: str) -> None:
    """Commit runtime overlay files on the sdist and move BASE_TAG there."""
    if not files:
        return
    for rel, data in files.items():
        (tree / rel).write_bytes(data)
    run(["git", "add", "-f", *files], cwd=tree)
    env = {"GIT_AUTHOR_DATE": BASE_DATE, "GIT_COMMITTER_DATE": BASE_DATE}
    message = (f"Runtime overlay: {', '.join(sorted(files))} from {source}\n\n"
               "The compiled ops of that wheel were built with these versions of the files, "
               "which differ from the sdist's; they are not part of the series.")
    run(["git", "commit", "-q", "--no-verify", "-m", message], cwd=tree, env=env)
    run(["git", "tag", "-f", BASE_TAG], cwd=tree)


def format_series(tree: Path, out_dir: Path) -> list[Path]:
    """Write the commits on top of the base tag as patch files, deterministically."""
    out_dir.mkdir(parents=True, exist_ok=True)
    result = run(["git", "format-patch", "--zero-commit", "--no-signature", "--no-numbered",
                  "--no-stat", "--full-index", "--no-renames", "--keep-subject",
                  "--encode-email-headers", "-o", str(out_dir), f"{BASE_TAG}..HEAD"], cwd=tree)
    return [Path(line) for line in result.stdout.splitlines() if line.strip()]


def refresh(tree: Path, patches_dir: Path) -> str:
    """Rewrite patches/ from the commits on top of the base in `tree`."""
    tree = tree.resolve()
    if _dirty(tree):
        raise SeriesError(f"{tree} has uncommitted changes; commit them (one commit per patch) before refresh.")
    with tempfile.TemporaryDirectory(prefix="kvcs-refresh-") as tmp:
        files = format_series(tree, Path(tmp))
        if not files:
            raise SeriesError(f"no commits on top of {BASE_TAG} in {tree}; refusing to empty the series")
        new_names = [f.name for f in files]
        changed = []
        for f in files:
            dest = patches_dir / f.name
            if not dest.exists() or dest.read_bytes() != f.read_bytes():
                changed.append(f.name)
                shutil.copyfile(f, dest)
        old_names = [p.name for p in read_series(patches_dir)] if (patches_dir / "series").exists() else []
        removed = [n for n in old_names if n not in new_names]
        for name in removed:
            (patches_dir / name).unlink(missing_ok=True)
        series_text = "".join(n + "\n" for n in new_names)
        if not (patches_dir / "series").exists() or (patches_dir / "series").read_text() != series_text:
            (patches_dir / "series").write_text(series_text)
    if not changed and not removed:
        return f"patches/ is current ({len(new_names)} patches)"
    return (f"refreshed patches/: {len(new_names)} patches, changed: {', '.join(changed) or 'none'}"
            f", removed: {', '.join(removed) or 'none'}")
