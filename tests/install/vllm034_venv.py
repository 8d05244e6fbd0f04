"""A venv of its own with vLLM 0.34.0 as pip installs it, for the in-place tests on 0.34.

    build/install-venv-0.34/   python3 -m venv + pip install --no-deps vllm==0.34.0

Only the wheel (no torch, no dependencies): `vllm-kvchecksum` imports nothing
from vLLM, so what it works on is the files and the dist-info pip wrote. This
is not the 0.34 workbench (build/venv-0.34.0, `make setup-0.34`), which this
never touches.

Built once and reused: a stamp (`.kvcs-install-venv.json`, the vLLM version,
how long the build took and its size) is written last, so a venv without it
(a build cut short) is built anew. A lock keeps two test processes (pytest -n)
from building it at once; another (`using`) keeps a test from copying or
checking the venv's files while a test in another process patches them. Run directly (`python tests/install/vllm034_venv.py`)
it builds the venv, or says it is there, and prints the stamp.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VERSION = "0.34.0"
VENV = ROOT / "build" / "install-venv-0.34"
STAMP = VENV / ".kvcs-install-venv.json"
DIST_INFO = f"vllm-{VERSION}.dist-info"
LOCK = ROOT / "build" / ".install-venv-0.34.lock"
# Held shared by a test that reads the venv's files (copies them), exclusive by one that patches them in place.
USE_LOCK = ROOT / "build" / ".install-venv-0.34.use.lock"
# pip's words for an index it cannot reach (no network): the test is skipped, not failed, then.
OFFLINE = ("NewConnectionError", "Temporary failure in name resolution", "Network is unreachable",
           "Failed to establish a new connection", "ProxyError", "ConnectTimeoutError", "Max retries exceeded",
           "No route to host")


class VenvUnavailable(Exception):
    """The venv could not be built because the package index cannot be reached (no network)."""


def site_packages(venv: Path = VENV) -> Path:
    (site,) = (venv / "lib").glob("python3.*/site-packages")
    return site


@contextlib.contextmanager
def using(exclusive: bool):
    """Hold the venv's files: shared to read or copy them, exclusive to patch them in place."""
    USE_LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(USE_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield


def _size(path: Path) -> int:
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() or p.is_symlink())


def _run(cmd: list[str], what: str) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        out = result.stdout + result.stderr
        if any(word in out for word in OFFLINE):
            raise VenvUnavailable(f"{what} failed: the package index cannot be reached (no network?):\n{out[-2000:]}")
        raise RuntimeError(f"{what} failed ({' '.join(cmd)}):\n{out[-4000:]}")


def pristine(site: Path) -> bool:
    """As pip installed it: no state of an apply, the version, every file RECORD lists (bytecode aside) as it
    says."""
    from install_helpers import record_verifies

    return (not (site / DIST_INFO / "kvchecksum").exists()
            and (site / DIST_INFO / "METADATA").read_text().count(f"\nVersion: {VERSION}\n") == 1
            and record_verifies(site, DIST_INFO) == [])


def read_stamp() -> dict | None:
    try:
        stamp = json.loads(STAMP.read_text())
    except (OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) and stamp.get("vllm") == VERSION else None


def ensure_venv() -> dict:
    """The venv, built if it is not there yet; its stamp (with `site`, the site-packages path)."""
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stamp = read_stamp()
        if stamp is None:
            stamp = _build()
    return {**stamp, "site": str(site_packages())}


def _build() -> dict:
    if VENV.exists():
        # Only ever our own venv (a pyvenv.cfg) or an empty folder.
        if not (VENV / "pyvenv.cfg").exists() and any(VENV.iterdir()):
            raise RuntimeError(f"{VENV} is not a virtualenv and not empty; move it away")
        shutil.rmtree(VENV)
    t0 = time.monotonic()
    # The interpreter this venv was made from (the same Python .venv runs), not .venv itself.
    base = Path(sys.base_prefix) / "bin" / "python3"
    _run([str(base if base.exists() else sys.executable), "-m", "venv", str(VENV)], f"python3 -m venv {VENV}")
    t1 = time.monotonic()
    py = VENV / "bin" / "python"
    _run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check", f"vllm=={VERSION}"],
         f"pip install --no-deps vllm=={VERSION} into {VENV}")
    t2 = time.monotonic()
    site = site_packages()
    stamp = {"vllm": VERSION, "venv_seconds": round(t1 - t0, 1), "pip_install_seconds": round(t2 - t1, 1),
             "venv_bytes": _size(VENV), "vllm_package_bytes": _size(site / "vllm"),
             "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    tmp = STAMP.with_name(STAMP.name + ".tmp")
    tmp.write_text(json.dumps(stamp, indent=1) + "\n")
    os.replace(tmp, STAMP)
    return stamp


if __name__ == "__main__":
    try:
        print(json.dumps(ensure_venv(), indent=1))
    except VenvUnavailable as exc:
        print(exc, file=sys.stderr)
        sys.exit(1)
