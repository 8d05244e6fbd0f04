"""`vllm-kvchecksum`: apply the series to an installed vLLM in place, undo it, or say where it stands.

The installed vLLM's release picks the series (series.RELEASES): 0.32.0 ->
patches/, 0.34.0 -> patches/v0.34.0/ (the wheel's shipped copies of them);
any other release is refused.

    vllm-kvchecksum status [--site DIR]
    vllm-kvchecksum apply  [--site DIR] [--dry-run] [--patches DIR]
    vllm-kvchecksum undo   [--site DIR] [--dry-run]

Exit status: 0 done (or nothing to do), 1 status found files changed by
someone else, 2 refused (the message says why; nothing was changed).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import inplace
from .diffs import PatchError
from .series import read_series, supported_releases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="vllm-kvchecksum", description="The vllm-kvchecksum patch series on an installed vLLM "
        f"(docs/install.md), the series picked by its release: {supported_releases()}. Apply it in place, all "
        "or nothing; undo it, back to the files pip installed.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    site_help = ("the site-packages directory that holds vllm/ (default: the one this Python imports vllm from, "
                 "found without importing it)")
    p = sub.add_parser("apply", help="apply the series' non-test diffs to the installed vllm/ (all or nothing)")
    p.add_argument("--site", type=Path, help=site_help)
    p.add_argument("--dry-run", action="store_true", help="check that it applies and list the files; write nothing")
    p.add_argument("--patches", type=Path, help="a series directory (a `series` file and its patches) instead of "
                   "the one this package ships for the installed release")
    p = sub.add_parser("undo", help="restore the files pip installed, checked against the wheel's RECORD")
    p.add_argument("--site", type=Path, help=site_help)
    p.add_argument("--dry-run", action="store_true", help="check that undo can run and list the files; write nothing")
    p = sub.add_parser("status", help="the installed vLLM, the series for its release, and whether it is applied "
                       "and intact")
    p.add_argument("--site", type=Path, help=site_help)
    args = parser.parse_args(argv)
    try:
        inst = inplace.find_install(args.site.resolve() if args.site else None)
        if args.cmd == "apply":
            series = read_series(args.patches.resolve()) if args.patches else inplace.series_for(inst)
            outcome = inplace.apply(inst, series, dry_run=args.dry_run)
        elif args.cmd == "undo":
            outcome = inplace.undo(inst, dry_run=args.dry_run)
        else:
            outcome = inplace.status(inst)
    except (inplace.InstallError, PatchError) as exc:
        print(f"vllm-kvchecksum {args.cmd}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        # A write that failed (permissions, a full disk): apply and undo put back what they wrote.
        print(f"vllm-kvchecksum {args.cmd}: error while writing: {exc}. The files written before it were put "
              "back; nothing was changed. Run it as the user that owns the environment, with space on its disk.",
              file=sys.stderr)
        return 2
    print(outcome.text.rstrip())
    return outcome.code


if __name__ == "__main__":
    sys.exit(main())
