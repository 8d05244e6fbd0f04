"""Real schedulers and workers started with NUMBA_DISABLE_JIT=1 (a common
debugging setting) serve a verified load: the workers' views take the
PyTorch path, with one warning naming the variable, instead of the Numba
pass raising out of the step (issue 41 §3). Runs numba_jit_disabled_load.py
in a process of its own, where the variable is set before numba imports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_load_verifies_with_numba_jit_disabled(tmp_path):
    env = dict(os.environ, NUMBA_DISABLE_JIT="1", NUMBA_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("numba_jit_disabled_load.py"))], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads([x for x in done.stdout.splitlines() if x.startswith("ANSWER ")][-1][len("ANSWER "):])
    assert got["producer"] == {"sent": 1} and got["consumer"] == {"verified": 1}, got
    assert got["next_scheduled"] == 1 and got["paths"] == ["torch"]
    assert len(got["warnings"]) == 1 and "NUMBA_DISABLE_JIT" in got["warnings"][0], got["warnings"]
