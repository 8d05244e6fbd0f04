"""The maintainer's vLLM checkout in build/vllm: downloads, base, series sync."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from .series import (BASE_TAG, BASE_VERSION, SDIST_TAG, Patch, SeriesError, commit_overlay, format_series,
                     init_base_repo, read_series, run)

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "build"
DL = BUILD / "dl"
PATCHES = ROOT / "patches"
TREE = BUILD / "vllm"
SYNC_STAMP = "kvchecksum-synced"


def log(msg: str) -> None:
    print(f"[workbench] {msg}", flush=True)


def download_sdist(version: str = BASE_VERSION) -> Path:
    """The PyPI sdist of a vLLM release (a full checkout, tests included), cached in build/dl."""
    DL.mkdir(parents=True, exist_ok=True)
    target = DL / f"vllm-{version}.tar.gz"
    if target.exists():
        return target
    log(f"downloading the vLLM {version} sdist from PyPI")
    env = dict(os.environ, VLLM_TARGET_DEVICE="empty", VLLM_SKIP_VERSION_SUFFIX="1")
    with tempfile.TemporaryDirectory(prefix="kvcs-dl-", dir=DL) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-build-isolation",
                        "--no-binary", ":all:", f"vllm=={version}", "-d", tmp], check=True, env=env)
        got = Path(tmp) / target.name
        if not got.exists():
            raise SeriesError(f"pip download gave {os.listdir(tmp)}, not {target.name}")
        got.rename(target)
    return target


def download_wheel(dist: str, version: str = BASE_VERSION) -> Path:
    DL.mkdir(parents=True, exist_ok=True)
    prefix = dist.replace("-", "_") + f"-{version}-"
    found = sorted(DL.glob(prefix + "*.whl"))
    if found:
        return found[-1]
    log(f"downloading the {dist} {version} wheel (its compiled ops)")
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                    f"{dist}=={version}", "-d", str(DL)], check=True)
    found = sorted(DL.glob(prefix + "*.whl"))
    if not found:
        raise SeriesError(f"pip download of {dist}=={version} left no {prefix}*.whl in {DL}")
    return found[-1]


def unpack_sdist(sdist: Path, dest: Path) -> None:
    """Unpack an sdist's top folder as `dest`."""
    if dest.exists():
        shutil.rmtree(dest)
    with tempfile.TemporaryDirectory(prefix="kvcs-unpack-", dir=dest.parent) as tmp:
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        (top,) = Path(tmp).iterdir()
        top.rename(dest)


def make_base_tree(dest: Path, sdist: Path, wheel: Path | None = None, version: str = BASE_VERSION) -> None:
    """The sdist as a git repo; with a wheel, plus its runtime overlay (BASE_TAG)."""
    from .runtime import overlay_files

    unpack_sdist(sdist, dest)
    init_base_repo(dest, version)
    if wheel is not None:
        commit_overlay(dest, overlay_files(wheel, sdist), wheel.name)


def _formatted(tree: Path) -> dict[str, bytes]:
    with tempfile.TemporaryDirectory(prefix="kvcs-fmt-") as tmp:
        return {f.name: f.read_bytes() for f in format_series(tree, Path(tmp))}


def _wanted(patches: list[Patch]) -> dict[str, bytes]:
    return {p.name: p.path.read_bytes() for p in patches}


def _digest(files: dict[str, bytes]) -> str:
    import hashlib

    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + files[name] + b"\0")
    return h.hexdigest()


def sync_tree(tree: Path = TREE, force: bool = False, wheel: Path | None = None, *,
              patches_dir: Path = PATCHES, version: str = BASE_VERSION) -> str:
    """Bring build/vllm to base + patches/, keeping any unrefreshed work.

    Another base (vLLM `version`, its series in `patches_dir`) works the same
    on its own tree, e.g. build/vllm-0.34.0 from patches/v0.34.0.

    The tree is reset only if its commits are the ones the last sync put
    there (patches/ changed, e.g. after a pull), or with force, which first
    saves HEAD as a backup branch. Commits made since the last sync and not
    yet refreshed are refused, not thrown away.
    """
    patches = read_series(patches_dir)
    shown = tree.relative_to(ROOT) if tree.is_relative_to(ROOT) else tree
    if (tree / ".git").exists() and run(["git", "rev-parse", "-q", "--verify", SDIST_TAG], cwd=tree,
                                        check=False).returncode != 0:
        # Made before the runtime overlay existed: rebuild it if nothing would be lost.
        if _formatted(tree) != _wanted(patches) and not force:
            raise SeriesError("build/vllm predates the runtime overlay and has work not in patches/: run "
                              "`make refresh` first, or `make setup FORCE=1` to rebuild it")
        log("rebuilding build/vllm (it predates the runtime overlay commit)")
        shutil.rmtree(tree)
    if not (tree / ".git").exists():
        log(f"creating {shown} from the v{version} sdist")
        make_base_tree(tree, download_sdist(version), wheel, version)
    dirty = run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=tree).stdout.strip()
    if dirty:
        raise SeriesError(
            f"{tree} has uncommitted edits:\n{dirty}\nCommit them and run `make refresh`, or discard "
            "them (git -C build/vllm checkout -- .), then run make setup again.")
    current = _formatted(tree)
    wanted = _wanted(patches)
    if current == wanted:
        return f"{shown} is current with {patches_dir.relative_to(ROOT)}/"
    stamp = tree / ".git" / SYNC_STAMP
    last = stamp.read_text().strip() if stamp.exists() else None
    head = run(["git", "rev-parse", "HEAD"], cwd=tree).stdout.strip()
    base = run(["git", "rev-parse", BASE_TAG], cwd=tree).stdout.strip()
    if head != base and _digest(current) != last:
        if not force:
            raise SeriesError(
                "build/vllm has commits that are not in patches/ (edited since the last sync). "
                "Run `make refresh` to write them to patches/, or `make setup FORCE=1` to reset "
                "build/vllm to patches/ (HEAD is kept as a backup branch).")
        backup = f"backup/{head[:12]}"
        run(["git", "branch", "-f", backup, head], cwd=tree)
        log(f"kept the old build/vllm HEAD as branch {backup}")
    run(["git", "checkout", "-q", "-B", "series", BASE_TAG], cwd=tree)
    for patch in patches:
        result = run(["git", "am", "-q", "--committer-date-is-author-date", str(patch.path)], cwd=tree,
                     check=False)
        if result.returncode != 0:
            run(["git", "am", "--abort"], cwd=tree, check=False)
            raise SeriesError(f"{patch.name} does not apply on the base:\n{result.stdout}{result.stderr}")
    stamp.write_text(_digest(_formatted(tree)) + "\n")
    return f"{shown}: base + {len(patches)} patches"


def base_worktree(path: Path, device: str = "cpu", *, tree: Path = TREE, with_ops: bool = True) -> Path:
    """A worktree of `tree` (build/vllm) at BASE_TAG with the device's compiled
    ops (with_ops; a base without a CPU wheel has none), made anew if it
    belongs to an older tree."""
    from .runtime import DEVICE_WHEELS, install_ops

    if (path / ".git").exists() and run(["git", "rev-parse", "--git-dir"], cwd=path, check=False).returncode != 0:
        shutil.rmtree(path)
    if (path / ".git").exists():
        common = run(["git", "rev-parse", "--path-format=absolute", "--git-common-dir"], cwd=path,
                     check=False).stdout.strip()
        if common and Path(common).resolve() != (tree / ".git").resolve():
            shutil.rmtree(path)  # a worktree of another base's tree
            run(["git", "worktree", "prune"], cwd=tree)
    if not (path / ".git").exists():
        if path.exists():
            shutil.rmtree(path)
        run(["git", "worktree", "prune"], cwd=tree)
        run(["git", "worktree", "add", "-q", "--detach", "--force", str(path), BASE_TAG], cwd=tree)
    run(["git", "checkout", "-q", "--detach", BASE_TAG], cwd=path)
    run(["git", "reset", "-q", "--hard", BASE_TAG], cwd=path)
    if with_ops:
        install_ops(download_wheel(DEVICE_WHEELS[device]["dist"]), download_sdist(), path)
    return path
