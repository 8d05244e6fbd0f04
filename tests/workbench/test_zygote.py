"""The fork server (scripts/workbench/zygote.py): each run is what `python -c`
in a new process would be, after the heavy libraries were imported once."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from workbench import upstream as U
from workbench.zygote import ForkServer

PROBE = """
import json, os, sys
before = sorted(m for m in ("numpy", "json_probe_marker") if m in sys.modules)
sys.modules["json_probe_marker"] = object()          # state a later run must not see
os.environ["KVCS_LEFT_BY_A_RUN"] = "1"
print(json.dumps({"cwd": os.getcwd(), "argv": sys.argv, "path": sys.path[:2], "before": before,
                  "env": os.environ.get("KVCS_GIVEN"), "left": os.environ.get("KVCS_LEFT_BY_A_RUN_SEEN"),
                  "stdin": sys.stdin.read(), "exe": sys.executable}))
import atexit
atexit.register(lambda: print("exit handlers ran"))
sys.exit(int(os.environ.get("KVCS_STATUS", "0")))
"""


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One server for the tests that leave it running (starting one imports torch)."""
    home = tmp_path_factory.mktemp("server")
    env = dict(os.environ, PYTHONPATH=str(home / "on-path"))
    with ForkServer(sys.executable, env, home / "server.log") as s:
        s.on_path = str(home / "on-path")
        yield s


@pytest.fixture
def server(shared):
    yield shared
    assert not shared._broken, "a test broke the shared server"


def _out(log: Path) -> tuple[dict, list[str]]:
    import json

    lines = log.read_text().splitlines()
    return json.loads(lines[0]), lines[1:]


def test_a_run_is_python_c_in_its_folder_with_its_env_and_status(server, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    status, cpu = server.run(PROBE, work, tmp_path / "a.log", {"KVCS_GIVEN": "yes", "KVCS_STATUS": "5"})
    assert status == 5 and cpu >= 0
    seen, rest = _out(tmp_path / "a.log")
    assert seen["cwd"] == str(work) and seen["argv"] == ["-c"]
    assert seen["path"] == ["", server.on_path]  # as `python -c`: the folder, then PYTHONPATH
    assert seen["env"] == "yes" and seen["stdin"] == "" and seen["exe"] == sys.executable
    assert seen["before"] == ["numpy"]  # preloaded by the server, nothing else of the probe's
    assert rest == ["exit handlers ran"]


def test_runs_do_not_see_each_others_state(server, tmp_path):
    assert server.run(PROBE, tmp_path, tmp_path / "1.log")[0] == 0
    assert server.run(PROBE + "\nraise RuntimeError('second')\n", tmp_path, tmp_path / "2.log",
                      {"KVCS_STATUS": "0"})[0] == 0  # sys.exit comes first
    first, _ = _out(tmp_path / "1.log")
    second, _ = _out(tmp_path / "2.log")
    assert first["before"] == second["before"] == ["numpy"]  # the marker module of run 1 is gone
    assert server.run("import os, sys\nsys.exit(7 if 'KVCS_LEFT_BY_A_RUN' in os.environ else 0)",
                      tmp_path, tmp_path / "3.log")[0] == 0


def test_an_exception_a_signal_and_a_message_exit(server, tmp_path):
    assert server.run("raise ValueError('broken import')", tmp_path, tmp_path / "e.log")[0] == 1
    assert "ValueError: broken import" in (tmp_path / "e.log").read_text()
    assert server.run("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", tmp_path, tmp_path / "k.log")[0] \
        == -9
    assert server.run("import sys\nsys.exit('gave up')", tmp_path, tmp_path / "m.log")[0] == 1
    assert "gave up" in (tmp_path / "m.log").read_text()
    # The server outlives all three.
    assert server.run("pass", tmp_path, tmp_path / "p.log") == (0, pytest.approx(0, abs=5))


def test_no_server_means_run_it_yourself(tmp_path, monkeypatch):
    with ForkServer(tmp_path / "no-python", dict(os.environ), tmp_path / "s.log") as s:
        assert s.run("pass", tmp_path, tmp_path / "x.log") is None
    monkeypatch.setenv("KVCS_FORK_SERVER", "0")
    with ForkServer(sys.executable, dict(os.environ), tmp_path / "s.log") as s:
        assert s.run("pass", tmp_path, tmp_path / "x.log") is None


def test_a_server_that_dies_is_not_used_again(tmp_path):
    with ForkServer(sys.executable, dict(os.environ), tmp_path / "server.log") as server:
        assert server.run("pass", tmp_path, tmp_path / "x.log")[0] == 0
        server._proc.kill()
        server._proc.wait()
        # Restarted once the process is gone; a run that kills the server itself is refused after.
        assert server.run("pass", tmp_path, tmp_path / "y.log")[0] == 0
        assert server.run("import os\nos.kill(os.getppid(), 9)", tmp_path, tmp_path / "z.log") is None
        assert server.run("pass", tmp_path, tmp_path / "w.log") is None


def test_a_gate_file_runs_in_the_server_with_the_gates_plugins(tmp_path):
    tree = tmp_path / "tree"
    (tree / "tests").mkdir(parents=True)
    (tree / "tests" / "test_t.py").write_text(
        "import gc, os, sys\n\n\ndef test_in_tree():\n    assert os.getcwd() == %r and '' in sys.path\n"
        "    assert gc.unfreeze.__name__ == '_stay_frozen'  # the gate's gc_freeze plugin is on\n\n\n"
        "def test_fails():\n    assert False\n" % str(tree))
    base = U.get_base(None)
    with ForkServer(base.python, U.gate_env(tree, base), tmp_path / "s.log") as server:
        rel, results, _, tail = U.run_file(tree, "tests/test_t.py", tmp_path, base, server)
        assert server._proc is not None and not server._broken  # it ran there
    assert results == {"tests/test_t.py::test_in_tree": "passed", "tests/test_t.py::test_fails": "failed"}
    assert "1 failed, 1 passed" in tail


def test_test_processes_start_with_the_offline_hf_setup_conftest_gives_them(tmp_path):
    """The lanes' fork servers import huggingface_hub before tests/conftest.py runs:
    the base's test environment must already hold what conftest would set."""
    from workbench import bases

    env = bases.get_base(None).test_env(tmp_path)
    probe = "import os, runpy\nruns = runpy.run_path('tests/conftest.py')\n" \
            "print(repr({k: os.environ[k] for k in ('HF_HOME', 'HF_HUB_OFFLINE', 'TRANSFORMERS_OFFLINE')}))"
    clean = {k: v for k, v in os.environ.items() if k not in bases.OFFLINE_HF}
    import subprocess

    out = subprocess.run([sys.executable, "-c", probe], cwd=bases.ROOT, env=clean, capture_output=True, text=True,
                         check=True).stdout
    assert eval(out) == bases.OFFLINE_HF == {k: env[k] for k in bases.OFFLINE_HF}


def test_the_gate_runs_long_files_first_by_last_times_or_else_by_size(tmp_path):
    (tmp_path / "t").mkdir()
    for name, size in (("small.py", 10), ("big.py", 3000), ("mid.py", 500)):
        (tmp_path / "t" / name).write_text("#" * size)
    files = ["t/small.py", "t/big.py", "t/mid.py", "t/gone.py"]
    assert U.run_order(files, {}, tmp_path) == ["t/big.py", "t/mid.py", "t/small.py", "t/gone.py"]
    timed = {"t/small.py": 90.0, "t/big.py": 2.0, "t/mid.py": 30.0}
    assert U.run_order(files, timed, tmp_path) == ["t/gone.py", "t/small.py", "t/mid.py", "t/big.py"]


def test_a_server_preloads_what_it_is_also_given_from_its_path(tmp_path):
    (tmp_path / "on-path").mkdir()
    (tmp_path / "on-path" / "kvcs_probe_mod.py").write_text("import os\nLOADED_IN = os.getpid()\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "on-path"))
    probe = "import os, sys\nm = sys.modules.get('kvcs_probe_mod')\n" \
            "sys.exit(0 if m is not None and m.LOADED_IN != os.getpid() else 4)"
    with ForkServer(sys.executable, env, tmp_path / "s.log", also=("kvcs_probe_mod",)) as server:
        assert server.run(probe, tmp_path, tmp_path / "a.log") == (0, pytest.approx(0, abs=5))
