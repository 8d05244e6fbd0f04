"""A fork server for test processes: torch and the other heavy libraries imported once.

Why it exists. Every test process the workbench starts (one per upstream test
file in the gate, one per prefix in check-series) used to import torch,
transformers and the rest of vLLM's dependencies anew: about 80 % of the 6-10 s
of CPU such a process spends before its first test (`python -X importtime`,
2026-12-07: torch 34 %, transformers 16 %, other libraries 30 %, vLLM 20 %). The
gate alone starts 147 of them over both bases.

What it does. `ForkServer(python, env)` starts `python zygote.py` with the
environment the test processes get. That process imports the libraries in
PRELOAD, and nothing of vLLM or of the project, then waits. Each `run(code,
cwd, log, env)` makes it fork a child, which becomes what `python -c code`
started in `cwd` with `env` would be: its own working folder, environment,
`sys.argv`, `sys.path[0]`, stdin from /dev/null, stdout and stderr into `log`;
it runs `code` (a test run: `pytest.main(...)`), runs the exit handlers and
exits with the code's status. The server waits for the child and answers
with its exit status and the CPU seconds it and its own children used.

What stays as it was. Each test file or prefix still runs in a process of its
own, so one file's state never reaches another; vLLM and the tests are
imported in the child, from the tree the run names. Only libraries that read
nothing of the run are preloaded: the server starts with the run's
environment (HF_HOME and the offline switches, which huggingface_hub and
transformers read when imported), and a run may change only variables that
none of PRELOAD reads (KVCS_*, say).

When it steps aside. `ForkServer.run` returns None when the server could not
start, died, or had a thread running after its imports (a fork would copy a
lock some thread holds); the caller then starts a plain process, as before.
`KVCS_FORK_SERVER=0` turns it off.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

# Imported once by the server: what vLLM imports and reads nothing of a run's
# tree. Missing ones are skipped.
PRELOAD = ("torch", "numpy", "transformers", "pydantic", "fastapi", "openai", "aiohttp", "requests",
           "huggingface_hub", "safetensors", "msgspec", "zmq", "psutil", "sympy", "networkx", "triton",
           "xgrammar", "prometheus_client", "cbor2", "pytest", "_pytest.python", "_pytest.fixtures",
           "pytest_asyncio", "pytest_timeout", "hypothesis")


def enabled() -> bool:
    return os.environ.get("KVCS_FORK_SERVER", "1") != "0"


class ForkServer:
    """One server process; serves one run at a time (a lane or job slot each)."""

    def __init__(self, python: str | Path, env: dict[str, str], stderr_log: Path, also: tuple[str, ...] = ()):
        """`also`: modules to preload beyond PRELOAD, for a server whose every run
        uses the same tree (the gate preloads vLLM from it; check-series cannot)."""
        self.python, self.env, self.stderr_log = str(python), dict(env), stderr_log
        if also:
            self.env["KVCS_FORK_SERVER_ALSO"] = ",".join(also)
        self._proc: subprocess.Popen | None = None
        self._broken = not enabled()
        self._lock = threading.Lock()

    def _start(self) -> bool:
        if self._broken:
            return False
        if self._proc is not None and self._proc.poll() is None:
            return True
        try:
            self.stderr_log.parent.mkdir(parents=True, exist_ok=True)
            with open(self.stderr_log, "a") as err:
                self._proc = subprocess.Popen([self.python, str(Path(__file__).resolve())], env=self.env,
                                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                              text=True, bufsize=1)
            ready = json.loads(self._proc.stdout.readline() or "{}")
        except (OSError, ValueError):
            ready = {}
        if not ready.get("ready"):
            self.close()
            self._broken = True
            return False
        return True

    def run(self, code: str, cwd: Path, log: Path, env: dict[str, str] | None = None) -> tuple[int, float] | None:
        """(exit status, CPU s) of `python -c code` run by a fork; None: run it yourself."""
        with self._lock:
            if not self._start():
                return None
            request = {"code": code, "cwd": str(cwd), "log": str(log), "env": dict(env or {})}
            try:
                self._proc.stdin.write(json.dumps(request) + "\n")
                self._proc.stdin.flush()
                answer = json.loads(self._proc.stdout.readline() or "{}")
            except (OSError, ValueError):
                answer = {}
            if "status" not in answer:
                self.close()
                self._broken = True
                return None
            return int(answer["status"]), float(answer["cpu_s"])

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.stdin.close()
            proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- the server process -------------------------------------------------------

def _child(request: dict, proto_fd: int, stdin_fd: int) -> None:
    """In the forked child: become `python -c code` of the request, then exit."""
    status = 1
    try:
        os.close(proto_fd)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, stdin_fd)  # the server's requests are not the child's input
        os.dup2(log, 1)
        os.dup2(log, 2)
        for fd in (log, null):
            if fd > 2:
                os.close(fd)
        os.chdir(request["cwd"])
        os.environ.update(request["env"])
        sys.argv = ["-c"]
        sys.path.insert(0, "")  # as `python -c`: the working folder first (the server dropped its own)
        try:
            exec(compile(request["code"], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
            status = 0
        except SystemExit as exc:
            code = exc.code
            status = code if isinstance(code, int) else (0 if code is None else 1)
            if not isinstance(code, int) and code is not None:
                print(code, file=sys.stderr)
        except BaseException:
            import traceback

            traceback.print_exc()
            status = 1
        import atexit

        atexit._run_exitfuncs()  # what the interpreter runs at exit (multiprocessing's clean-up, say)
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(status & 0xFF if status >= 0 else 1)


def _serve() -> int:
    # The script's folder (scripts/workbench) must not shadow a library while preloading.
    if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)
    proto_fd = os.dup(1)
    os.dup2(2, 1)  # stray prints of the preloads go to the server's stderr log
    import importlib

    also = [m for m in os.environ.pop("KVCS_FORK_SERVER_ALSO", "").split(",") if m]
    for name in (*PRELOAD, *also):
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - a missing or broken library is simply not preloaded
            print(f"[zygote] not preloaded: {name}: {exc}", file=sys.stderr)
    import gc

    gc.collect()
    proto = os.fdopen(proto_fd, "w", buffering=1)
    if threading.active_count() > 1:
        names = ", ".join(t.name for t in threading.enumerate())
        print(f"[zygote] threads running after the imports ({names}): not forking", file=sys.stderr)
        proto.write(json.dumps({"ready": False}) + "\n")
        return 1
    proto.write(json.dumps({"ready": True}) + "\n")
    stdin_fd = sys.stdin.fileno()
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request, proto.fileno(), stdin_fd)
        _, wait_status, usage = os.wait4(pid, 0)
        proto.write(json.dumps({"status": os.waitstatus_to_exitcode(wait_status),
                                "cpu_s": round(usage.ru_utime + usage.ru_stime, 2)}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(_serve())
