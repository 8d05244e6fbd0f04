"""kvcs_demo.servers: servers start, get healthy, and no process of theirs outlives the demo.

Stand-ins replace vLLM servers: a tiny HTTP server that, like a vLLM API server
with its engine core and workers, is a tree of processes (server -> child ->
grandchild, each sleeping). Every process writes its pid to a file, so the
tests can check that each one of every tree is gone after a stop.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvcs_demo.servers import (
    Managed,
    PortInUse,
    ProcessGroup,
    ServerFailed,
    ServerNotReady,
    ServerSpec,
    check_port_free,
    free_port_block,
    last_log_line,
)

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
SAFETY_S = 30  # bounds, not expectations

STAND_IN = textwrap.dedent(
    """
    # A stand-in server. argv: ROLE PIDFILE MODE [PORT]
    # ROLE: server | child | grandchild. MODE: ok | exit3 | ignore-term | never-healthy
    import http.server, os, signal, subprocess, sys, time

    role, pidfile, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    if mode == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with open(pidfile, "a") as f:
        f.write(f"{os.getpid()}\\n")
    if role != "grandchild":
        below = "child" if role == "server" else "grandchild"
        sub = subprocess.Popen([sys.executable, __file__, below, pidfile, mode],
                               stdout=subprocess.PIPE)
        sub.stdout.readline()  # its subtree is up and recorded
    if role != "server":
        print("up", flush=True)
        while True:
            time.sleep(3600)

    print(f"stand-in {os.getpid()} mode {mode}", flush=True)
    if mode == "exit3":
        print("failing on purpose before healthy", flush=True)
        sys.exit(3)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            ok = self.path == "/health" and mode != "never-healthy"
            self.send_response(200 if ok else 503)
            self.end_headers()

        def log_message(self, *args):
            pass

    http.server.HTTPServer(("127.0.0.1", int(sys.argv[4])), Handler).serve_forever()
    """
)


@pytest.fixture
def stand_in(tmp_path: Path):
    """spec(name, mode) -> (ServerSpec, pidfile) for a stand-in in tmp_path."""
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)

    def spec(name: str, mode: str = "ok") -> tuple[ServerSpec, Path]:
        pidfile = tmp_path / f"{name}.pids"
        port = free_port_block()
        argv = [sys.executable, str(script), "server", str(pidfile), mode, str(port)]
        return ServerSpec(name, argv, {"KVCS_STAND_IN": name}, port,
                          tmp_path / "logs" / f"{name}.log"), pidfile

    return spec


def wait_for(predicate, what: str, timeout: float = SAFETY_S):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def tree_pids(pidfile: Path) -> list[int]:
    """The 3 pids of a stand-in tree (waits until all are recorded)."""
    wait_for(lambda: pidfile.exists() and len(pidfile.read_text().split()) == 3,
             f"3 pids in {pidfile}")
    return [int(p) for p in pidfile.read_text().split()]


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def is_gone(pid: int) -> bool:
    """Gone, or a zombie (reaped here if it is our child; otherwise its parent,
    pid 1 on this machine, may never reap it, and a zombie holds nothing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    if _state(pid) == "Z":
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        return True
    return False


def assert_all_gone(pids: list[int]) -> None:
    alive = [(p, _state(p)) for p in pids if not is_gone(p)]
    assert not alive, f"processes left running (pid, state): {alive}"


def assert_all_alive(pids: list[int]) -> None:
    assert all(not is_gone(p) for p in pids), [(p, _state(p)) for p in pids]


# ----------------------------------------------------------------------- ports


def test_free_port_block_returns_bindable_ports_never_twice():
    first = free_port_block(8)
    second = free_port_block(8)
    assert not set(range(first, first + 8)) & set(range(second, second + 8))
    for port in [*range(first, first + 8), *range(second, second + 8)]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
        check_port_free(port)


def test_free_port_block_skips_a_port_held_open():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert free_port_block(1, start=port) > port
        block = free_port_block(3, start=port - 2)
        assert port not in range(block, block + 3)
        with pytest.raises(PortInUse, match=rf"port {port}\b.*ss -ltnp"):
            check_port_free(port)


def test_start_refuses_a_taken_port(stand_in, tmp_path):
    spec, _ = stand_in("a")
    with socket.socket() as held:
        held.bind(("127.0.0.1", spec.port))
        held.listen()
        with ProcessGroup(log=lambda line: None) as group:
            with pytest.raises(PortInUse, match=str(spec.port)):
                group.start(spec)
            assert group.managed == []


# ---------------------------------------------------------------- lifecycles


def test_with_block_exit_stops_every_process_of_every_tree(stand_in):
    (spec_a, pids_a), (spec_b, pids_b) = stand_in("a"), stand_in("b")
    lines: list[str] = []
    with ProcessGroup(log=lines.append) as group:
        a, b = group.start(spec_a), group.start(spec_b)
        group.wait_healthy([a, b], timeout=SAFETY_S)
        pids = tree_pids(pids_a) + tree_pids(pids_b)
        assert_all_alive(pids)
        assert a.pgid == a.pid and os.getpgid(pids[1]) == a.pgid  # one group per tree
    assert_all_gone(pids)
    assert a.stopped and b.stopped and a.returncode == -signal.SIGTERM
    assert [line.split(":")[0] for line in lines] == [
        f"stopped a (pid {a.pid})", f"stopped b (pid {b.pid})"]
    assert "=== kvcs_demo: starting a" in spec_a.log_path.read_text()
    group.stop_all()  # idempotent: nothing left, nothing logged
    assert len(lines) == 2


def test_an_exception_in_the_with_block_stops_everything(stand_in):
    spec, pidfile = stand_in("a")
    with pytest.raises(RuntimeError, match="demo bug"):
        with ProcessGroup(log=lambda line: None) as group:
            group.wait_healthy(group.start(spec), timeout=SAFETY_S)
            pids = tree_pids(pidfile)
            raise RuntimeError("demo bug")
    assert_all_gone(pids)


def test_server_exiting_before_healthy_raises_and_the_other_is_stopped(stand_in):
    (spec_ok, pids_ok), (spec_bad, pids_bad) = stand_in("ok"), stand_in("bad", "exit3")
    with pytest.raises(ServerFailed) as failed:
        with ProcessGroup(log=lambda line: None) as group:
            ok = group.start(spec_ok)
            # Its whole tree up first: stopped while still spawning, it would
            # never record the pids this test checks are gone.
            tree_pids(pids_ok)
            bad = group.start(spec_bad)
            group.wait_healthy([ok, bad], timeout=SAFETY_S)
    err = failed.value
    assert err.name == "bad" and err.returncode == 3
    assert "'bad' exited with code 3" in str(err)
    assert "failing on purpose before healthy" in str(err)
    assert "failing on purpose before healthy" in err.tail
    # The failed server's own child and grandchild were in its group too.
    assert_all_gone(tree_pids(pids_ok) + tree_pids(pids_bad))


def listening(port: int) -> bool:
    """Whether something answers HTTP on the port (any status)."""
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=SAFETY_S).close()
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
    return True


def test_not_healthy_in_time_names_the_server(stand_in):
    spec, pidfile = stand_in("slow", "never-healthy")
    with ProcessGroup(log=lambda line: None) as group:
        m = group.start(spec)
        # Up and answering 503 before the short wait starts (under load it
        # may take longer than the wait to listen at all).
        wait_for(lambda: listening(spec.port), "the stand-in to listen")
        with pytest.raises(ServerNotReady, match=r"'slow'(.|\n)*HTTP 503") as err:
            group.wait_healthy(m, timeout=0.5)
        assert err.value.names == ["slow"]
        pids = tree_pids(pidfile)
    assert_all_gone(pids)


def test_a_slow_start_says_which_server_it_waits_for(stand_in):
    """While servers start, a line every progress_every seconds names each one
    still starting, its port, and what it logged last."""
    spec, pidfile = stand_in("prefill", "never-healthy")
    lines: list[str] = []
    with ProcessGroup(log=lambda line: None) as group:
        m = group.start(spec)
        wait_for(lambda: listening(spec.port), "the stand-in to listen")
        with pytest.raises(ServerNotReady):
            group.wait_healthy(m, timeout=3.0, progress=lines.append, progress_every=0.1)
        pids = tree_pids(pidfile)
    assert_all_gone(pids)
    assert lines, "no progress line while the server was starting"
    for line in lines:
        assert re.fullmatch(rf"waiting for prefill :{spec.port} \(\d+ s; last log: stand-in \d+ mode never-healthy\)",
                            line), line


def test_last_log_line_drops_vllms_prefix(tmp_path):
    log = tmp_path / "s.log"
    log.write_text("=== kvcs_demo: starting x: vllm serve m\n"
                   "(APIServer pid=12301) INFO 12-07 13:46:22 [entry.py:136] Supported tasks: ['generate']\n\n")
    m = Managed(spec=ServerSpec("x", ["x"], {}, 1, log), popen=None, log_offset=0)
    assert last_log_line(m) == "Supported tasks: ['generate']"
    log.write_text("(EngineCore pid=7) WARNING 12-07 13:46:22 [cpu.py:224] " + "w" * 200 + "\n")
    assert last_log_line(m, width=20) == "w" * 17 + "..."
    log.write_text("=== kvcs_demo: starting x: vllm serve m\n")
    assert last_log_line(m) == "nothing logged yet"


def test_a_server_ignoring_sigterm_is_sigkilled(stand_in):
    spec, pidfile = stand_in("stubborn", "ignore-term")
    lines: list[str] = []
    with ProcessGroup(stop_timeout=0.3, log=lines.append) as group:
        m: Managed = group.start(spec)
        group.wait_healthy(m, timeout=SAFETY_S)
        pids = tree_pids(pidfile)
        group.stop(m)
        assert_all_gone(pids)
        assert m.returncode == -signal.SIGKILL
        assert "SIGKILLed" in lines[0]
    assert len(lines) == 1  # stop() then exit: stopped once


DRIVER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {scripts!r})
    from pathlib import Path
    from kvcs_demo.servers import ProcessGroup, ServerSpec

    specs = {specs!r}
    with ProcessGroup() as group:
        started = [group.start(ServerSpec(name, argv, {{}}, port, Path(log)))
                   for name, argv, port, log in specs]
        group.wait_healthy(started[:2], timeout=60)
        Path({marker!r}).write_text("waiting")
        group.wait_healthy(started[2], timeout=600)  # never healthy: interrupted here
    """
)


@pytest.mark.parametrize("sig, returncodes", [
    (signal.SIGINT, (-signal.SIGINT, 130)),  # KeyboardInterrupt
    (signal.SIGTERM, (128 + signal.SIGTERM,)),
])
def test_driver_interrupted_while_waiting_stops_everything(stand_in, tmp_path, sig,
                                                           returncodes):
    specs, pidfiles = [], []
    for name, mode in [("a", "ok"), ("b", "ok"), ("c", "never-healthy")]:
        spec, pidfile = stand_in(name, mode)
        specs.append((name, spec.argv, spec.port, str(spec.log_path)))
        pidfiles.append(pidfile)
    marker = tmp_path / "waiting"
    driver_py = tmp_path / "driver.py"
    driver_py.write_text(DRIVER.format(scripts=str(SCRIPTS), specs=specs, marker=str(marker)))
    driver = subprocess.Popen([sys.executable, str(driver_py)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    try:
        wait_for(lambda: marker.exists() or driver.poll() is not None, "the driver to wait")
        assert driver.poll() is None, driver.communicate()
        pids = [pid for pidfile in pidfiles for pid in tree_pids(pidfile)]
        assert_all_alive(pids)
        driver.send_signal(sig)
        _, stderr = driver.communicate(timeout=SAFETY_S)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    assert driver.returncode in returncodes, stderr.decode()
    text = stderr.decode()
    assert f"got {signal.Signals(sig).name}" in text
    assert text.count("kvcs_demo: stopped ") == 3, text
    assert_all_gone(pids)
