"""Build hook of the vllm-kvchecksum wheel (the rest of the metadata is in pyproject.toml).

The wheel ships the patch series as package data: `patches/series` and every
patch it lists are copied into vllm_kvchecksum/install/patches/ of the build,
so `vllm-kvchecksum apply` needs nothing but the wheel. An editable install
(`make setup`) copies nothing: the package then reads the clone's patches/.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


class BuildPyWithSeries(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        src = HERE / "patches"
        series = src / "series"
        if not series.is_file():
            raise SystemExit(f"{series} is missing: build the wheel from a clone of vllm-kvchecksum (make wheels)")
        names = [line.split("#", 1)[0].strip() for line in series.read_text().splitlines()]
        names = [n for n in names if n]
        dest = Path(self.build_lib) / "vllm_kvchecksum" / "install" / "patches"
        dest.mkdir(parents=True, exist_ok=True)
        for old in dest.iterdir():
            old.unlink()
        for name in ["series", *names]:
            if not (src / name).is_file():
                raise SystemExit(f"{series} lists {name}, which is not in {src}")
            (dest / name).write_bytes((src / name).read_bytes())


setup(cmdclass={"build_py": BuildPyWithSeries})
