"""Run `python -m kvcs_demo` to its end, for the e2e tests of the demo's modes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_demo(args: list[str], out: Path, timeout: int, report_name: str = "report.json", module: str = "kvcs_demo"):
    """`python -m MODULE ARGS --out OUT` to its end (the demo, or the soak);
    (process, the report OUT/report_name)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "scripts"), HF_HUB_OFFLINE="1")
    proc = subprocess.Popen([sys.executable, "-m", module, *args, "--out", str(out)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except BaseException:
        # SIGTERM, not SIGKILL: the demo then stops every server it started
        # (they run in process groups of their own and would outlive a kill).
        proc.terminate()
        try:
            proc.communicate(timeout=90)
        finally:
            proc.kill()
        raise
    print(stdout[-6000:])
    print(stderr[-3000:], file=sys.stderr)
    report_path = out / report_name
    assert report_path.exists(), f"no report (exit {proc.returncode}):\n{stdout[-3000:]}\n{stderr[-3000:]}"
    return proc, json.loads(report_path.read_text())


def processes_left(process_groups) -> list[str]:
    """The live processes of these process groups, described (zombies aside: they
    hold no resources and wait for init to reap them)."""
    process_groups = set(process_groups)
    left = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        state, pgrp = fields[0], int(fields[2])
        if pgrp in process_groups and state != "Z":
            left.append(f"pid {stat.parent.name} of group {pgrp}")
    return left
