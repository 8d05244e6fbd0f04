"""make apply / unapply / refresh on real and synthetic vLLM trees."""

import shutil
import subprocess
from pathlib import Path

import pytest

from workbench import series as S
from workbench.tree import DL, PATCHES, ROOT, TREE, unpack_sdist

SDIST = DL / f"vllm-{S.BASE_VERSION}.tar.gz"


def git(tree: Path, *args: str) -> str:
    return S.run(["git", *args], cwd=tree).stdout


def make(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", *args], cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def sdist_tree(tmp_path_factory) -> Path:
    """A freshly unpacked v0.32.0 sdist (copied per test from this one)."""
    if not SDIST.exists():
        pytest.fail(f"{SDIST} missing: run make setup")
    dest = tmp_path_factory.mktemp("sdist") / "vllm-0.32.0"
    unpack_sdist(SDIST, dest)
    return dest


def copy_tree(src: Path, dest: Path, git_init: bool = False) -> Path:
    shutil.copytree(src, dest, symlinks=True)
    if git_init:
        S.run(["git", "init", "-q"], cwd=dest)
        S.run(["git", "add", "-A"], cwd=dest)
        S.run(["git", "commit", "-q", "-m", "v0.32.0"], cwd=dest)
    return dest


def test_apply_plain_sdist_then_already_applied(sdist_tree, tmp_path):
    tree = copy_tree(sdist_tree, tmp_path / "plain")
    first = make("apply", f"VLLM_SRC={tree}")
    assert first.returncode == 0, first.stdout
    assert "as diffs" in first.stdout
    assert "enable_kv_checksum" in (tree / "vllm/config/kv_transfer.py").read_text()
    second = make("apply", f"VLLM_SRC={tree}")
    assert second.returncode == 0, second.stdout
    assert "already applied" in second.stdout
    assert make("unapply", f"VLLM_SRC={tree}").returncode == 0
    assert "enable_kv_checksum" not in (tree / "vllm/config/kv_transfer.py").read_text()


def test_apply_git_checkout_as_commits(sdist_tree, tmp_path):
    tree = copy_tree(sdist_tree, tmp_path / "git", git_init=True)
    result = make("apply", f"VLLM_SRC={tree}")
    assert result.returncode == 0, result.stdout
    subjects = git(tree, "log", "--format=%s").splitlines()
    expected = [p.subject for p in reversed(S.read_series(PATCHES))]
    assert subjects[: len(expected)] == expected
    again = make("apply", f"VLLM_SRC={tree}")
    assert "already applied" in again.stdout
    assert git(tree, "log", "--format=%s").splitlines() == subjects  # not applied twice
    assert make("unapply", f"VLLM_SRC={tree}").returncode == 0
    assert git(tree, "log", "--format=%s").splitlines() == ["v0.32.0"]


def test_wrong_version_refused(sdist_tree, tmp_path):
    tree = copy_tree(sdist_tree, tmp_path / "other")
    pkg = tree / "PKG-INFO"
    pkg.write_text(pkg.read_text().replace("Version: 0.32.0", "Version: 0.33.0", 1))
    result = make("apply", f"VLLM_SRC={tree}")
    assert result.returncode != 0
    assert "is vLLM 0.33.0; the series applies to v0.32.0 only" in result.stdout
    assert "make rebase-check VLLM_VERSION=0.33.0" in result.stdout
    assert "enable_kv_checksum" not in (tree / "vllm/config/kv_transfer.py").read_text()


def test_dirty_git_tree_refused(sdist_tree, tmp_path):
    tree = copy_tree(sdist_tree, tmp_path / "dirty", git_init=True)
    (tree / "vllm/config/kv_transfer.py").write_text("# edited\n")
    result = make("apply", f"VLLM_SRC={tree}")
    assert result.returncode != 0
    assert "uncommitted changes" in result.stdout and "kv_transfer.py" in result.stdout


def test_missing_and_non_vllm_trees_refused(tmp_path):
    assert "usage: make apply" in make("apply").stdout
    (tmp_path / "empty").mkdir()
    result = make("apply", f"VLLM_SRC={tmp_path / 'empty'}")
    assert result.returncode != 0 and "not a vLLM source tree" in result.stdout


# A synthetic tree and series: partial states need more than one patch.

def fake_series(tmp_path: Path) -> tuple[Path, Path]:
    """A v0.32.0-looking tree and a two-patch series made with git."""
    work = tmp_path / "work"
    (work / "vllm").mkdir(parents=True)
    (work / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0\n")
    (work / "vllm" / "__init__.py").write_text("")
    (work / "vllm" / "a.py").write_text("x = 1\n")
    S.init_base_repo(work)
    for i, text in enumerate(["x = 2\n", "x = 3\n"], 1):
        (work / "vllm" / "a.py").write_text(text)
        S.run(["git", "commit", "-q", "-am", f"change {i}"], cwd=work,
              env={"GIT_AUTHOR_DATE": S.BASE_DATE, "GIT_COMMITTER_DATE": S.BASE_DATE})
    patches = tmp_path / "patches"
    patches.mkdir()
    assert S.refresh(work, patches).startswith("refreshed")
    assert S.refresh(work, patches) == "patches/ is current (2 patches)"
    S.run(["git", "reset", "-q", "--hard", S.BASE_TAG], cwd=work)
    shutil.rmtree(work / ".git")
    return work, patches


def test_partial_series_refused(tmp_path):
    tree, patches_dir = fake_series(tmp_path)
    patches = S.read_series(patches_dir)
    assert S.applied_count(tree, patches) == 0
    S.run(["git", "apply", str(patches[0].path)], cwd=tree, env={"GIT_CEILING_DIRECTORIES": str(tmp_path)})
    assert S.applied_count(tree, patches) == 1
    with pytest.raises(S.SeriesError, match=r"partially applied: patches 1\.\.1 are in, 2\.\.2 are not"):
        S.apply_series(tree, patches)
    assert "removed 1 patches" in S.unapply_series(tree, patches)
    assert "applied 2 patches as diffs" in S.apply_series(tree, patches)
    assert (tree / "vllm" / "a.py").read_text() == "x = 3\n"
    assert S.applied_count(tree, patches) == 2
    (tree / "vllm" / "a.py").write_text("x = 42\n")
    with pytest.raises(S.SeriesError, match="matches no prefix"):
        S.apply_series(tree, patches)


def test_refresh_is_deterministic(tmp_path):
    _, patches_dir = fake_series(tmp_path)
    before = {p.name: p.read_bytes() for p in patches_dir.iterdir()}
    assert (patches_dir / "series").read_text().splitlines() == [
        "0001-change-1.patch", "0002-change-2.patch"]
    again = tmp_path / "again"
    _, patches2 = fake_series(again)
    assert {p.name: p.read_bytes() for p in patches2.iterdir()} == before


def test_build_tree_matches_patches():
    """build/vllm is base + patches/, and refreshing it would change nothing."""
    with __import__("tempfile").TemporaryDirectory() as tmp:
        files = S.format_series(TREE, Path(tmp))
        assert [f.name for f in files] == [p.name for p in S.read_series(PATCHES)]
        for f in files:
            assert f.read_bytes() == (PATCHES / f.name).read_bytes(), f.name


def test_quilt_series_file_format():
    # quilt reads patches/series: one name a line, each an existing -p1 patch.
    for patch in S.read_series(PATCHES):
        text = patch.path.read_text()
        assert text.startswith("From 0000000000000000000000000000000000000000 ")
        assert "\ndiff --git a/" in text
        assert patch.tests(), f"{patch.name} names no tests (Tests: trailer)"
