"""Series checks: bisectability on the base, and how it fares on newer releases or a git ref."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from .gitsource import GIT_TIMEOUT_S, fetch_ref, resolve_source, sanitized_ref
from .series import BASE_VERSION, Patch, SeriesError, read_series, run
from .tree import BUILD, PATCHES, ROOT, base_worktree, download_sdist, log, unpack_sdist


def patched_modules(patches: list[Patch]) -> list[str]:
    """Importable vllm modules the patches touch (files they add or change)."""
    mods = set()
    for patch in patches:
        for rel in patch.touched_files():
            if rel.startswith("vllm/") and rel.endswith(".py"):
                mod = rel[:-3].replace("/", ".")
                mods.add(mod[: -len(".__init__")] if mod.endswith(".__init__") else mod)
    return sorted(mods)


def check_series(device: str = "cpu", pytest_args: list[str] | None = None) -> int:
    """Apply the patches one at a time; after each, import and test what it names."""
    patches = read_series(PATCHES)
    if not patches:
        raise SeriesError("patches/series is empty")
    wt = base_worktree(BUILD / "check-series", device)
    env = dict(os.environ, PYTHONPATH=f"{wt}{os.pathsep}{ROOT}", KVCS_VLLM_TREE=str(wt))
    if device == "cpu":
        # On PYTHONPATH the tree's own vllm.egg-info (0.32.0, from the sdist)
        # shadows the 0.32.0+cpu dist-info that platform detection reads.
        env["VLLM_TARGET_DEVICE"] = "cpu"
    failures = []
    for i, patch in enumerate(patches, 1):
        log(f"[{i}/{len(patches)}] {patch.name}")
        result = run(["git", "am", "-q", "--committer-date-is-author-date", str(patch.path)], cwd=wt, check=False)
        if result.returncode != 0:
            run(["git", "am", "--abort"], cwd=wt, check=False)
            failures.append(f"{patch.name}: does not apply after the patches before it")
            break
        mods = patched_modules(patches[:i])
        code = "import importlib, vllm, sys\n" \
               f"assert vllm.__file__.startswith({str(wt)!r}), vllm.__file__\n" \
               f"for m in {mods!r}:\n    importlib.import_module(m)\n"
        imp = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        if imp.returncode != 0:
            failures.append(f"{patch.name}: importing the patched modules failed:\n{imp.stdout[-3000:]}")
            continue
        log(f"  imported {len(mods)} patched modules")
        tests = patch.tests()
        if not tests:
            failures.append(f"{patch.name}: names no tests (add a 'Tests:' line to its message)")
            continue
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests, *(pytest_args or [])]
        res = subprocess.run(cmd, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        tail = res.stdout.strip().splitlines()[-1:] or [""]
        log(f"  {' '.join(tests)}: {tail[0]}")
        if res.returncode != 0:
            failures.append(f"{patch.name}: its tests failed:\n{res.stdout[-4000:]}")
    if failures:
        print("\ncheck-series FAILED:\n" + "\n".join(failures), flush=True)
        return 1
    print(f"\ncheck-series: all {len(patches)} prefixes apply, import and pass their tests", flush=True)
    return 0


def _patch_dry_run(tree: Path, patch: Patch) -> subprocess.CompletedProcess:
    return subprocess.run(["patch", "-p1", "--dry-run", "-F3", "-i", str(patch.path)], cwd=tree, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


RESULTS = ("applies cleanly", "applies with fuzz", "conflicts")


def classify_series(tree: Path, patches: list[Patch]) -> list[tuple[str, str, str]]:
    """(patch, result, details) for each patch, applying each one that can be.

    Patches are applied in order where they can be, so a later patch is
    judged on the tree the earlier ones leave.
    """
    rows = []
    env = {"GIT_CEILING_DIRECTORIES": str(tree.parent)}
    for patch in patches:
        # Absolute: the commands run in `tree`, and a series dir may be given relative.
        patch = Patch(patch.name, patch.path.resolve())
        if run(["git", "apply", "--check", str(patch.path)], cwd=tree, check=False, env=env).returncode == 0:
            run(["git", "apply", str(patch.path)], cwd=tree, env=env)
            rows.append((patch.name, "applies cleanly", ""))
            continue
        dry = _patch_dry_run(tree, patch)
        if dry.returncode == 0:
            subprocess.run(["patch", "-p1", "-s", "-F3", "-i", str(patch.path)], cwd=tree, check=True,
                           stdout=subprocess.DEVNULL)
            how = sorted(set(re.findall(r"with fuzz \d+|offset -?\d+ lines?", dry.stdout)))
            rows.append((patch.name, "applies with fuzz", ", ".join(how)))
            continue
        files = sorted(set(re.findall(r"^(?:patching|checking) file (\S+)\n(?:(?!(?:patching|checking) file).*\n)*?Hunk #\d+ FAILED", dry.stdout, re.M)
                           + re.findall(r"can't find file to patch.*?\n.*?\|diff --git a/(\S+)", dry.stdout, re.S)))
        if not files:
            files = sorted(set(re.findall(r"^(?:patching|checking) file (\S+)", dry.stdout, re.M)))
        rows.append((patch.name, "conflicts", ", ".join(files)))
    return rows


def render_report(target: str, about: str, rows: list[tuple[str, str, str]]) -> str:
    """The markdown report: what was checked (`target`, `about`), one table row a patch, the counts."""
    lines = [f"# Rebase check: the series on {target}", "", about, "",
             "| patch | result | details |", "| --- | --- | --- |"]
    lines += [f"| {n} | {r} | {d} |" for n, r, d in rows]
    counts = {r: sum(1 for _, x, _ in rows if x == r) for r in RESULTS}
    lines += ["", ", ".join(f"{v} {k}" for k, v in counts.items())]
    return "\n".join(lines) + "\n"


def _shown(path: Path) -> Path:
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def rebase_check(version: str, *, patches_dir: Path = PATCHES, out_dir: Path = BUILD) -> tuple[str, Path]:
    """Report, per patch, how the series applies to another release's sdist.

    Returns the report and its path.
    """
    patches = read_series(patches_dir)
    sdist = download_sdist(version)
    dest = out_dir / "rebase" / f"vllm-{version}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    log(f"unpacking vLLM {version} into {_shown(dest)}")
    unpack_sdist(sdist, dest)
    rows = classify_series(dest, patches)
    report = render_report(f"vLLM {version}", f"Base of the series: v{BASE_VERSION}; command: "
                           f"`make rebase-check VLLM_VERSION={version}`.", rows)
    path = out_dir / f"rebase-check-{version}.md"
    path.write_text(report)
    return report, path


def rebase_check_git(source: str, ref: str = "main", *, patches_dir: Path = PATCHES, out_dir: Path = BUILD,
                     timeout: float = GIT_TIMEOUT_S) -> tuple[str, Path]:
    """Report, per patch, how the series applies to `ref` of a git repository (URL or path).

    Same classification and report as a release; the header names the
    source, the ref and the commit it resolved to. Returns the report and its path.
    """
    patches = read_series(patches_dir)
    log(f"fetching {ref} from {resolve_source(source)}")
    checkout = fetch_ref(source, ref, out_dir / "rebase" / "git", timeout)
    rows = classify_series(checkout.tree, patches)
    about = (f"Base of the series: v{BASE_VERSION}; command: "
             f"`make rebase-check VLLM_GIT={checkout.source} VLLM_REF={ref}`.\n"
             f"Source: `{checkout.source}`, ref `{ref}`, commit `{checkout.commit}`.")
    report = render_report(f"vLLM git {ref} ({checkout.commit[:12]})", about, rows)
    path = out_dir / f"rebase-check-git-{sanitized_ref(ref)}.md"
    path.write_text(report)
    return report, path
