"""Series checks: bisectability on the base, and how it fares on newer releases or a git ref."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from .gitsource import GIT_TIMEOUT_S, fetch_ref, resolve_source, sanitized_ref
from .lanes import LaneRunner, render
from .series import BASE_VERSION, Patch, SeriesError, read_series, run
from .tree import BUILD, PATCHES, ROOT, base_worktree, download_sdist, log, unpack_sdist


def check_series(device: str = "cpu", pytest_args: list[str] | None = None, jobs: int = 2,
                 base: str | None = None) -> int:
    """Every prefix of the series applies, imports what it patches and passes the tests
    its patch names; checked `jobs` at a time in worktrees of their own (lanes.py).

    base: the vLLM release (bases.py; default v0.32.0). A base without a CPU
    wheel (0.34.0) runs with its own venv, the tree on PYTHONPATH, the Triton
    switch, and without the tests that need vLLM's CPU runtime.
    """
    from .bases import get_base

    spec = get_base(base)
    patches = read_series(spec.patches)
    if not patches:
        raise SeriesError(f"{spec.patches}/series is empty")
    suffix = "" if spec.written_on else f"-{spec.version}"

    def worktree(lane: int) -> Path:
        name = f"check-series{suffix}" + ("" if lane == 0 else f"-{lane + 1}")
        return base_worktree(BUILD / name, device, tree=spec.tree, with_ops=spec.cpu_wheel)

    def env_for(wt: Path) -> dict:
        return dict(os.environ, **spec.test_env(wt, device))

    args = [*(f"-p{plugin}" for plugin in spec.pytest_plugins), *(pytest_args or [])]
    if not spec.cpu_wheel:
        args += ["-m", "not e2e"]  # no engine on this base; cpu_runtime tests skip themselves
    outcome = LaneRunner(patches, worktree, env_for, root=ROOT, jobs=jobs, pytest_args=args,
                         python=str(spec.test_python),
                         timings_path=BUILD / f"check-series{suffix}-timings.json",
                         log_dir=BUILD / f"check-series{suffix}-logs").run()
    print(render(outcome), flush=True)
    if outcome.failures:
        print("\ncheck-series FAILED:\n" + "\n".join(r.failure for r in outcome.failures), flush=True)
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
