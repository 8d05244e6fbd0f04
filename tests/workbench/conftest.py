import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from series_building import commit_series, write_files  # noqa: E402  (needs scripts/ on sys.path)
from workbench import series as S  # noqa: E402


@pytest.fixture
def synthetic_series(tmp_path):
    """Build a v0.32.0-looking plain tree and a series on it, the way `make refresh` writes patches/.

    Call it with the base files {path: text} and the edits, one patch each,
    as [(subject, {path: new text})]; it returns (tree, patches dir), both
    under tmp_path, the tree without the patches.
    """
    def build(base: dict[str, str], edits: list[tuple[str, dict[str, str]]]) -> tuple[Path, Path]:
        work = tmp_path / "work"
        write_files(work, {"PKG-INFO": "Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0\n",
                           "vllm/__init__.py": "", **base})
        S.init_base_repo(work)
        patches = tmp_path / "patches"
        commit_series(work, edits, patches)
        shutil.rmtree(work / ".git")
        return work, patches

    return build
