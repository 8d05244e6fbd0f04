import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from workbench import series as S  # noqa: E402  (needs scripts/ on sys.path)


def write_files(tree: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(text)


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
        for subject, files in edits:
            write_files(work, files)
            S.run(["git", "add", "-A"], cwd=work)
            # Fixed dates: the same edits give the same patch files.
            S.run(["git", "commit", "-q", "-m", subject], cwd=work,
                  env={"GIT_AUTHOR_DATE": S.BASE_DATE, "GIT_COMMITTER_DATE": S.BASE_DATE})
        patches = tmp_path / "patches"
        patches.mkdir()
        S.refresh(work, patches)
        S.run(["git", "reset", "-q", "--hard", S.BASE_TAG], cwd=work)
        shutil.rmtree(work / ".git")
        return work, patches

    return build
