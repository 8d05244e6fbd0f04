"""Build hook of the vllm-kvchecksum wheel (the rest of the metadata is in pyproject.toml).

The wheel ships the patch series as package data: `patches/series` and every
patch it lists are copied into vllm_kvchecksum/install/patches/ of the build,
and so is each release's own series folder under patches/ (`v0.34.0/series`
and its patches: every subfolder with a `series` file), so `vllm-kvchecksum
apply` needs nothing but the wheel, whichever supported vLLM it patches. An
editable install (`make setup`) copies nothing: the package then reads the
clone's patches/.
"""

import hashlib
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
BASE_VERSION = "0.1.0"


def series_dirs() -> list[str]:
    """The series folders, relative to patches/: "" (v0.32.0's) and each subfolder with a `series` file."""
    root = HERE / "patches"
    return [""] + sorted(d.name for d in root.iterdir() if d.is_dir() and (d / "series").is_file())


def series_names(sub: str = "") -> list[str]:
    series = HERE / "patches" / sub / "series"
    if not series.is_file():
        raise SystemExit(f"{series} is missing: build the wheel from a clone of vllm-kvchecksum (make wheels)")
    names = [line.split("#", 1)[0].strip() for line in series.read_text().splitlines()]
    return [n for n in names if n]


def version() -> str:
    """BASE_VERSION+kvchecksum.s<12 hex digits>: the v0.32.0 series' digest as vllm_kvchecksum.install.series
    computes it (names and bytes, in order), so the helper and the patched vLLM wheel (built for v0.32.0
    only) carry one label."""
    h = hashlib.sha256()
    for name in series_names():
        h.update(name.encode() + b"\0" + (HERE / "patches" / name).read_bytes() + b"\0")
    return f"{BASE_VERSION}+kvchecksum.s{h.hexdigest()[:12]}"


class BuildPyWithSeries(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        root = Path(self.build_lib) / "vllm_kvchecksum" / "install" / "patches"
        shutil.rmtree(root, ignore_errors=True)
        for sub in series_dirs():
            src = HERE / "patches" / sub
            dest = root / sub
            dest.mkdir(parents=True, exist_ok=True)
            for name in ["series", *series_names(sub)]:
                if not (src / name).is_file():
                    raise SystemExit(f"{src / 'series'} lists {name}, which is not in {src}")
                (dest / name).write_bytes((src / name).read_bytes())


setup(version=version(), cmdclass={"build_py": BuildPyWithSeries})
