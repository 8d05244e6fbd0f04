"""Processes the demo starts, and the guarantee that none of them outlives it.

A vLLM API server is a tree of processes (the API server, its engine core,
the workers, multiprocessing helpers). `ProcessGroup` starts each server in a
session of its own, so that the whole tree shares one process group, and stops
by signalling the group: SIGTERM, a bounded wait, then SIGKILL, then it checks
that no process of the group is left. It does so when the `with` block ends
(normally or by an exception), at interpreter exit, and when the demo itself
gets SIGINT, SIGTERM or SIGHUP.

Typical use (the demo driver):

    with ProcessGroup() as group:
        prod = group.start(ServerSpec("producer", argv, env, port, log_path))
        cons = group.start(ServerSpec("consumer", argv2, env2, port2, log_path2))
        group.wait_healthy([prod, cons], timeout=300)
        ...  # requests
    # every process of both trees is gone here

Linux only (process groups, /proc).
"""

from __future__ import annotations

import atexit
import errno
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

__all__ = [
    "ServerSpec",
    "Managed",
    "ProcessGroup",
    "ServerError",
    "ServerFailed",
    "ServerNotReady",
    "PortInUse",
    "free_port_block",
    "check_port_free",
    "log_tail",
    "last_log_line",
    "waiting_line",
]

HOST = "127.0.0.1"
# Default range for free_port_block: below Linux's ephemeral range
# (32768-60999), so outgoing connections never take a port between the moment
# it is handed out and the moment the server binds it.
_PORT_RANGE = (20000, 32000)
_LOG_TAIL_LINES = 40


# --------------------------------------------------------------------- errors


class ServerError(RuntimeError):
    """Base of the errors this module raises about the demo's processes."""


class PortInUse(ServerError):
    """A port a server is about to listen on is already taken."""

    def __init__(self, port: int, detail: str = ""):
        self.port = port
        super().__init__(
            f"port {port} on {HOST} is in use by another process (which one is unknown "
            f"here: see `ss -ltnp 'sport = :{port}'`); stop that process or pick another "
            f"port (free_port_block() finds free ones){': ' + detail if detail else ''}"
        )


class ServerFailed(ServerError):
    """A server's process exited before it answered its health check."""

    def __init__(self, name: str, returncode: int, log_path: Path, tail: str):
        self.name = name
        self.returncode = returncode
        self.log_path = log_path
        self.tail = tail
        super().__init__(
            f"server {name!r} exited with code {returncode} before it was healthy; "
            f"last lines of {log_path}:\n{_indent(tail)}"
        )


class ServerNotReady(ServerError, TimeoutError):
    """Servers still not healthy when `wait_healthy`'s timeout ran out."""

    def __init__(self, names: list[str], timeout: float, details: str):
        self.names = names
        super().__init__(
            f"server(s) {', '.join(repr(n) for n in names)} not healthy after "
            f"{timeout:g} s (still running; raise the timeout if they are only slow):\n"
            f"{details}"
        )


def _indent(text: str, prefix: str = "  | ") -> str:
    return "\n".join(prefix + line for line in text.splitlines()) or prefix + "(empty)"


# ---------------------------------------------------------------------- ports

_handed_out: set[int] = set()
_ports_lock = threading.Lock()


def _bindable(port: int) -> OSError | None:
    """None if `port` can be bound now on 127.0.0.1 and on all interfaces.

    Both, because a vLLM API server listens on 0.0.0.0 by default while NIXL's
    side channel and the proxy listen on 127.0.0.1/localhost; a port taken on
    any address would break one of them. SO_REUSEADDR as servers set it, so a
    port whose last connection is in TIME_WAIT still counts as free.
    """
    for addr in (HOST, "0.0.0.0"):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((addr, port))
            except OSError as e:
                return e
    return None


def check_port_free(port: int) -> None:
    """Raise `PortInUse` if `port` cannot be bound now; run before a server starts.

    A server started on a taken port fails late, or worse, the health check
    reaches the process already there and the demo talks to the wrong server.
    """
    err = _bindable(port)
    if err is not None:
        if err.errno in (errno.EADDRINUSE, errno.EACCES):
            raise PortInUse(port, err.strerror or "")
        raise PortInUse(port, f"bind failed: {err}")


def free_port_block(n: int = 1, *, start: int | None = None) -> int:
    """First port of `n` consecutive ports that are all free now.

    For servers and for NIXL side channels (`VLLM_NIXL_SIDE_CHANNEL_PORT` plus
    a rank offset per TP worker, so the demo asks for blocks). Ports are checked
    by binding each; a block is never handed out twice in one process. Free
    "now" only: bind them soon. Without `start`, the scan starts at a point
    derived from the pid in [20000, 32000), so parallel test workers rarely
    probe the same ports.
    """
    if n < 1:
        raise ValueError(f"free_port_block: n must be >= 1, got {n}")
    lo, hi = _PORT_RANGE
    if start is None:
        if n > (hi - lo) // 2:
            raise ValueError(f"free_port_block: {n} ports is more than the demo needs; "
                             "pass start= for a block that large")
        first = lo + (os.getpid() * 97) % (hi - lo - n)
        runs = [(first, hi - n + 1), (lo, first)]  # wrap around once
    else:
        if not 1 <= start <= 65536 - n:
            raise ValueError(f"free_port_block: start {start} leaves no room for {n} ports")
        runs = [(start, 65536 - n + 1)]
    with _ports_lock:
        for base, stop in runs:
            while base < stop:
                bad = next((p for p in range(base, base + n)
                            if p in _handed_out or _bindable(p) is not None), None)
                if bad is None:
                    _handed_out.update(range(base, base + n))
                    return base
                base = bad + 1  # no block containing the bad port works
    raise ServerError(
        f"no block of {n} consecutive free ports found "
        f"(from {start if start is not None else lo}); free some ports or pass another start"
    )


# -------------------------------------------------------------------- servers


@dataclass
class ServerSpec:
    """What to run: argv, extra environment (added to os.environ), the port it
    serves HTTP on (polled at `health_path` for readiness), and its log file
    (stdout and stderr, appended)."""

    name: str
    argv: list[str]
    env: dict[str, str]
    port: int
    log_path: Path
    health_path: str = "/health"


@dataclass(eq=False)
class Managed:
    """A started server: its process tree is process group `pgid`."""

    spec: ServerSpec
    popen: "subprocess.Popen[bytes]"
    log_offset: int  # where this run's output starts in spec.log_path
    started_at: float = field(default_factory=time.monotonic)
    stopped: bool = False

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def pgid(self) -> int:
        # start_new_session=True: the leader's pid is the group (and session) id.
        return self.popen.pid

    @property
    def port(self) -> int:
        return self.spec.port

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.spec.port}"

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """The last lines this run wrote to its log."""
        return log_tail(self.spec.log_path, lines, start=self.log_offset)


def log_tail(path: Path, lines: int = _LOG_TAIL_LINES, *, start: int = 0) -> str:
    """Last `lines` lines of `path` after byte offset `start` ('' if none)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            end = f.tell()
            begin = max(start, end - 256 * 1024)  # enough for 40 long lines
            f.seek(begin)
            data = f.read()
    except OSError as e:
        return f"(log unreadable: {e})"
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])


def _group_live_pids(pgid: int) -> list[int]:
    """Pids of process group `pgid` that are not zombies ([] if none).

    killpg(pgid, 0) alone is not enough: it succeeds while zombies remain, and
    on machines whose pid 1 does not reap orphans (this one, for one) the
    orphaned workers of a stopped server stay zombies forever. A zombie holds
    no port and no memory, so it counts as gone.
    """
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return []
    except PermissionError:
        return [pgid]  # someone else's group with that id: treat as alive
    live = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return [pgid]  # no /proc: trust killpg
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # exited meanwhile
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parens.
        rest = stat[stat.rfind(b")") + 2 :].split()
        if len(rest) >= 3 and int(rest[2]) == pgid and rest[0] not in (b"Z", b"X"):
            live.append(int(entry))
    return live


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _stderr_line(msg: str) -> None:
    print(f"kvcs_demo: {msg}", file=sys.stderr, flush=True)


_no_proxy_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _health(url: str, timeout: float) -> str | None:
    """None if `url` answers 200, else what it said (for the timeout message)."""
    try:
        with _no_proxy_opener.open(url, timeout=timeout) as resp:
            if resp.status == 200:
                return None
            return f"HTTP {resp.status}"
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}"
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        return f"no answer ({reason})"


_VLLM_LOG_PREFIX = re.compile(r"^\(\w+ pid=\d+\) \w+ [\d-]+ [\d:]+ \[[^\]]*\] ")


def last_log_line(m: Managed, width: int = 90) -> str:
    """The last non-empty line `m` logged in this run (the demo's own "===
    kvcs_demo: starting" header aside), without vLLM's "(APIServer pid=N)
    INFO date time [file:line]" prefix, cut to `width`."""
    lines = [ln.strip() for ln in m.tail(5).splitlines() if ln.strip() and not ln.startswith("=== kvcs_demo:")]
    if not lines:
        return "nothing logged yet"
    line = _VLLM_LOG_PREFIX.sub("", lines[-1]).strip()
    return line if len(line) <= width else line[: width - 3] + "..."


def waiting_line(pending: Sequence[Managed]) -> str:
    """"waiting for NAME :PORT (45 s; last log: ...), ...": the servers still starting."""
    now = time.monotonic()
    return "waiting for " + ", ".join(
        f"{m.name} :{m.port} ({now - m.started_at:.0f} s; last log: {last_log_line(m)})" for m in pending)


class ProcessGroup:
    """The demo's processes; every one is stopped, with its descendants, on exit.

    `stop_timeout` bounds the SIGTERM phase of a stop (all servers at once);
    `kill_timeout` bounds the wait after SIGKILL. `log` receives one line per
    stopped server (default: stderr).

    Use it as a context manager: `with` installs the SIGINT/SIGTERM/SIGHUP
    handlers (main thread only) and stops everything on the way out. Without
    `with`, only the atexit hook (registered by the first `start`) remains,
    and it does not run when the demo is killed by a signal.
    """

    _SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(
        self,
        *,
        stop_timeout: float = 20.0,
        kill_timeout: float = 5.0,
        log: Callable[[str], None] = _stderr_line,
    ):
        self.stop_timeout = stop_timeout
        self.kill_timeout = kill_timeout
        self.log = log
        self.managed: list[Managed] = []
        self._previous_handlers: dict[int, object] = {}
        self._atexit_registered = False
        self._handling_signal = False

    # ---------------------------------------------------------------- context

    def __enter__(self) -> "ProcessGroup":
        self._register_atexit()
        if threading.current_thread() is threading.main_thread():
            for sig in self._SIGNALS:
                self._previous_handlers[sig] = signal.getsignal(sig)
                signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.stop_all()
        finally:
            for sig, handler in self._previous_handlers.items():
                # None: a handler not set from Python; the default is the best guess.
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
            self._previous_handlers.clear()
            if self._atexit_registered:
                atexit.unregister(self.stop_all)
                self._atexit_registered = False

    def _register_atexit(self) -> None:
        if not self._atexit_registered:
            atexit.register(self.stop_all)
            self._atexit_registered = True

    def _on_signal(self, signum: int, frame) -> None:
        # Stop everything first, then end the demo the way the signal would.
        if self._handling_signal:
            return  # a second Ctrl-C while stopping: the stop is bounded anyway
        self._handling_signal = True
        try:
            self.log(f"got {signal.Signals(signum).name}: stopping every server")
            self.stop_all()
        finally:
            self._handling_signal = False
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    # ------------------------------------------------------------------ start

    def start(self, spec: ServerSpec) -> Managed:
        """Start `spec` in a new session (its own process group); returns at once.

        Raises `PortInUse` if its port is taken, `ServerError` if it cannot be
        executed. Use `wait_healthy` to wait until it serves.
        """
        self._register_atexit()
        check_port_free(spec.port)
        log_path = Path(spec.log_path)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            offset = log.tell()
            log.write(f"=== kvcs_demo: starting {spec.name}: {' '.join(spec.argv)}\n".encode())
            log.flush()
            try:
                popen = subprocess.Popen(
                    spec.argv,
                    env={**os.environ, **spec.env},
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            except OSError as e:
                raise ServerError(
                    f"cannot start server {spec.name!r} ({spec.argv[0]!r}): {e}"
                ) from e
        managed = Managed(spec=spec, popen=popen, log_offset=offset)
        self.managed.append(managed)
        return managed

    # ----------------------------------------------------------------- health

    def wait_healthy(
        self,
        managed: Managed | Sequence[Managed],
        timeout: float,
        *,
        interval: float = 0.2,
        progress: Callable[[str], None] | None = None,
        progress_every: float = 15.0,
    ) -> None:
        """Return once every server answers 200 at its health path.

        Polls all of them together every `interval` seconds. Raises
        `ServerFailed` as soon as one of them exits (name, exit code, log tail),
        `ServerNotReady` naming those not healthy when `timeout` runs out. The
        servers are left running either way: the caller's `with` stops them.
        With `progress`, every `progress_every` seconds it is given one line
        naming the servers still starting, how long since each started, and
        the last line each logged (`waiting_line`).
        """
        pending = [managed] if isinstance(managed, Managed) else list(managed)
        last_answer: dict[str, str] = {}
        deadline = time.monotonic() + timeout
        next_progress = time.monotonic() + progress_every
        while True:
            if progress is not None and pending and time.monotonic() >= next_progress:
                progress(waiting_line(pending))
                next_progress += progress_every
            for m in list(pending):
                self._raise_if_exited(m)
                answer = _health(
                    f"{m.url}{m.spec.health_path}",
                    timeout=max(0.1, min(2.0, deadline - time.monotonic())),
                )
                # Checked again: a 200 from a process that is gone came from
                # someone else on that port.
                self._raise_if_exited(m)
                if answer is None:
                    pending.remove(m)
                else:
                    last_answer[m.name] = answer
            if not pending:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                details = "\n".join(
                    f"- {m.name} (pid {m.pid}, {m.url}{m.spec.health_path}): "
                    f"{last_answer.get(m.name, 'not polled')}; last lines of "
                    f"{m.spec.log_path}:\n{_indent(m.tail(10))}"
                    for m in pending
                )
                raise ServerNotReady([m.name for m in pending], timeout, details)
            time.sleep(min(interval, left))

    @staticmethod
    def _raise_if_exited(m: Managed) -> None:
        code = m.popen.poll()
        if code is not None:
            raise ServerFailed(m.name, code, m.spec.log_path, m.tail())

    # ------------------------------------------------------------------- stop

    def stop(self, managed: Managed) -> None:
        """Stop one server and every process of its group (bounded, idempotent)."""
        self._stop_many([managed])

    def stop_all(self) -> None:
        """Stop every server started here (idempotent; all at once, bounded)."""
        self._stop_many(self.managed)

    def _stop_many(self, items: Iterable[Managed]) -> None:
        todo = [m for m in items if not m.stopped]
        if not todo:
            return
        t0 = time.monotonic()
        exited_before = {id(m): m.popen.poll() for m in todo}
        for m in todo:
            _signal_group(m.pgid, signal.SIGTERM)
        left = self._wait_gone(todo, self.stop_timeout)
        killed = {id(m) for m in left}
        for m in left:
            _signal_group(m.pgid, signal.SIGKILL)
        survivors = self._wait_gone(left, self.kill_timeout)
        for m in todo:
            m.stopped = True
            try:
                m.popen.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
            self.log(self._stop_line(m, exited_before[id(m)], id(m) in killed,
                                     m in survivors, time.monotonic() - t0))

    def _wait_gone(self, items: list[Managed], timeout: float) -> list[Managed]:
        """Wait until no live process remains in the groups; return those left."""
        deadline = time.monotonic() + timeout
        left = list(items)
        while left:
            for m in list(left):
                m.popen.poll()  # reap the leader, else it stays a zombie of ours
                if not _group_live_pids(m.pgid):
                    left.remove(m)
            if not left or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        return left

    def _stop_line(self, m: Managed, before: int | None, killed: bool,
                   survived: bool, elapsed: float) -> str:
        head = f"stopped {m.name} (pid {m.pid})"
        if survived:
            pids = _group_live_pids(m.pgid)
            return (f"{head}: processes {pids} of its group survived SIGKILL "
                    f"(uninterruptible?); check `ps -o pid,stat,cmd -g {m.pgid}`")
        if before is not None:
            return f"{head}: it had exited with code {before}; no process of its group is left"
        if killed:
            return (f"{head}: SIGKILLed after ignoring SIGTERM for "
                    f"{self.stop_timeout:g} s (exit {m.popen.returncode})")
        return f"{head}: exited with code {m.popen.returncode} on SIGTERM in {elapsed:.1f} s"
