"""KV loaded back from a real Mooncake store is checked, what fails is removed,
and KV that failed its check never goes back into the store.

Real parts only: a `mooncake_master` (from mooncake-transfer-engine-non-cuda)
on loopback ports, two real vLLM engines of the patched tree on the CPU
backend with MooncakeStoreConnector over TCP and KV checksums on, and the
store's own client API in the test to read keys and corrupt a value.

Instance A (kv_both, fail-open) computes three prompts and stores their full
blocks, each value carrying its block's checksum entry. The test flips one
bit in the KV part of one value of the first prompt and of the third.

A serves the third prompt again with its own prefix cache emptied: it loads
the prompt back from the store, finds the mismatch, has the bad block's keys
removed and, fail-open, uses the KV. That block and every one after it stay
the request's own (vllm_kvchecksum.engine.export_guard): A's store connector
does not put the bad block back (before the guard it did, with an entry
computed from the corrupted bytes, which every later load then verified), and
a second request on A hits only the blocks before it, locally, and the store
has nothing after them.

Then instance B (kv_consumer, empty cache, fail-closed, policy recompute)
serves all three from the store: the first is a mismatch at its bad block,
B's scheduler has worker rank 0 remove the block's keys from the store, and
the request is recomputed; the second loads and verifies; the third loads
only the blocks before A's bad one (a store miss from there) and computes the
rest. All outputs equal A's first ones. Afterwards the removed keys are gone
from the store and the others are still there.

Marked e2e (two engines; about two minutes on two cores).
"""

from __future__ import annotations

import json
import os
import re
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

    def __init__(self, role: str, master: Master, tmp: Path, lookup_rpc_port: int, fail_open: bool = False):
        env = dict(os.environ, MOONCAKE_CONFIG_PATH=str(master.config), KVCS_STORE_MODEL=str(MODEL),
                   KVCS_LOOKUP_RPC_PORT=str(lookup_rpc_port), KVCS_FAIL_OPEN="1" if fail_open else "0",
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

    def reset_prefix_cache(self) -> bool:
        self.proc.stdin.write(json.dumps({"reset_prefix_cache": True}) + "\n")
        self.proc.stdin.flush()
        return self._next(60)["reset"]

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


def _wait_for(predicate, what: str, timeout: float = 120):
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


def _corrupt(store, key: str) -> bytes:
    """Flip one bit of the KV of one stored value, through the store's API; the corrupted value."""
    value = bytearray(store.get(key))
    assert len(value) > 8
    value[len(value) // 3] ^= 0x04
    assert store.upsert(key, bytes(value)) == 0
    assert bytes(store.get(key)) == bytes(value)
    return bytes(value)


def _bad_position(log: str) -> int:
    """The one block position a fail-open load's mismatch names in the engine's log."""
    found = re.findall(r"\(offloaded KV loaded back\): group 0 differs at block positions (\d+) .*fail-open", log)
    assert len(found) == 1, log[-4000:]
    return int(found[0])


def _series_lacks_export_guard() -> bool:
    """Only under `make check-series` (which runs this test from patch 0016 on):
    whether this prefix of the series is before the patch that keeps KV which
    failed its check from leaving the instance; the fail-open part is left out
    there. Anywhere else False, so a lost guard fails the test."""
    tree = os.environ.get("KVCS_VLLM_TREE")
    if not tree:
        return False
    store_scheduler = Path(tree) / "vllm/distributed/kv_transfer/kv_connector/v1/mooncake/store/scheduler.py"
    return "_keep_failed_kv_out" not in store_scheduler.read_text()


def test_corrupted_store_value_is_caught_removed_and_recomputed(master, tmp_path):
    bad_prompt, clean_prompt, reused_prompt = _prompt(1), _prompt(2), _prompt(3)
    guarded = not _series_lacks_export_guard()
    # Each instance its own lookup_rpc_port (see store_engine.py).
    a = Engine("kv_both", master, tmp_path, lookup_rpc_port=master.http, fail_open=True)
    try:
        first = a.generate([bad_prompt])
        _wait_for(lambda: len(master.keys()) == 4, "A's 4 blocks of the first prompt in the store")
        bad_prompt_keys = master.keys()
        second = a.generate([clean_prompt])
        _wait_for(lambda: len(master.keys()) == 8, "A's 4 blocks of the second prompt in the store")
        before = master.keys()
        third = a.generate([reused_prompt])
        _wait_for(lambda: len(master.keys()) == 12, "A's 4 blocks of the third prompt in the store")
        keys = master.keys()
        # Values with checksums have their own namespace.
        assert all("@kv_checksums" in k for k in keys), keys

        # Corrupt one stored value of the first prompt and one of the third: one bit of its KV.
        store = master.client()
        victim, reused_victim = sorted(bad_prompt_keys)[0], sorted(keys - before)[0]
        _corrupt(store, victim)
        bad, removed_by_a, removed = 4, 0, {victim}
        if guarded:
            corrupted = _corrupt(store, reused_victim)
            removed.add(reused_victim)
            # A (fail-open), its own prefix cache emptied, loads the third
            # prompt back from the store: a mismatch at the bad block, whose
            # keys A's worker removes, and A uses the KV. That block and all
            # after it stay the request's own: A's store connector does not put
            # the bad block back (before patch 0027 it did, with an entry
            # computed from the corrupted bytes, which every later load then
            # verified).
            assert a.reset_prefix_cache()
            again = a.generate([reused_prompt])
            assert again["cached"] == [4 * BLOCK], a.log()[-4000:]
            bad = _bad_position(a.log())
            _wait_for(lambda: "removed 1 keys of 1 blocks that failed their KV checksums" in a.log(),
                      "A to remove the bad block's keys")
            removed_by_a = a.log().count("removed 1 keys of 1 blocks that failed their KV checksums")
            assert removed_by_a == 1, a.log()[-4000:]
            # A's worker runs its store jobs in order, one queue: once a
            # later request's blocks are in the store, any store job of that
            # request is done.
            a.generate([_prompt(4)])
            _wait_for(lambda: len(master.keys() - keys) == 4, "A's 4 blocks of a later prompt in the store")
            assert reused_victim not in master.keys(), "A put the block that failed its check back into the store"
            keys |= master.keys() - keys

        b = Engine("kv_consumer", master, tmp_path, lookup_rpc_port=master.metrics)
        try:
            result = b.generate([bad_prompt, clean_prompt, reused_prompt])
        finally:
            b.close()
            log = b.log()
            (tmp_path / "engine-b.log").write_text(log)
        # The first two served from the store (4 blocks each), and the outputs
        # are A's: the corrupted one recomputed, the clean one loaded and
        # verified. The third loaded only the blocks before A's bad one (the
        # store misses from there) and computed the rest: B never loads what A
        # found bad, neither verified nor as a mismatch.
        assert result["outputs"] == [first["outputs"][0], second["outputs"][0], third["outputs"][0]], log[-4000:]
        if guarded:
            # (Before the later patches of the series, a request's cached count
            # is taken after a failed load's rollback: the first prompt's is 32.)
            assert result["cached"] == [4 * BLOCK, 4 * BLOCK, bad * BLOCK], log[-4000:]
        assert "KV checksum mismatch for request" in log and "(offloaded KV loaded back)" in log, log[-4000:]
        assert log.count("KV checksum mismatch for request") == 1, log[-4000:]
        assert "KV checksums of request" in log and "verified" in log
        assert "Removing 1 Mooncake store blocks of request" in log, log[-4000:]
        assert "removed 1 keys of 1 blocks that failed their KV checksums" in log, log[-4000:]
        # B's own worker removed them (not A's: each has its own lookup channel).
        assert a.log().count("removed 1 keys of 1 blocks that failed their KV checksums") == removed_by_a
        # The corrupted keys are gone, the others stay (asked of the store's client and its master).
        _wait_for(lambda: victim not in master.keys(), "the corrupted key to be removed")
        assert all(store.is_exist(k) == 0 for k in removed)
        assert master.keys() == keys - removed
        assert all(store.is_exist(k) == 1 for k in keys - removed)
        if not guarded:
            return

        # A second request on A hits its own prefix cache up to the bad block
        # only, and the store has nothing from there: it computes the rest,
        # and its store connector puts that block again, computed afresh.
        again_on_a = a.generate([reused_prompt])
        assert again_on_a["cached"] == [bad * BLOCK], a.log()[-4000:]
        assert again_on_a["outputs"] == third["outputs"]
        try:
            _wait_for(lambda: reused_victim in master.keys(), "A to store the recomputed block")
        except AssertionError:
            # A put that failed in Mooncake's transfer (TRANSFER_FAIL, seen once
            # on a quiet machine) is A's worker's warning, not a kept-out block:
            # serving the prompt again puts the missing key again.
            assert "batch_put failed" in a.log(), a.log()[-4000:]
            a.generate([reused_prompt])
            _wait_for(lambda: reused_victim in master.keys(), "A to store the recomputed block, once more")
        assert bytes(store.get(reused_victim)) != corrupted
    finally:
        (tmp_path / "engine-a.log").write_text(a.log())
        a.close()
