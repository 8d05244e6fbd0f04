"""KV loaded back from a real Mooncake store is checked, and what fails is removed.

Real parts only: a `mooncake_master` (from mooncake-transfer-engine-non-cuda)
on loopback ports, two real vLLM engines of the patched tree on the CPU
backend with MooncakeStoreConnector over TCP and KV checksums on, and the
store's own client API in the test to read keys and corrupt a value.

Instance A (kv_both) computes two prompts and stores their full blocks, each
value carrying its block's checksum entry. The test flips one bit in the KV
part of one of the first prompt's values (upsert, through the store). Then
instance B (kv_consumer, empty cache, fail-closed, policy recompute) serves
both prompts from the store: the clean one verifies, the corrupted one is a
mismatch at that block, B's scheduler has worker rank 0 remove the block's
keys from the store, and the request is recomputed, so both outputs equal
A's. Afterwards the corrupted key is gone from the store and the others are
still there.

Marked e2e (two engines; about two minutes on two cores).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "build" / "tiny-llama"
BLOCK = 32


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _wait_port(port: int, deadline: float) -> None:
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on {port}")


class Master:
    def __init__(self, tmp: Path):
        bindir = Path(sys.executable).parent
        self.rpc, self.http, self.metrics = _free_ports(3)
        self.log = open(tmp / "master.log", "w")
        self.proc = subprocess.Popen(
            [str(bindir / "mooncake_master"), f"--rpc_port={self.rpc}", "--rpc_address=127.0.0.1",
             "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
             f"--http_metadata_server_port={self.http}", "--metrics_host=127.0.0.1",
             f"--metrics_port={self.metrics}"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        _wait_port(self.rpc, time.time() + 30)
        _wait_port(self.http, time.time() + 30)
        self.config = tmp / "mooncake.json"
        self.config.write_text(json.dumps({
            "metadata_server": f"http://127.0.0.1:{self.http}/metadata",
            "master_server_address": f"127.0.0.1:{self.rpc}", "protocol": "tcp", "device_name": "",
            "global_segment_size": "256MB", "local_buffer_size": "64MB"}))

    def keys(self) -> set[str]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics}/get_all_keys", timeout=10) as r:
            return {k for k in r.read().decode().split() if k}

    def client(self):
        """The store's own client (no segment of its own), as a test or an operator uses it."""
        from mooncake.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        rc = store.setup("127.0.0.1", f"http://127.0.0.1:{self.http}/metadata", 0, 16 << 20, "tcp", "",
                         f"127.0.0.1:{self.rpc}")
        assert rc == 0, rc
        return store

    def stop(self) -> None:
        _kill_group(self.proc)
        self.log.close()


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)
    else:
        try:  # children an engine may leave behind
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Engine:
    """A store_engine.py subprocess; `lines` is everything it printed."""

    def __init__(self, role: str, master: Master, tmp: Path):
        env = dict(os.environ, MOONCAKE_CONFIG_PATH=str(master.config), KVCS_STORE_MODEL=str(MODEL),
                   VLLM_HOST_IP="127.0.0.1", VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1",
                   VLLM_TARGET_DEVICE="cpu", HF_HOME=str(ROOT / "build" / "hf-home"), HF_HUB_OFFLINE="1",
                   VLLM_LOGGING_LEVEL="INFO", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("store_engine.py")), role],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, cwd=tmp, start_new_session=True)
        self.lines: list[str] = []
        self._answers: list[dict] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        self._next(600)  # {"ready": true}

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                if line.startswith('{"'):
                    self._answers.append(json.loads(line))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def _next(self, timeout: float) -> dict:
        deadline = time.time() + timeout
        with self._cond:
            while not self._answers:
                if self.proc.poll() is not None and not self._answers:
                    raise AssertionError("the engine exited:\n" + "\n".join(self.lines[-60:]))
                if time.time() > deadline:
                    raise TimeoutError("no answer from the engine:\n" + "\n".join(self.lines[-60:]))
                self._cond.wait(1)
            return self._answers.pop(0)

    def generate(self, prompts: list[list[int]]) -> dict:
        self.proc.stdin.write(json.dumps(prompts) + "\n")
        self.proc.stdin.flush()
        return self._next(300)

    def log(self) -> str:
        with self._cond:
            return "\n".join(self.lines)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        _kill_group(self.proc)


def _prompt(seed: int, blocks: int = 4) -> list[int]:
    # 4 full blocks and a partial one (computed, not stored).
    return [(i * 37 + seed * 101) % 500 + 3 for i in range(blocks * BLOCK + 7)]


def _wait_for(predicate, what: str, timeout: float = 30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def master(tmp_path):
    if not MODEL.exists():
        pytest.skip(f"{MODEL} is missing: run `make setup`")
    m = Master(tmp_path)
    yield m
    m.stop()


def test_corrupted_store_value_is_caught_removed_and_recomputed(master, tmp_path):
    bad_prompt, clean_prompt = _prompt(1), _prompt(2)
    a = Engine("kv_both", master, tmp_path)
    try:
        first = a.generate([bad_prompt])
        _wait_for(lambda: len(master.keys()) == 4, "A's 4 blocks of the first prompt in the store")
        bad_prompt_keys = master.keys()
        second = a.generate([clean_prompt])
        _wait_for(lambda: len(master.keys()) == 8, "A's 4 blocks of the second prompt in the store")
        keys = master.keys()
        # Values with checksums have their own namespace.
        assert all("@kv_checksums" in k for k in keys), keys

        # Corrupt one stored value through the store's API: one bit of its KV.
        store = master.client()
        victim = sorted(bad_prompt_keys)[0]
        value = bytearray(store.get(victim))
        assert len(value) > 8
        value[len(value) // 3] ^= 0x04
        assert store.upsert(victim, bytes(value)) == 0
        assert bytes(store.get(victim)) == bytes(value)

        b = Engine("kv_consumer", master, tmp_path)
        try:
            result = b.generate([bad_prompt, clean_prompt])
        finally:
            b.close()
            log = b.log()
            (tmp_path / "engine-b.log").write_text(log)
            (tmp_path / "engine-a.log").write_text(a.log())
        # Both served from the store (4 blocks each), and the outputs are A's:
        # the corrupted one recomputed, the clean one loaded and verified.
        assert result["outputs"] == [first["outputs"][0], second["outputs"][0]], log[-4000:]
        assert "KV checksum mismatch for request" in log and "(offloaded KV loaded back)" in log, log[-4000:]
        assert "KV checksums of request" in log and "verified" in log
        assert "Removing 1 Mooncake store blocks of request" in log, log[-4000:]
        assert "removed 1 keys of 1 blocks that failed their KV checksums" in log, log[-4000:]
        # The corrupted key is gone, the others stay.
        _wait_for(lambda: victim not in master.keys(), "the corrupted key to be removed")
        assert master.keys() == keys - {victim}
    finally:
        a.close()
