"""The vLLM releases the series is carried on, and where each one's files are.

v0.32.0 is the base the series is written on: its CPU wheel gives compiled
ops, so `.venv` imports the patched tree as `vllm` and real engines run
(demo, soak, e2e). v0.34.0 carries the same series (`patches/v0.34.0`, kept in
step by in_step.py); it has no CPU build on the index, so its tree is tested
from `build/venv-0.34.0` with the tree on PYTHONPATH, scheduler and worker
tests only (docs/workbench.md, "Two bases").
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from .series import BASE_VERSION, SeriesError
from .tree import BUILD, PATCHES, ROOT, TREE

DEFAULT = BASE_VERSION


@dataclass(frozen=True)
class Base:
    version: str
    patches: Path  # its series folder
    tree: Path  # the maintainer's checkout: the sdist + the series as commits
    python: Path  # the interpreter its tests run with
    setup: str  # what makes `python` exist
    cpu_wheel: bool  # the release has a CPU wheel: compiled ops, a linked venv, engines

    @property
    def written_on(self) -> bool:
        """The base the series is written on (the others carry it)."""
        return self.version == DEFAULT

    @property
    def test_python(self) -> Path:
        """The interpreter this base's tests run with: for the base the series
        is written on, the workbench's own (it runs in that base's venv)."""
        return Path(sys.executable) if self.written_on else self.python

    def test_env(self, tree: Path | None = None, device: str = "cpu") -> dict[str, str]:
        """Environment for this base's test processes on `tree` (default its
        own), vLLM imported from the tree on PYTHONPATH; a base without a CPU
        wheel also needs the Triton switch (pytest -p triton_switch)."""
        tree = tree or self.tree
        path = [str(tree), str(ROOT)]
        if not self.cpu_wheel:
            path.append(str(Path(__file__).resolve().parent))  # triton_switch
        env = {"KVCS_VLLM_TREE": str(tree), "PYTHONPATH": os.pathsep.join(path), **OFFLINE_HF}
        if device == "cpu":
            # On PYTHONPATH the tree's own vllm.egg-info (from the sdist) shadows
            # the +cpu dist-info that platform detection reads.
            env["VLLM_TARGET_DEVICE"] = "cpu"
        return env

    @property
    def pytest_plugins(self) -> tuple[str, ...]:
        return () if self.cpu_wheel else ("triton_switch",)


# The offline Hugging Face set-up that tests/conftest.py gives the project's tests when unset
# (config-only cache entries, nothing downloaded). Given to their processes from the start,
# because a fork server (zygote.py) imports huggingface_hub and transformers, which read
# these when imported, before any conftest runs.
OFFLINE_HF = {"HF_HOME": str(BUILD / "hf-home"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

BASES = {
    "0.32.0": Base("0.32.0", PATCHES, TREE, ROOT / ".venv" / "bin" / "python", "make setup", True),
    "0.34.0": Base("0.34.0", PATCHES / "v0.34.0", BUILD / "vllm-0.34.0",
                   BUILD / "venv-0.34.0" / "bin" / "python", "make setup-0.34", False),
}


def get_base(version: str | None) -> Base:
    version = version or DEFAULT
    if version not in BASES:
        raise SeriesError(f"the series is carried on vLLM {', '.join(BASES)}, not {version!r}")
    return BASES[version]
