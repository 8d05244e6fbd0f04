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
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "build" / "tiny-llama"
BLOCK = 32

# The master and its client live in the demo's store mode (make demo DEMO_ARGS="--mode store").
if str(ROOT / "scripts") not in sys.path:
    sys.path.insert(0, str(ROOT / "scripts"))
from kvcs_demo.store import Master, kill_group  # noqa: E402


class Engine:
    """A store_engine.py subprocess; `lines` is everything it printed."""

    def __init__(self, role: str, master: Master, tmp: Path, lookup_rpc_port: int):
        env = dict(os.environ, MOONCAKE_CONFIG_PATH=str(master.config), KVCS_STORE_MODEL=str(MODEL),
                   KVCS_LOOKUP_RPC_PORT=str(lookup_rpc_port),
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
        kill_group(self.proc)


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
    # Each instance its own lookup_rpc_port (see store_engine.py).
    a = Engine("kv_both", master, tmp_path, lookup_rpc_port=master.http)
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

        b = Engine("kv_consumer", master, tmp_path, lookup_rpc_port=master.metrics)
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
        # B's own worker removed them (not A's: each has its own lookup channel).
        assert "removed" not in "\n".join(l for l in a.log().splitlines() if "KV checksums" in l)
        # The corrupted key is gone, the others stay (asked of the store's client and its master).
        _wait_for(lambda: victim not in master.keys(), "the corrupted key to be removed")
        assert store.is_exist(victim) == 0
        assert master.keys() == keys - {victim}
        assert all(store.is_exist(k) == 1 for k in keys - {victim})
    finally:
        a.close()
