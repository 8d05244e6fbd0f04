"""Command line of the workbench; the Makefile's targets call it.

    python -m workbench prepare [--device cpu|cuda] [--force] [--base 0.32.0|0.34.0]
    python -m workbench apply DIR | unapply DIR | state DIR
    python -m workbench refresh [--base 0.32.0|0.34.0]
    python -m workbench in-step [--record]
    python -m workbench pytest [--base 0.34.0] -- PYTEST_ARGS
    python -m workbench check-series [--device cpu|cuda] [--jobs N]
    python -m workbench rebase-check VERSION | --git URL_OR_PATH [--ref REF]
    python -m workbench upstream [--base 0.32.0|0.34.0] [--record] [--jobs N] [--tree DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .series import SeriesError, applied_count, apply_series, read_series, refresh, unapply_series
from .gitsource import GIT_TIMEOUT_S
from .tree import BUILD, PATCHES, TREE, download_sdist, download_wheel, log, sync_tree


def cmd_prepare(args) -> int:
    from .bases import get_base
    from .runtime import DEVICE_WHEELS, install_ops, link_tree
    from .upstream import write_hf_cache

    base = get_base(args.base)
    if not base.cpu_wheel:
        # No compiled ops to take and no venv to link: its tests put the tree on PYTHONPATH.
        log(sync_tree(base.tree, force=args.force, patches_dir=base.patches, version=base.version))
        write_hf_cache()
        return 0

    wheel = download_wheel(DEVICE_WHEELS[args.device]["dist"])
    log(sync_tree(TREE, force=args.force, wheel=wheel))
    taken = install_ops(wheel, download_sdist(), TREE)
    log(f"took {len(taken)} build-only files from {wheel.name}: "
        + ", ".join(n for n in taken if n.endswith(".so")))
    link_tree(TREE, args.device, wheel)
    log(f"`import vllm` now loads {TREE}/vllm (dist version {DEVICE_WHEELS[args.device]['version']})")
    write_hf_cache()
    return 0


def cmd_apply(args) -> int:
    print(apply_series(Path(args.dir), read_series(PATCHES)))
    return 0


def cmd_unapply(args) -> int:
    print(unapply_series(Path(args.dir), read_series(PATCHES)))
    return 0


def cmd_state(args) -> int:
    patches = read_series(PATCHES)
    count = applied_count(Path(args.dir).resolve(), patches)
    print("matches no prefix of the series" if count is None else f"{count} of {len(patches)} patches applied")
    return 0


def cmd_refresh(args) -> int:
    from .bases import get_base

    base = get_base(args.base)
    print(refresh(base.tree, base.patches))
    return 0


def cmd_pytest(args) -> int:
    """pytest on a base's tree, as that base runs its tests (bases.Base.test_env)."""
    import os
    import subprocess

    from .bases import get_base

    spec = get_base(args.base)
    for need in (spec.test_python, spec.tree / "vllm" / "__init__.py"):
        if not need.exists():
            raise SeriesError(f"{need} is missing: run `{spec.setup}`")
    pytest_args = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
    cmd = [str(spec.test_python), "-m", "pytest", *(f"-p{p}" for p in spec.pytest_plugins), *pytest_args]
    return subprocess.run(cmd, cwd=PATCHES.parent, env=dict(os.environ, **spec.test_env())).returncode


def cmd_in_step(args) -> int:
    from .bases import BASES, DEFAULT
    from .in_step import check, record

    failed = 0
    for base in BASES.values():
        if base.version == DEFAULT:
            continue
        if args.record:
            print(record(PATCHES, base.patches))
        problems = check(PATCHES, base.patches)
        for problem in problems:
            print(f"v{base.version}: {problem}")
        if not problems:
            print(f"v{base.version}: in step with v{DEFAULT} ({base.patches.relative_to(PATCHES.parent)})")
        failed |= bool(problems)
    return 1 if failed else 0


def cmd_check_series(args) -> int:
    from .checks import check_series

    return check_series(args.device, jobs=args.jobs, base=args.base)


def cmd_rebase_check(args) -> int:
    from .checks import rebase_check, rebase_check_git

    from .bases import BASES

    patches = args.patches
    if patches is None:
        # A release the series is carried on is checked with its own series.
        patches = BASES[args.version].patches if args.version in BASES else PATCHES
    where = {"patches_dir": patches.resolve(), "out_dir": args.out.resolve()}
    if args.git is None:
        if not args.version or args.ref is not None:
            raise SeriesError("rebase-check needs a release VERSION (e.g. 0.34.0), or --git URL_OR_PATH "
                              "with an optional --ref (default main); --ref goes with --git only")
        report, path = rebase_check(args.version, **where)
    elif args.version:
        raise SeriesError(f"rebase-check takes a release VERSION or --git, not both "
                          f"(got {args.version} and --git {args.git})")
    else:
        report, path = rebase_check_git(args.git, args.ref or "main", timeout=args.timeout, **where)
    print(report)
    print(f"(written to {path})")
    return 0


def cmd_upstream(args) -> int:
    from .upstream import run_gate

    return run_gate(record=args.record, jobs=args.jobs, tree=Path(args.tree) if args.tree else None,
                    only=args.only, base=args.base)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="workbench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    base_help = ("the vLLM release: 0.32.0 (default: patches/, build/vllm) or 0.34.0 "
                 "(patches/v0.34.0, build/vllm-0.34.0)")
    p = sub.add_parser("prepare", help="build/vllm = base + series, importable as vllm")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--force", action="store_true", help="reset build/vllm to patches/ (backup branch kept)")
    p.add_argument("--base", default=None, metavar="VERSION", help=base_help)
    p.set_defaults(func=cmd_prepare)
    for name, func in (("apply", cmd_apply), ("unapply", cmd_unapply), ("state", cmd_state)):
        p = sub.add_parser(name)
        p.add_argument("dir", help="a vLLM v0.32.0 source tree (git checkout or unpacked sdist)")
        p.set_defaults(func=func)
    p = sub.add_parser("refresh", help="rewrite patches/ from build/vllm")
    p.add_argument("--base", default=None, metavar="VERSION", help=base_help)
    p.set_defaults(func=cmd_refresh)
    p = sub.add_parser("pytest", help="pytest on a base's patched tree, with its venv and settings")
    p.add_argument("--base", default=None, metavar="VERSION", help=base_help)
    p.add_argument("pytest_args", nargs=argparse.REMAINDER, help="pytest's arguments (after --)")
    p.set_defaults(func=cmd_pytest)
    p = sub.add_parser("in-step", help="the series on each other base is in step with v0.32.0")
    p.add_argument("--record", action="store_true", help="record the current digests first (after porting)")
    p.set_defaults(func=cmd_in_step)
    p = sub.add_parser("check-series", help="every prefix applies, imports, passes its tests")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--jobs", type=positive_int, default=2,
                   help="prefixes checked at a time, each in a worktree of its own (default 2)")
    p.add_argument("--base", default=None, metavar="VERSION", help=base_help)
    p.set_defaults(func=cmd_check_series)
    p = sub.add_parser("rebase-check", help="how the series applies to another release or a git ref")
    p.add_argument("version", nargs="?", help="a vLLM release on PyPI, e.g. 0.34.0")
    p.add_argument("--git", metavar="URL_OR_PATH", help="a vLLM git repository to check against instead")
    p.add_argument("--ref", help="branch, tag or full commit sha of --git (default main)")
    p.add_argument("--timeout", type=float, default=GIT_TIMEOUT_S,
                   help=f"seconds each git command may take (default {GIT_TIMEOUT_S:g})")
    p.add_argument("--patches", type=Path, default=None,
                   help="the series directory (default: the series carried on VERSION if there is one, "
                        "e.g. patches/v0.34.0 for 0.34.0, else patches/)")
    p.add_argument("--out", type=Path, default=BUILD, help="where the report and trees go (default build/)")
    p.set_defaults(func=cmd_rebase_check)
    p = sub.add_parser("upstream", help="the upstream regression gate")
    p.add_argument("--base", default="0.32.0", metavar="VERSION",
                   help="the vLLM release whose gate lists and venv to use: 0.32.0 (default: tests/upstream/, "
                        ".venv) or 0.34.0 (tests/upstream/v0.34.0/, build/venv-0.34.0)")
    p.add_argument("--record", action="store_true", help="record the baseline (run on the unpatched base)")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--tree", help="vLLM tree to test (default: build/vllm for 0.32.0; with --record the "
                                  "unpatched base; 0.34.0 without --record needs it)")
    p.add_argument("--only", nargs="*", help="only these gate files")
    p.set_defaults(func=cmd_upstream)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except SeriesError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
