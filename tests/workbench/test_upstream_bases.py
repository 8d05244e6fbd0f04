"""The upstream gate's bases (v0.32.0, the default, and v0.34.0), the Triton
switch of the 0.34 test processes, and ci/setup-0.34.sh's stamp.

Real files throughout: the repository's gate lists, the setup script run in a
subprocess, throwaway source trees. What needs build/venv-0.34.0 (`make
setup-0.34`, 5.5 GB) is skipped where it has not been built."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from workbench import upstream as U
from workbench.series import SeriesError

ROOT = Path(__file__).resolve().parents[2]
SETUP_034 = ROOT / "ci" / "setup-0.34.sh"
VENV_034_PY = ROOT / "build" / "venv-0.34.0" / "bin" / "python"
needs_venv_034 = pytest.mark.skipif(not VENV_034_PY.is_file(), reason="build/venv-0.34.0 not built (make setup-0.34)")


def comments(path: Path) -> str:
    return "\n".join(ln for ln in path.read_text().splitlines() if ln.lstrip().startswith("#"))


# --- base selection -----------------------------------------------------------

def test_the_default_base_is_todays_gate():
    base = U.get_base(None)
    assert base is U.get_base("0.32.0") and base.version == "0.32.0"
    # The v0.32.0 files stay where they were.
    assert (base.gate_files_path, base.baseline_path, base.flaky_path) == (U.GATE_FILES, U.BASELINE, U.FLAKY)
    assert base.gate_files_path == ROOT / "tests" / "upstream" / "gate-files.txt"
    assert base.out == ROOT / "build" / "upstream"
    # Its tests run with the Python running the workbench (.venv), as before.
    cmd = U.pytest_command("tests/x.py")
    assert cmd[0] == sys.executable and "triton_switch" not in cmd
    assert cmd == [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "outcomes_plugin",
                   "-p", "gc_freeze", "-p", "no:randomly", f"--timeout={U.TEST_TIMEOUT_S}", "tests/x.py"]
    path = U.gate_env(Path("/t")).get("PYTHONPATH").split(os.pathsep)
    assert path == ["/t", str(ROOT / "scripts" / "workbench"), str(U.SITE_HOOKS), str(U.GATE_SITE)]


def test_the_034_base_has_its_own_lists_venv_and_switch():
    base = U.get_base("0.34.0")
    assert base.dir == ROOT / "tests" / "upstream" / "v0.34.0"
    for path in (base.gate_files_path, base.baseline_path, base.flaky_path):
        assert path.is_file(), path
    assert base.python == ROOT / "build" / "venv-0.34.0" / "bin" / "python"
    assert base.out == ROOT / "build" / "upstream-0.34.0"
    cmd = U.pytest_command("tests/x.py", base)
    assert cmd[0] == str(base.python)
    assert cmd[cmd.index("triton_switch") - 1] == "-p"
    # Both bases' gate (baseline and patched runs alike) freeze what collection imported.
    assert cmd[cmd.index("gc_freeze") - 1] == "-p"
    # No torchvision hook nor gate-only packages: its venv's torchvision loads.
    path = U.gate_env(Path("/t"), base)["PYTHONPATH"].split(os.pathsep)
    assert path == ["/t", str(ROOT / "scripts" / "workbench")]


def test_an_unknown_base_is_refused_naming_the_known_ones():
    with pytest.raises(SeriesError, match=r"'0\.33\.0'.*0\.32\.0, 0\.34\.0"):
        U.get_base("0.33.0")
    proc = subprocess.run([sys.executable, "-m", "workbench", "upstream", "--base", "0.33.0"],
                          cwd=ROOT / "scripts", capture_output=True, text=True)
    assert proc.returncode == 2 and "no upstream gate for vLLM '0.33.0'" in proc.stderr


# --- the file lists per base ---------------------------------------------------

def test_034_gate_files_are_032s_less_the_gone_one_plus_model_runner_v2():
    old, new = U.gate_files(), U.gate_files(U.get_base("0.34.0"))
    assert len(new) == len(set(new))
    gone = [f for f in old if f not in new]
    # Each v0.32.0 file left out is named in a comment of the 0.34 list, with why.
    assert gone == ["tests/v1/kv_connector/unit/test_kv_connector_lifecycle.py"]
    assert all(f in comments(U.get_base("0.34.0").gate_files_path) for f in gone)
    added = [f for f in new if f not in old]
    assert added == ["tests/v1/worker/test_gpu_kv_connector.py", "tests/v1/worker/cpu/test_cpu_kv_connector.py",
                     "tests/v1/worker/test_gpu_model_runner_v2.py"]


def test_each_baseline_names_only_its_own_gate_files():
    for version in U.BASES:
        base = U.get_base(version)
        files = set(U.gate_files(base))
        ids = U.read_list(base.baseline_path)
        assert ids, f"{base.baseline_path} is empty"
        outside = sorted({i.split("::", 1)[0] for i in ids} - files)
        assert not outside, f"{base.baseline_path} has tests of files not in its gate: {outside}"
        assert not U.flaky_ids(base) & set(ids), f"{base.flaky_path} ids are in {base.baseline_path}"


def test_recording_only_some_files_keeps_the_other_files_entries():
    old = ["a.py::t1", "a.py::t2", "b.py::t1", "b.py::t2[x]", "b.py::t3", "c.py::t"]
    # a.py recorded again: t2 fails now, t3 is new; b.py and c.py are left as they were.
    assert U.merge_baseline(old, ["a.py::t1", "a.py::t3"], ["a.py"]) == [
        "a.py::t1", "a.py::t3", "b.py::t1", "b.py::t2[x]", "b.py::t3", "c.py::t"]
    # A test id covers its parametrizations, and nothing else of its file.
    assert U.merge_baseline(old, [], ["b.py::t2"]) == ["a.py::t1", "a.py::t2", "b.py::t1", "b.py::t3", "c.py::t"]
    # No prefix confusion: a.py does not cover a.py2.
    assert U.merge_baseline(["a.py2::t"], [], ["a.py"]) == ["a.py2::t"]


def test_read_list_drops_comments_and_blanks(tmp_path):
    f = tmp_path / "l.txt"
    f.write_text("# head\n\na.py  # why\n  b.py\n#c.py\n")
    assert U.read_list(f) == ["a.py", "b.py"]


# --- the tree a base runs on ---------------------------------------------------

def vllm_tree(tmp_path: Path, version: str | None) -> Path:
    tree = tmp_path / f"vllm-{version}"
    (tree / "vllm").mkdir(parents=True)
    (tree / "vllm" / "__init__.py").write_text("")
    if version:
        (tree / "PKG-INFO").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return tree


def test_a_tree_of_another_release_is_refused(tmp_path):
    b34 = U.get_base("0.34.0")
    U.check_tree(vllm_tree(tmp_path, "0.34.0"), b34)
    U.check_tree(vllm_tree(tmp_path, None), b34)  # a git checkout: no PKG-INFO to say
    with pytest.raises(SeriesError, match=r"is vLLM 0\.32\.0 .*not 0\.34\.0: pass --base 0\.32\.0"):
        U.check_tree(vllm_tree(tmp_path, "0.32.0"), b34)
    with pytest.raises(SeriesError, match="no vLLM source tree"):
        U.check_tree(tmp_path / "empty", b34)


def test_the_034_gate_without_a_tree_runs_on_the_maintainers_034_tree_or_says_what_to_run(tmp_path, monkeypatch):
    """No --tree: the 0.34 gate runs on build/vllm-0.34.0 (make setup-0.34);
    without that tree it says what to run instead of guessing another."""
    import dataclasses

    from workbench import bases

    if not VENV_034_PY.is_file():
        with pytest.raises(SeriesError, match=r"does not exist: run `make setup-0\.34` first"):
            U.run_gate(base="0.34.0")
        return
    assert bases.get_base("0.34.0").tree == bases.BUILD / "vllm-0.34.0"
    missing = dataclasses.replace(bases.BASES["0.34.0"], tree=tmp_path / "no-tree")
    monkeypatch.setitem(bases.BASES, "0.34.0", missing)
    with pytest.raises(SeriesError, match=r"no-tree, which does not exist: run `make setup-0\.34`"):
        U.run_gate(base="0.34.0")


@needs_venv_034
def test_rerun_alone_on_the_034_base_uses_its_venv(tmp_path):
    tree = tmp_path / "tree"
    (tree / "tests").mkdir(parents=True)
    (tree / "tests" / "test_t.py").write_text(
        "import sys\n\n\ndef test_venv():\n    assert sys.prefix.endswith('venv-0.34.0'), sys.prefix\n")
    assert U.rerun_alone(tree, "tests/test_t.py::test_venv", tmp_path, U.get_base("0.34.0")) == "passed"
    # The same test under the default base runs in .venv, and fails.
    assert U.rerun_alone(tree, "tests/test_t.py::test_venv", tmp_path) == "failed"


# --- the Triton switch -----------------------------------------------------------

BUILD_CONFIG = """
import vllm.triton_utils as t
from vllm.config import VllmConfig
try:
    VllmConfig()
    print("config built; HAS_TRITON", t.HAS_TRITON)
except RuntimeError as exc:
    print("refused:", exc)
"""


def run_config_test(python: Path, tree: Path, plugin: bool, tmp_path: Path) -> subprocess.CompletedProcess:
    test = tmp_path / "test_cfg.py"
    test.write_text(f"def test_cfg(capsys):\n    exec({BUILD_CONFIG!r})\n    out = capsys.readouterr().out\n"
                    "    print(out)\n    assert out.startswith('config built')\n")
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu",
               PYTHONPATH=os.pathsep.join([str(tree), str(ROOT / "scripts" / "workbench")]))
    cmd = [str(python), "-m", "pytest", "-s", "-p", "no:cacheprovider", *(["-p", "triton_switch"] if plugin else []),
           str(test)]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


@needs_venv_034
def test_switch_lets_a_034_config_build_and_nothing_else_sees_triton(tmp_path):
    tree = U.pristine_tree(U.get_base("0.34.0"))
    without = run_config_test(VENV_034_PY, tree, False, tmp_path)
    assert without.returncode == 1 and "refused: vLLM on x86 CPUs requires Triton (triton-cpu)" in without.stdout
    with_switch = run_config_test(VENV_034_PY, tree, True, tmp_path)
    assert with_switch.returncode == 0, with_switch.stdout[-2000:]
    # Outside the config check HAS_TRITON keeps what vLLM found: no Triton kernels run.
    assert "config built; HAS_TRITON False" in with_switch.stdout
    assert "triton_switch: on: CpuPlatform's config check sees Triton" in with_switch.stdout


def test_switch_changes_nothing_on_032(tmp_path):
    """.venv's vLLM 0.32.0 only warns without Triton (it reads HAS_TRITON for that): the plugin stays off."""
    proc = subprocess.run(
        [sys.executable, "-c", "import triton_switch, vllm.platforms.cpu as c\n"
         "f = c.CpuPlatform.check_and_update_config\n"
         "print(triton_switch.install()); assert c.CpuPlatform.check_and_update_config == f"],
        env=dict(os.environ, VLLM_TARGET_DEVICE="cpu", PYTHONPATH=str(ROOT / "scripts" / "workbench")),
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "off: CpuPlatform.check_and_update_config does not raise 'requires Triton'" in proc.stdout


# --- ci/setup-0.34.sh's stamp --------------------------------------------------------

def expected_stamp() -> str:
    data = b"vllm==0.34.0\n" + (ROOT / "requirements" / "cpu-0.34.txt").read_bytes()
    return hashlib.sha256(data).hexdigest()


def expected_project_stamp() -> str:
    return hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + (ROOT / "setup.py").read_bytes()).hexdigest()


def fake_venv(path: Path, stamp: str | None, project_stamp: str | None = None) -> Path:
    """A folder shaped like a built venv (pyvenv.cfg, bin/python), with its stamps.
    Its python is .venv's: nothing here may get as far as running pip with it."""
    (path / "bin").mkdir(parents=True)
    (path / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (path / "bin" / "python").symlink_to(sys.executable)
    (path / "keep-me").write_text("not rebuilt")
    if stamp is not None:
        (path / ".kvcs-requirements-0.34.0").write_text(stamp + "\n")
    if project_stamp is not None:
        (path / ".kvcs-project").write_text(project_stamp + "\n")
    return path


def setup_034(venv: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "FORCE"}
    env["VENV_034"] = str(venv)
    return subprocess.run(["bash", str(SETUP_034), *args], env=env, capture_output=True, text=True, timeout=120)


def test_setup_check_is_current_only_with_the_stamp_of_these_requirements(tmp_path):
    assert setup_034(tmp_path / "none", "--check").returncode == 1
    venv = fake_venv(tmp_path / "v", expected_stamp(), expected_project_stamp())
    proc = setup_034(venv, "--check")
    assert proc.returncode == 0 and "is current" in proc.stdout
    # A current venv is left as it is: nothing installed, nothing removed.
    proc = setup_034(venv)
    assert proc.returncode == 0 and "is current with requirements/cpu-0.34.txt" in proc.stdout
    assert (venv / "keep-me").read_text() == "not rebuilt"
    # Any other stamp (older requirements, say) is stale.
    (venv / ".kvcs-requirements-0.34.0").write_text(expected_stamp()[:-1] + "0\n")
    proc = setup_034(venv, "--check")
    assert proc.returncode == 1 and "changed since" in proc.stdout
    (venv / ".kvcs-requirements-0.34.0").unlink()
    proc = setup_034(venv, "--check")
    assert proc.returncode == 1 and "no stamp" in proc.stdout


def test_setup_check_a_changed_pyproject_asks_only_for_the_project_again(tmp_path):
    venv = fake_venv(tmp_path / "v", expected_stamp(), expected_project_stamp()[::-1])
    proc = setup_034(venv, "--check")
    assert proc.returncode == 1 and "pyproject.toml or setup.py changed" in proc.stdout
    (venv / ".kvcs-project").unlink()
    proc = setup_034(venv, "--check")
    assert proc.returncode == 1 and "pyproject.toml or setup.py changed" in proc.stdout
    # The requirements' stamp decides a rebuild; the project's cannot stand in for it.
    venv2 = fake_venv(tmp_path / "v2", None, expected_project_stamp())
    proc = setup_034(venv2, "--check")
    assert proc.returncode == 1 and "no stamp" in proc.stdout


def test_setup_refuses_to_replace_a_folder_that_is_no_venv(tmp_path):
    other = tmp_path / "work"
    other.mkdir()
    (other / "precious.txt").write_text("mine")
    proc = setup_034(other)
    assert proc.returncode == 2 and "refusing to replace" in proc.stderr
    assert (other / "precious.txt").read_text() == "mine"


def test_setup_takes_no_unknown_argument(tmp_path):
    proc = setup_034(tmp_path / "v", "--force")
    assert proc.returncode == 2 and "usage:" in proc.stderr
