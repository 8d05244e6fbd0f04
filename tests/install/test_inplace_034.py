"""`vllm-kvchecksum apply|undo|status` on vLLM 0.34.0 as pip installs it, and the release table.

The venv is a real one (tests/install/vllm034_venv.py): `python3 -m venv
build/install-venv-0.34` and `pip install --no-deps vllm==0.34.0`, built on
first use and reused; without a package index (no network) these tests are
skipped with that reason. The main test works on the venv's own
site-packages and leaves it as pip installed it (undo, checked by hash); the
refusals work on a hard-linked copy of it, so that a failing test cannot
leave the venv patched. A venv found patched or edited (a run killed half-way)
is put back by undo, or built anew.

What is checked: the installed release picks the series (0.34.0 ->
patches/v0.34.0/), every non-test file of that series is patched and is what
`git apply` makes of it, RECORD verifies after apply and differs from the
wheel's in exactly the series' files, the patched files compile, undo gives
back every byte, re-apply gives the same files; a faked release, the 0.32
series on 0.34, the 0.32.0 release metadata over 0.34's files and a file
changed since the apply are each refused with nothing changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import vllm034_venv
from install_helpers import (ROOT, check_undo_refuses_a_file_changed_since_the_apply, edit, git_apply_reference,
                             record_verifies, run_cli, snapshot)

from vllm_kvchecksum.install import inplace, record
from vllm_kvchecksum.install import series as series_mod
from vllm_kvchecksum.install.series import RELEASES, UnsupportedRelease, default_series

DIST_INFO = vllm034_venv.DIST_INFO
SERIES_034 = ROOT / "patches" / "v0.34.0"


# ----------------------------------------------------------------- the table (no venv)


def test_the_table_names_each_supported_release_and_its_series_folder():
    assert RELEASES == {"0.32.0": "", "0.34.0": "v0.34.0"}
    assert series_mod.supported_releases() == "0.32.0 (patches/), 0.34.0 (patches/v0.34.0/)"
    for release in RELEASES:
        s = default_series(release)
        assert s.release == release
        assert s.where == (ROOT / "patches" / RELEASES[release] if RELEASES[release] else ROOT / "patches")
        listed = [ln.split("#", 1)[0].strip() for ln in (s.where / "series").read_text().splitlines()]
        assert [p.name for p in s.patches] == [n for n in listed if n]
    # The two series differ (0.34 drops three patches and carries the rest): the folder matters.
    assert len(default_series("0.32.0").patches) == 27 and len(default_series("0.34.0").patches) == 24
    assert default_series("0.32.0").digest != default_series("0.34.0").digest


@pytest.mark.parametrize("release", ["0.33.0", "0.31.0", "0.34", "0.34.0rc1", ""])
def test_a_release_the_table_lacks_has_no_series(release):
    with pytest.raises(UnsupportedRelease) as err:
        default_series(release)
    assert f"not {release}:" in str(err.value)
    assert "0.32.0 (patches/), 0.34.0 (patches/v0.34.0/)" in str(err.value)


def test_the_shipped_copy_is_read_before_the_clone_for_each_release(tmp_path, monkeypatch):
    # A shipped root as setup.py lays it out (series folders copied from the clone).
    shipped = tmp_path / "patches"
    shutil.copytree(ROOT / "patches", shipped, ignore=shutil.ignore_patterns("*.txt"))
    monkeypatch.setattr(series_mod, "SHIPPED", shipped)
    assert default_series("0.34.0").where == shipped / "v0.34.0"
    assert default_series("0.32.0").where == shipped
    # A wheel built before 0.34's series was shipped: says so, names the release.
    shutil.rmtree(shipped / "v0.34.0")
    with pytest.raises(series_mod.PatchError, match=r"no series for vLLM 0.34.0 \(patches/v0.34.0/ in a clone\)"):
        default_series("0.34.0")


# ----------------------------------------------------------------- the venv


def _hashes(site: Path, paths) -> dict[str, str | None]:
    return {rel: hashlib.sha256((site / rel).read_bytes()).hexdigest() if (site / rel).exists() else None
            for rel in paths}


def test_apply_status_undo_and_reapply_on_the_pip_installed_0_34(venv034, tmp_path):
    with vllm034_venv.using(exclusive=True):  # no other test process copies the files meanwhile
        _apply_status_undo_reapply(Path(venv034["site"]), venv034, tmp_path)


def _apply_status_undo_reapply(site: Path, venv034: dict, tmp_path: Path) -> None:
    series = default_series("0.34.0")
    assert series.where == SERIES_034
    touched = [*series.runtime_paths(), f"{DIST_INFO}/RECORD", f"{DIST_INFO}/METADATA"]
    before = _hashes(site, touched)
    original_record = {e.path: e for e in record.parse((site / DIST_INFO / "RECORD").read_text())}
    reference = git_apply_reference(site, series, tmp_path)
    try:
        out = run_cli("status", "--site", str(site))
        assert out.returncode == 0, out.stderr
        assert f"vLLM: vllm 0.34.0 in {site.resolve()}" in out.stdout
        assert f"series: the series for vLLM 0.34.0 (24 patches from {SERIES_034}, {series.local_version})" \
            in out.stdout
        assert "state: not applied" in out.stdout

        t0 = time.monotonic()
        out = run_cli("apply", "--site", str(site))
        apply_s = time.monotonic() - t0
        assert out.returncode == 0, out.stderr
        assert f"applied the series for vLLM 0.34.0 (24 patches from {SERIES_034}" in out.stdout
        state = json.loads((site / DIST_INFO / "kvchecksum" / "state.json").read_text())
        assert state["series_release"] == "0.34.0" and state["series_from"] == str(SERIES_034)
        # Every non-test file of the 0.34 series, and nothing else, is patched: as git apply makes it.
        assert sorted([*state["changed"], *state["added"]]) == series.runtime_paths()
        assert {rel: (site / rel).read_bytes() for rel in series.runtime_paths()} == reference
        for rel in series.runtime_paths():
            assert f"  {rel}\n" in out.stdout
        # RECORD, pip's way: the new one verifies; against the wheel's, exactly the series' files differ
        # (changed) or are new (added).
        assert record_verifies(site, DIST_INFO) == []
        differ = sorted(rel for rel, e in original_record.items() if e.hash and not rel.endswith(".pyc")
                        and not rel.startswith("../")
                        and not ((site / rel).is_file() and record.matches(e, (site / rel).read_bytes())))
        assert differ == sorted(state["changed"])
        listed = {e.path for e in record.parse((site / DIST_INFO / "RECORD").read_text())}
        assert sorted(listed - set(original_record)) == sorted(
            [*state["added"], *(f"{DIST_INFO}/kvchecksum/{p}" for p in
                                ("RECORD.orig", "state.json", *(f"orig/{r}" for r in state["changed"])))])
        assert list(state["added"]) == ["vllm/distributed/kv_transfer/kv_connector/v1/mooncake/store/kv_checksums.py"]
        # The patched files are Python the venv's interpreter compiles (no bytecode written).
        code = ("import sys\nfor p in sys.argv[1:]:\n    compile(open(p, 'rb').read(), p, 'exec')\n"
                "print('compiled', len(sys.argv) - 1)")
        result = subprocess.run([str(vllm034_venv.VENV / "bin" / "python"), "-c", code,
                                 *(str(site / r) for r in series.runtime_paths())], capture_output=True, text=True)
        assert result.returncode == 0 and f"compiled {len(series.runtime_paths())}" in result.stdout, result.stderr

        out = run_cli("status", "--site", str(site))
        assert out.returncode == 0, out.stdout
        assert f"state: applied in place on {state['applied_at']}: series {series.local_version} for vLLM 0.34.0 " \
            f"from {SERIES_034}" in out.stdout
        assert "every file is as the series left it" in out.stdout
        out = run_cli("apply", "--site", str(site))
        assert out.returncode == 0 and "already applied" in out.stdout and "for vLLM 0.34.0" in out.stdout
        patched = _hashes(site, series.runtime_paths())

        t0 = time.monotonic()
        out = run_cli("undo", "--site", str(site))
        undo_s = time.monotonic() - t0
        assert out.returncode == 0, out.stderr
        assert f"series {series.local_version} for vLLM 0.34.0" in out.stdout
        assert _hashes(site, touched) == before
        assert not (site / DIST_INFO / "kvchecksum").exists()

        # Again: the same files, and back again.
        out = run_cli("apply", "--site", str(site))
        assert out.returncode == 0, out.stderr
        assert _hashes(site, series.runtime_paths()) == patched
        out = run_cli("undo", "--site", str(site))
        assert out.returncode == 0, out.stderr
        assert _hashes(site, touched) == before
        print(f"\n[0.34 in place] {len(series.runtime_paths())} files; apply {apply_s:.1f} s, undo {undo_s:.1f} s; "
              f"venv: {venv034}")
    finally:
        # Never leave the reused venv patched, whatever failed above.
        if (site / DIST_INFO / "kvchecksum").exists():
            run_cli("undo", "--site", str(site))
    assert vllm034_venv.pristine(site)


def test_another_release_is_refused_and_status_names_the_supported_ones(site_copy):
    meta = site_copy / DIST_INFO / "METADATA"
    edit(meta, meta.read_bytes().replace(b"\nVersion: 0.34.0\n", b"\nVersion: 0.33.0\n", 1))
    before = snapshot(site_copy)
    out = run_cli("apply", "--site", str(site_copy))
    assert out.returncode == 2, out.stdout
    assert "vllm-kvchecksum apply: error: vllm 0.33.0 in" in out.stderr
    assert "has a series for vLLM 0.32.0, 0.34.0 only, not 0.33.0: 0.32.0 (patches/), 0.34.0 " \
        "(patches/v0.34.0/)" in out.stderr
    assert "make rebase-check VLLM_VERSION=0.33.0" in out.stderr
    out = run_cli("status", "--site", str(site_copy))
    assert out.returncode == 0
    assert "series: none for vLLM 0.33.0; vllm-kvchecksum has one for 0.32.0 (patches/), 0.34.0 " \
        "(patches/v0.34.0/)" in out.stdout
    assert "state: not applied (no series for 0.33.0: apply refuses it)" in out.stdout
    assert snapshot(site_copy) == before


def test_0_34_files_that_say_they_are_0_32_get_the_0_32_series_which_does_not_apply(site_copy):
    # The table picks by the release the metadata says: the 0.32 series, whose hunks do not match 0.34's files.
    meta = site_copy / DIST_INFO / "METADATA"
    edit(meta, meta.read_bytes().replace(b"\nVersion: 0.34.0\n", b"\nVersion: 0.32.0\n", 1))
    before = snapshot(site_copy)
    out = run_cli("apply", "--site", str(site_copy))
    assert out.returncode == 2
    assert "the series does not apply to vllm 0.32.0" in out.stderr and "Nothing was changed" in out.stderr
    assert snapshot(site_copy) == before


def test_the_0_32_series_on_0_34_is_refused_before_anything_is_read(site_copy):
    before = snapshot(site_copy)
    with pytest.raises(inplace.InstallError) as err:
        inplace.apply(inplace.find_install(site_copy), default_series("0.32.0"))
    assert "the series for vLLM 0.32.0 (27 patches" in str(err.value)
    assert "is not the one for vLLM 0.34.0 (patches/v0.34.0/)" in str(err.value)
    assert snapshot(site_copy) == before
    # The same folder named by hand (--patches) is tried, and fails on 0.34's files, nothing written.
    out = run_cli("apply", "--site", str(site_copy), "--patches", str(ROOT / "patches"))
    assert out.returncode == 2 and "does not apply" in out.stderr
    assert snapshot(site_copy) == before


def test_undo_refuses_a_file_changed_since_the_apply_on_0_34(site_copy):
    before = snapshot(site_copy)
    out = run_cli("apply", "--site", str(site_copy))
    assert out.returncode == 0, out.stderr
    rel = "vllm/v1/worker/gpu/kv_connector.py"  # Model Runner V2's connector glue: 0.34's own hook file
    assert rel in default_series("0.34.0").runtime_paths()
    check_undo_refuses_a_file_changed_since_the_apply(site_copy, rel, before)


def test_a_0_34_file_edited_since_install_is_refused(site_copy):
    rel = "vllm/v1/core/sched/scheduler.py"
    # A line above the first hunk's context: the diffs still apply, but undo could not give back pip's file.
    edit(site_copy / rel, b"# edited by hand\n" + (site_copy / rel).read_bytes())
    before = snapshot(site_copy)
    out = run_cli("apply", "--site", str(site_copy))
    assert out.returncode == 2 and "differ from the wheel's RECORD" in out.stderr and rel in out.stderr
    assert "pip install --force-reinstall --no-deps vllm==0.34.0" in out.stderr
    assert snapshot(site_copy) == before
