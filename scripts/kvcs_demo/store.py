"""make demo --mode store: KV loaded back from a real Mooncake store is checked.

    PYTHONPATH=scripts .venv/bin/python -m kvcs_demo --mode store [--kinds ...] [--ttft-requests N]

Real parts only: a `mooncake_master` (the binary next to sys.executable, on
free loopback ports, HTTP metadata server on), and real OpenAI-compatible
vLLM servers of the patched tree on the CPU backend with
MooncakeStoreConnector over TCP (block size 32, the tiny Llama, the demo's
CPU server settings), each in its own process group:

- A: kv_role kv_both, enable_kv_checksum: computes prompts and stores their
  full blocks, each value carrying its block's checksum entry (8 bytes, the
  value's last region; keys in the `@kv_checksums` namespace);
- B: kv_role kv_consumer, empty cache, enable_kv_checksum,
  kv_checksum_fail_closed, kv_load_failure_policy recompute: serves the same
  prompts from the store; its scheduler checks every load, and on a mismatch
  worker rank 0 removes the failing blocks' keys from the store;
- A_off / B_off (for the TTFT phase only): the same pair without
  enable_kv_checksum, on the same master (keys of another namespace).

Phases, each with a prompt of its own (token ids drawn from sha256 of the
phase's name, so no two prompts share a first block; BLOCKS full blocks and
a partial one):

- clean: A stores the prompt, B serves it: the load is verified, B's output
  equals A's.
- one per fault kind (STORE_FAULTS), injected through the store's own client
  (get, then upsert) between A's store and B's load: flip_bit (one bit of a
  value's KV), change_entry (one bit of its last 8 bytes, the stored checksum
  entry), swap_values (two of the prompt's values exchanged: misplaced
  blocks), other_prefix (the value the clean prompt stored at the same
  position, intact KV of another prefix). Each must be a mismatch at exactly
  the faulted block position(s) in B's log line, the faulted keys (and only
  those) must be gone from the store afterwards, and B's output (recomputed)
  must equal A's.
- ttft: N prompts stored by A (A_off) and served by B (B_off) with
  max_tokens 1, the two pairs taking turns; B's latency (store lookup, load,
  the checksum check, prefill of the partial block, first token) p50 with
  checksums on and off, and their ratio. Every request must have hit the
  store for all its full blocks (vllm:external_prefix_cache_hits of B).

Which key holds which block position: A is sent the prompt one block at a
time (its first 32, 64, ... tokens, max_tokens 1) and the demo waits, after
each, for the one key it adds to the master's key list (/get_all_keys on the
master's metrics port); the key A's k-th request adds is the block at
position k - 1 (the connector stores every full block the store lacks, and
A's own prefix cache holds the earlier ones). This needs neither vLLM's block
hashing (hash function, NONE_HASH seed, extra keys) in the demo nor any
assumption about the order or timing of the puts, and it fails loudly
(ValueError) when a step adds no key or more than one. Then A computes the
whole prompt once more for the reference output; that must add no key.

Verdicts come from B's /metrics (the vllm:kv_checksum_offloaded_* counters'
deltas over the phase), the reported positions from B's log line `KV
checksum mismatch for request '<id>' (offloaded KV loaded back): group 0
differs at block positions ...`, the removal from B's `Removing N Mooncake
store blocks of request <id> ... (block positions [...])` line and the
master's key list. Prints one line per phase and a table, writes
build/demo/report-store.json (schema: docs/e2e.md), exits 1 if any check
fails; every process it started (master included) is stopped on exit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvcs_demo import prom
from kvcs_demo.client import OUTPUT_TOKENS, completion, text_of
from kvcs_demo.servers import ProcessGroup, ServerSpec, free_port_block
from kvcs_demo.summary import log, log_ending

STORE_FAULTS = ("flip_bit", "change_entry", "swap_values", "other_prefix")
# The block positions each fault hits (the prompt has BLOCKS full blocks).
FAULT_POSITIONS = {"flip_bit": (1,), "change_entry": (3,), "swap_values": (0, 2), "other_prefix": (2,)}
BLOCK = 32
BLOCKS = 4  # full blocks per prompt
TAIL = 7  # tokens after them (a partial block: computed, never stored)
ENTRY_BYTES = 8  # the checksum entry, the last region of every value
NAMESPACE = "@kv_checksums"
VOCAB = (4, 512)  # the tiny Llama's word ids
STARTUP_TIMEOUT_S = 900.0
KEY_WAIT_S = 30.0
VERDICT_WAIT_S = 15.0
REMOVAL_WAIT_S = 20.0
REPORT_NAME = "report-store.json"
OFFLOADED_LOADS = ("offloaded_loads_verified", "offloaded_loads_mismatched", "offloaded_loads_unverified",
                   "offloaded_loads_not_checked")
HITS = "external_prefix_cache_hits"


# ----------------------------------------------------------------- the master

def wait_port(port: int, deadline: float, host: str = "127.0.0.1") -> None:
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on {port}")


def kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, the process group of `proc` (its leader's pid)."""
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


class Master:
    """A real `mooncake_master` on free loopback ports, and its client config.

    Writes `<prefix>master.log` (its output) and `<prefix>mooncake.json` (the
    config vLLM's store connector reads from MOONCAKE_CONFIG_PATH) into
    `tmp`. With `group` (a ProcessGroup) it is started and stopped as one of
    the demo's processes; without, in a session of its own, stopped by stop().
    """

    def __init__(self, tmp: Path, group: ProcessGroup | None = None, prefix: str = ""):
        bindir = Path(sys.executable).parent
        self.rpc, self.http, self.metrics = (p := free_port_block(3)), p + 1, p + 2
        argv = [str(bindir / "mooncake_master"), f"--rpc_port={self.rpc}", "--rpc_address=127.0.0.1",
                "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.http}", "--metrics_host=127.0.0.1",
                f"--metrics_port={self.metrics}"]
        self.group = group
        self.managed = None
        self.log_path = tmp / f"{prefix}master.log"
        if group is not None:
            self.managed = group.start(ServerSpec("mooncake-master", argv, {}, self.metrics, self.log_path,
                                                  health_path="/health"))
            group.wait_healthy([self.managed], timeout=60)
            self.proc = self.managed.popen
        else:
            self.log = open(self.log_path, "w")
            self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_port(self.rpc, time.time() + 30)
        wait_port(self.http, time.time() + 30)
        self.config = tmp / f"{prefix}mooncake.json"
        self.config.write_text(json.dumps({
            "metadata_server": f"http://127.0.0.1:{self.http}/metadata",
            "master_server_address": f"127.0.0.1:{self.rpc}", "protocol": "tcp", "device_name": "",
            "global_segment_size": "256MB", "local_buffer_size": "64MB"}))

    def keys(self) -> set[str]:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(f"http://127.0.0.1:{self.metrics}/get_all_keys", timeout=10) as r:
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
        if self.managed is not None:
            self.group.stop(self.managed)
        else:
            kill_group(self.proc)
            self.log.close()


# ----------------------------------------------------------------- pure parts

def prompt_tokens(key: str, blocks: int = BLOCKS, tail: int = TAIL) -> list[int]:
    """Token ids of a prompt of its own for `key` (blocks full blocks and `tail` more)."""
    lo, hi = VOCAB
    ids, counter = [], 0
    while len(ids) < blocks * BLOCK + tail:
        digest = hashlib.sha256(f"{key}/{counter}".encode()).digest()
        ids += [int.from_bytes(digest[i:i + 2], "little") % (hi - lo) + lo for i in range(0, len(digest), 2)]
        counter += 1
    return ids[:blocks * BLOCK + tail]


def keys_in_order(snapshots: list[set[str]]) -> list[str]:
    """The prompt's keys by block position, from the key sets seen before and
    after each of A's one-block-longer requests: snapshots[0] before the
    first, snapshots[k] after the k-th, whose one new key is position k - 1."""
    order = []
    for k in range(1, len(snapshots)):
        gone = snapshots[k - 1] - snapshots[k]
        new = snapshots[k] - snapshots[k - 1]
        if gone:
            raise ValueError(f"keys vanished while storing block {k - 1}: {sorted(gone)}")
        if len(new) != 1:
            raise ValueError(f"storing block {k - 1} added {len(new)} keys, not one: {sorted(new)}")
        order.append(new.pop())
    return order


def in_namespace(keys, checksums: bool) -> set[str]:
    """The keys of values with checksum entries (or, checksums False, of those without)."""
    return {k for k in keys if (NAMESPACE in k) == checksums}


def flip_kv_bit(value: bytes) -> tuple[bytes, dict]:
    """One bit flipped in the KV part of a value (a third into it; the entry untouched)."""
    kv_len = len(value) - ENTRY_BYTES
    if kv_len <= 0:
        raise ValueError(f"a value of {len(value)} bytes has no KV before its {ENTRY_BYTES}-byte entry")
    out = bytearray(value)
    byte = kv_len // 3
    out[byte] ^= 0x04
    return bytes(out), {"byte": byte, "bit": 2}


def flip_entry_bit(value: bytes) -> tuple[bytes, dict]:
    """One bit flipped in the value's last ENTRY_BYTES bytes: the stored checksum entry."""
    if len(value) <= ENTRY_BYTES:
        raise ValueError(f"a value of {len(value)} bytes has no KV before its {ENTRY_BYTES}-byte entry")
    out = bytearray(value)
    byte = len(value) - ENTRY_BYTES + 3
    out[byte] ^= 0x10
    return bytes(out), {"byte": byte, "bit": 4, "entry_byte": 3}


@dataclass
class FaultPlan:
    kind: str
    positions: list[int]  # block positions whose values change (sorted)
    writes: dict[str, bytes]  # key -> the value upserted under it
    detail: dict = field(default_factory=dict)


def plan_fault(kind: str, keys: list[str], values: dict[str, bytes], donor: dict[int, tuple[str, bytes]],
               positions: tuple[int, ...] | None = None) -> FaultPlan:
    """What to upsert for fault `kind` on a prompt whose keys (by position) are `keys`.

    values: the prompt's current values by key (at least those at the
    positions). donor: another prompt's (key, value) by position, for
    other_prefix. Every plan changes the value at each of its positions.
    """
    positions = tuple(FAULT_POSITIONS[kind] if positions is None else positions)
    if any(not 0 <= p < len(keys) for p in positions):
        raise ValueError(f"{kind}: positions {positions} outside the prompt's {len(keys)} blocks")
    writes: dict[str, bytes] = {}
    detail: dict = {}
    if kind in ("flip_bit", "change_entry"):
        [p] = positions
        writes[keys[p]], detail = (flip_kv_bit if kind == "flip_bit" else flip_entry_bit)(values[keys[p]])
    elif kind == "swap_values":
        i, j = positions
        writes = {keys[i]: values[keys[j]], keys[j]: values[keys[i]]}
    elif kind == "other_prefix":
        [p] = positions
        donor_key, donor_value = donor[p]
        if len(donor_value) != len(values[keys[p]]):
            raise ValueError(f"other_prefix: the donor value has {len(donor_value)} bytes, the victim "
                             f"{len(values[keys[p]])}")
        writes[keys[p]] = donor_value
        detail = {"donor_key": donor_key}
    else:
        raise ValueError(f"unknown store fault {kind!r}; known: {', '.join(STORE_FAULTS)}")
    for key, new in writes.items():
        if new == values[key]:
            raise ValueError(f"{kind}: the value of {key} would not change")
    return FaultPlan(kind, sorted(positions), writes, detail)


_MISMATCH = re.compile(r"KV checksum mismatch for request '([^']*)' \(offloaded KV loaded back\): (.*)")
_VERIFIED = re.compile(r"KV checksums of request '([^']*)' verified \(offloaded KV loaded back\)")
_GROUP = re.compile(r"group (\d+) differs at block positions ([\d, \-]+) \(")
_REMOVING = re.compile(r"Removing (\d+) Mooncake store blocks of request (\S+) that failed their KV checksums "
                       r"\(block positions \[([\d, ]*)\]\)")
_REMOVED = re.compile(r"Mooncake store: removed (\d+) keys of (\d+) blocks that failed their KV checksums")


def expand_positions(ranges: str) -> list[int]:
    """"1, 3-5" -> [1, 3, 4, 5] (the positions format of the mismatch line)."""
    out = []
    for part in ranges.split(","):
        part = part.strip()
        if "-" in part:
            lo, hi = part.split("-")
            out += range(int(lo), int(hi) + 1)
        elif part:
            out.append(int(part))
    return sorted(out)


def parse_log(text: str, request_id: str) -> dict:
    """What B's log says about the request: the mismatch line's positions per
    group (the first such line), whether a verified line names it, the
    positions its removal line names, and the keys the workers removed
    (summed over every removal line in `text`: pass only the phase's part)."""
    reported: dict[int, list[int]] = {}
    for rid, rest in _MISMATCH.findall(text):
        if request_id in rid:
            reported = {int(g): expand_positions(ps) for g, ps in _GROUP.findall(rest)}
            break
    removal: list[int] | None = None
    for _, rid, ps in _REMOVING.findall(text):
        if request_id in rid:
            removal = sorted(int(p) for p in ps.split(",") if p.strip())
            break
    removed = [(int(k), int(b)) for k, b in _REMOVED.findall(text)]
    return {"reported": reported, "verified_logged": any(request_id in rid for rid in _VERIFIED.findall(text)),
            "removal_logged": removal, "keys_removed_logged": sum(k for k, _ in removed)}


def flatten_counts(samples: dict) -> dict[str, float]:
    """vllm:kv_checksum_*_total counters as "name" / "name/reason", plus B's
    external prefix cache hits (tokens), from a prom.scrape()."""
    counts: dict[str, float] = {}
    for (name, labels), value in samples.items():
        if name == f"vllm:{HITS}_total":
            counts[HITS] = counts.get(HITS, 0) + value
            continue
        if not name.startswith("vllm:kv_checksum_") or not name.endswith("_total"):
            continue
        key = name[len("vllm:kv_checksum_"):-len("_total")]
        reason = dict(labels).get("reason")
        key = f"{key}/{reason}" if reason else key
        counts[key] = counts.get(key, 0) + value
    return counts


def diff(after: dict[str, float], before: dict[str, float]) -> dict[str, int]:
    return {k: int(v - before.get(k, 0)) for k, v in after.items() if v - before.get(k, 0)}


def total(delta: dict[str, int], name: str) -> int:
    return sum(v for k, v in delta.items() if k.split("/")[0] == name)


def loads_in(delta: dict[str, int]) -> int:
    return sum(total(delta, name) for name in OFFLOADED_LOADS)


def verdict_of(delta: dict[str, int]) -> str:
    """The phase's verdict from B's counter deltas: mismatch if any load
    mismatched (a recompute may load the blocks before it again, verified)."""
    if total(delta, "offloaded_loads_mismatched"):
        return "mismatch"
    if total(delta, "offloaded_loads_unverified"):
        return "unverified"
    if total(delta, "offloaded_loads_not_checked"):
        return "not_checked"
    if total(delta, "offloaded_loads_verified"):
        return "verified"
    return "no_load"


@dataclass
class StorePhase:
    phase: str
    request_id: str
    keys: list[str] = field(default_factory=list)  # the prompt's keys by block position
    fault: dict | None = None  # {"kind", "positions", "keys", ...detail}
    expected: str = "verified"
    expected_positions: list[int] = field(default_factory=list)
    metrics: dict[str, int] = field(default_factory=dict)
    verdict: str = "no_load"
    reported: dict[int, list[int]] = field(default_factory=dict)
    verified_logged: bool = False
    removal_logged: list[int] | None = None
    keys_removed_logged: int = 0
    keys_removed: list[int] = field(default_factory=list)  # positions whose keys are gone from the store
    other_keys_removed: int = 0  # keys of other prompts gone during the phase
    status: int = 0
    output_equal: bool | None = None
    timings_ms: dict[str, float] = field(default_factory=dict)
    ok: bool = False
    problem: str = ""


def judge_phase(ph: StorePhase, blocks: int = BLOCKS) -> StorePhase:
    """Whether the phase went as its fault says it must (sets ok and problem)."""
    problems = []
    m = ph.metrics
    if ph.status != 200:
        problems.append(f"B answered HTTP {ph.status}")
    if ph.output_equal is not True:
        problems.append("B's output differs from A's" if ph.output_equal is False else "no output to compare")
    if total(m, "offloaded_loads_unverified") or total(m, "offloaded_loads_not_checked"):
        problems.append(f"a load was unverified or not checked: {json.dumps(m, sort_keys=True)}")
    if ph.expected == "verified":
        if ph.verdict != "verified" or total(m, "offloaded_loads_verified") != 1:
            problems.append(f"verdict {ph.verdict} ({json.dumps(m, sort_keys=True)}), expected one verified load")
        if total(m, HITS) != blocks * BLOCK:
            problems.append(f"B's store hits {total(m, HITS)} tokens, expected {blocks * BLOCK}")
        if ph.reported:
            problems.append(f"mismatch reported at {ph.reported}")
        if ph.keys_removed:
            problems.append(f"keys removed at positions {ph.keys_removed}")
    else:
        want = ph.expected_positions
        if ph.verdict != "mismatch" or total(m, "offloaded_loads_mismatched") != 1:
            problems.append(f"verdict {ph.verdict} ({json.dumps(m, sort_keys=True)}), expected one mismatched load")
        if total(m, "offloaded_mismatched_blocks") != len(want):
            problems.append(f"{total(m, 'offloaded_mismatched_blocks')} mismatched blocks counted, "
                            f"expected {len(want)}")
        if ph.reported != {0: want}:
            problems.append(f"reported positions {ph.reported}, injected {{0: {want}}}")
        if ph.removal_logged != want:
            problems.append(f"removal logged for positions {ph.removal_logged}, expected {want}")
        if ph.keys_removed_logged != len(want):  # by B's own worker rank 0, in B's log
            problems.append(f"B's worker logged {ph.keys_removed_logged} keys removed, expected {len(want)}")
        if ph.keys_removed != want:
            problems.append(f"keys gone from the store at positions {ph.keys_removed}, expected {want}")
    if ph.other_keys_removed:
        problems.append(f"{ph.other_keys_removed} keys of other prompts vanished")
    ph.problem = "; ".join(problems)
    ph.ok = not problems
    return ph


def ttft_summary(times: dict[str, list[float]], hits: dict[str, int], n: int, verified_on: int,
                 mismatched_on: int) -> dict:
    p50 = {k: statistics.median(v) * 1000 if v else None for k, v in times.items()}
    ratio = p50["on"] / p50["off"] if p50["on"] and p50["off"] else None
    return {"requests_each": n, "on_p50_ms": p50["on"], "off_p50_ms": p50["off"], "ratio": ratio,
            "on_ms": [round(t * 1000, 1) for t in times["on"]], "off_ms": [round(t * 1000, 1) for t in times["off"]],
            "store_hits": hits, "verified_on": verified_on, "mismatched_on": mismatched_on}


def ttft_problems(t: dict | None, n: int) -> list[str]:
    if n <= 0:
        return []
    if not t:
        return ["ttft: not measured"]
    problems = []
    for side in ("on", "off"):
        if len(t[f"{side}_ms"]) != n:
            problems.append(f"ttft: {len(t[f'{side}_ms'])} of {n} {side} requests answered")
        if t["store_hits"][side] != n + 1:  # every request, warm-up included
            problems.append(f"ttft: {t['store_hits'][side]} of {n + 1} {side} requests hit the store for every block")
    if t["verified_on"] != n + 1 or t["mismatched_on"]:
        problems.append(f"ttft: {t['verified_on']} of {n + 1} loads with checksums verified, "
                        f"{t['mismatched_on']} mismatched")
    return problems


# ----------------------------------------------------------------- servers

@dataclass
class StoreServer:
    name: str  # A, B, A_off, B_off
    role: str  # kv_both / kv_consumer
    checksums: bool
    port: int = 0
    log_path: Path | None = None
    kv_config: dict = field(default_factory=dict)
    managed: object = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def store_kv_config(role: str, checksums: bool, lookup_rpc_port: int) -> dict:
    """The --kv-transfer-config of a store server (A: kv_both, B: kv_consumer).

    lookup_rpc_port: a number of the server's own. The connector's scheduler
    reaches worker rank 0 (lookups, and the removal of blocks that failed
    their checksums) over a ZMQ IPC socket whose path is made of
    VLLM_RPC_BASE_PATH, the host name, the DP rank and this number (0 by
    default): servers on one host with the same number share one path, the
    last one started takes it over, and one server's scheduler then asks
    another server's worker.
    """
    config: dict = {"kv_connector": "MooncakeStoreConnector", "kv_role": role,
                    "kv_connector_extra_config": {"lookup_rpc_port": lookup_rpc_port}}
    if checksums:
        config["enable_kv_checksum"] = True
    if role == "kv_consumer":
        if checksums:
            config["kv_checksum_fail_closed"] = True
        config["kv_load_failure_policy"] = "recompute"
    return config


def server_spec(server: StoreServer, model: Path, work: Path, python: str, master_config: Path) -> ServerSpec:
    from kvcs_demo.setups import Setup, server_argv, server_env

    server.port = free_port_block(1)
    server.kv_config = store_kv_config(server.role, server.checksums, server.port)
    server.log_path = work / f"store.{server.name}.log"
    setup = Setup(f"store-{server.name}", model, policy="recompute", checksums=server.checksums, faults=False,
                  mode="mooncake")
    argv = server_argv(python, setup, "kv_producer" if server.role == "kv_both" else "kv_consumer", server.port,
                       "cpu", server.kv_config)
    env = server_env("cpu", free_port_block(1), mode="mooncake") | {
        "MOONCAKE_CONFIG_PATH": str(master_config), "PYTHONUNBUFFERED": "1"}
    return ServerSpec(f"store-{server.name}", argv, env, server.port, server.log_path)


# ----------------------------------------------------------------- phases

def _counts(url: str) -> dict[str, float]:
    for attempt in range(3):
        try:
            return flatten_counts(prom.scrape(url))
        except prom.ScrapeError:
            if attempt == 2:
                raise
    return {}


def _wait(predicate, what: str, timeout: float):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.1)


@contextlib.contextmanager
def stderr_to(path: Path | None):
    """File descriptor 2 into `path` meanwhile (None: unchanged): the store
    client's C++ logging (glog, which writes to stderr and ignores GLOG_*
    variables here) goes to a log file instead of the demo's output."""
    if path is None:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "ab") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _log_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _log_since(path: Path, offset: int) -> str:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read().decode("utf-8", "replace")


class Demo:
    def __init__(self, master: Master, a: StoreServer, b: StoreServer, client, http, client_log: Path | None = None):
        self.master, self.a, self.b, self.store, self.http = master, a, b, client, http
        self.client_log = client_log  # where the store client's own logging goes
        self.stored: dict[str, list[str]] = {}  # phase -> its keys by position

    def completion(self, url: str, tokens: list[int], max_tokens: int, request_id: str) -> tuple[int, dict]:
        return completion(self.http, url, tokens, max_tokens=max_tokens, request_id=request_id)

    def store_prompt(self, server: StoreServer, tokens: list[int], rid: str) -> list[str]:
        """A stores the prompt one block at a time; its keys by position."""
        snapshots = [in_namespace(self.master.keys(), server.checksums)]
        for k in range(1, len(tokens) // BLOCK + 1):
            status, body = self.completion(server.url, tokens[:k * BLOCK], 1, f"{rid}.prefix{k}")
            if status != 200:
                raise RuntimeError(f"{server.name} answered HTTP {status} for block {k - 1}: {body}")
            _wait(lambda: len(in_namespace(self.master.keys(), server.checksums) - snapshots[-1]) >= 1,
                  f"{server.name}'s key of block {k - 1} in the store", KEY_WAIT_S)
            snapshots.append(in_namespace(self.master.keys(), server.checksums))
        return keys_in_order(snapshots)

    def inject(self, phase: str, keys: list[str]) -> FaultPlan:
        """The fault, through the store's client: get the values, upsert the changed ones."""
        values = {k: bytes(self.store.get(k)) for k in keys}
        donor_keys = self.stored.get("clean", [])
        donor = {p: (k, bytes(self.store.get(k))) for p, k in enumerate(donor_keys)}
        plan = plan_fault(phase, keys, values, donor)
        for key, data in plan.writes.items():
            rc = self.store.upsert(key, data)
            if rc != 0:
                raise RuntimeError(f"{phase}: upsert of {key} returned {rc}")
            if bytes(self.store.get(key)) != data:
                raise RuntimeError(f"{phase}: {key} does not read back as written")
        return plan

    def run_phase(self, phase: str) -> StorePhase:
        rid = f"store.{phase}"
        ph = StorePhase(phase, f"{rid}.b")
        tokens = prompt_tokens(rid)
        t0 = time.perf_counter()
        ph.keys = keys = self.store_prompt(self.a, tokens, rid)
        self.stored[phase] = keys
        status, ref_body = self.completion(self.a.url, tokens, OUTPUT_TOKENS, f"{rid}.a")
        reference = text_of(ref_body) if status == 200 else None
        t1 = time.perf_counter()
        before_keys = self.master.keys()
        if not set(keys) <= before_keys or len(in_namespace(before_keys, True) - set().union(
                *self.stored.values())):
            raise RuntimeError(f"{phase}: A's reference request changed the store's keys")
        if phase != "clean":
            ph.expected = "mismatch"
            with stderr_to(self.client_log):
                plan = self.inject(phase, keys)
            ph.expected_positions = plan.positions
            ph.fault = {"kind": phase, "positions": plan.positions,
                        "keys": [keys[p] for p in plan.positions], **plan.detail}
            before_keys = self.master.keys()
        t2 = time.perf_counter()
        before = _counts(self.b.url)
        offset = _log_size(self.b.log_path)
        ph.status, body = self.completion(self.b.url, tokens, OUTPUT_TOKENS, ph.request_id)
        t3 = time.perf_counter()
        out = text_of(body) if ph.status == 200 else None
        ph.output_equal = None if out is None or reference is None else out == reference
        try:
            _wait(lambda: loads_in(diff(_counts(self.b.url), before)) >= 1, "B's load to be counted",
                  VERDICT_WAIT_S)
            if ph.expected == "mismatch":
                gone = {keys[p] for p in ph.expected_positions}
                _wait(lambda: not gone & self.master.keys(), "the faulted keys to be removed", REMOVAL_WAIT_S)
        except TimeoutError as exc:
            log(f"[store] {phase}: {exc}")
        time.sleep(0.5)  # a recompute's second load, if any, is counted by now
        after_keys = self.master.keys()
        ph.metrics = diff(_counts(self.b.url), before)
        ph.verdict = verdict_of(ph.metrics)
        ph.keys_removed = [p for p, k in enumerate(keys) if k not in after_keys]
        ph.other_keys_removed = len(before_keys - set(keys) - after_keys)
        parsed = parse_log(_log_since(self.b.log_path, offset), ph.request_id)
        ph.reported, ph.verified_logged = parsed["reported"], parsed["verified_logged"]
        ph.removal_logged, ph.keys_removed_logged = parsed["removal_logged"], parsed["keys_removed_logged"]
        ph.timings_ms = {"store_and_reference": (t1 - t0) * 1000, "inject": (t2 - t1) * 1000,
                         "b_request": (t3 - t2) * 1000, "verdict_wait": (time.perf_counter() - t3) * 1000}
        return judge_phase(ph)


def phase_line(ph: StorePhase) -> str:
    if ph.expected == "verified":
        what = f"{ph.verdict} (verified {total(ph.metrics, 'offloaded_loads_verified')}, store hits " \
               f"{total(ph.metrics, HITS)} tokens); keys removed {ph.keys_removed or '-'}"
    else:
        what = (f"{ph.verdict} at {ph.reported.get(0, '-')} (injected {ph.expected_positions}); removal logged "
                f"{ph.removal_logged}; keys gone {ph.keys_removed}")
    out = {True: "output = A's", False: "output differs from A's", None: "no output"}[ph.output_equal]
    return f"[store] {ph.phase:<13} {what}; {out}; " + ("ok" if ph.ok else f"FAILED: {ph.problem}")


def measure_ttft(master: Master, pairs: dict[str, tuple[StoreServer, StoreServer]], n: int, http) -> dict:
    """B's latency of store hits (max_tokens 1), checksums on vs off, taking turns."""
    times: dict[str, list[float]] = {"on": [], "off": []}
    hits = {"on": 0, "off": 0}
    verified_on = mismatched_on = 0
    for i in range(n + 1):
        order = ("on", "off") if i % 2 else ("off", "on")
        for label in order:
            a, b = pairs[label]
            rid = f"store.ttft.{label}.{i:03d}"
            tokens = prompt_tokens(rid)
            known = in_namespace(master.keys(), a.checksums)
            status, body = completion(http, a.url, tokens, max_tokens=1, request_id=f"{rid}.a")
            if status != 200:
                raise RuntimeError(f"{a.name} answered HTTP {status}: {body}")
            _wait(lambda: len(in_namespace(master.keys(), a.checksums) - known) >= BLOCKS,
                  f"{a.name}'s {BLOCKS} blocks in the store", KEY_WAIT_S)
            before = _counts(b.url)
            t0 = time.perf_counter()
            status, _ = completion(http, b.url, tokens, max_tokens=1, request_id=f"{rid}.b")
            elapsed = time.perf_counter() - t0
            try:
                delta = _wait(lambda: (d := diff(_counts(b.url), before)) and total(d, HITS) and d or None,
                              f"{b.name}'s store hits to be counted", 5)
            except TimeoutError:
                delta = diff(_counts(b.url), before)
            hits[label] += total(delta, HITS) == BLOCKS * BLOCK
            if label == "on":
                verified_on += total(delta, "offloaded_loads_verified")
                mismatched_on += total(delta, "offloaded_loads_mismatched")
            if i > 0 and status == 200:  # the first round warms both pairs up
                times[label].append(elapsed)
    return ttft_summary(times, hits, n, verified_on, mismatched_on)


# ----------------------------------------------------------------- report

def startup_lines(path: Path | None) -> list[str]:
    text = path.read_text(errors="replace") if path is not None and path.exists() else ""
    return [msg for msg in (ln.split("] ", 1)[-1] for ln in text.splitlines()) if msg.startswith("KV checksums")
            and ("enabled" in msg or "Mooncake store" in msg)]


def build_report(args, model: Path, phases: list[StorePhase], ttft: dict | None, servers: dict, groups: dict,
                 errors: list[str], wall: float) -> dict:
    failures = list(errors)
    ran = [ph.phase for ph in phases]
    if not errors and ran != ["clean", *args.kinds]:
        failures.append(f"phases {ran} ran, not every one of clean + {args.kinds}")
    failures += [f"{ph.phase}: {ph.problem}" for ph in phases if not ph.ok]
    if not errors:
        failures += ttft_problems(ttft, args.ttft_requests)
    phase_dicts = []
    for ph in phases:
        d = dataclasses.asdict(ph)
        d["reported"] = {str(g): p for g, p in ph.reported.items()}
        d["timings_ms"] = {k: round(v, 1) for k, v in ph.timings_ms.items()}
        phase_dicts.append(d)
    return {"command": " ".join(sys.argv), "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                                       "device": "cpu"},
            "wall_s": round(wall, 1), "mode": "store", "model": str(model), "block_size": BLOCK,
            "blocks_per_prompt": BLOCKS, "prompt_tokens": BLOCKS * BLOCK + TAIL,
            "servers": {s.name: {"url": s.url, "kv_transfer_config": s.kv_config,
                                 "startup_log": startup_lines(s.log_path)} for s in servers.values()},
            "phases": phase_dicts, "ttft": ttft, "process_groups": groups,
            "failures": failures, "ok": not failures}


def print_table(report: dict) -> None:
    log("")
    log(f"{'phase':<13} {'verif':>5} {'mism':>5} {'hits':>5}  {'reported':<10} {'injected':<10} {'removed':<10} "
        f"{'out=A':<6} result")
    for ph in report["phases"]:
        m = ph["metrics"]
        rep = ph["reported"].get("0", "-") if ph["reported"] else "-"
        inj = ph["expected_positions"] or "-"
        log(f"{ph['phase']:<13} {total(m, 'offloaded_loads_verified'):>5} "
            f"{total(m, 'offloaded_loads_mismatched'):>5} {total(m, HITS):>5}  {str(rep):<10} {str(inj):<10} "
            f"{str(ph['keys_removed'] or '-'):<10} {('yes' if ph['output_equal'] else 'no'):<6} "
            + ("ok" if ph["ok"] else "FAILED"))
    log_ending(report, "store hits on B, max_tokens 1")


# ----------------------------------------------------------------- main

def default_model() -> Path:
    from kvcs_demo.setups import ROOT, SCRIPTS

    sys.path.insert(0, str(SCRIPTS))
    from make_tiny_model import make

    return make(ROOT / "build" / "tiny-llama").resolve()


def run(args) -> int:
    """`python -m kvcs_demo --mode store` (args from demo.parse_args)."""
    import httpx

    t0 = time.monotonic()
    work = args.out
    work.mkdir(parents=True, exist_ok=True)
    for pattern in (REPORT_NAME, "store.*.log", "store.mooncake.json"):
        for old in work.glob(pattern):
            if old.is_file():
                old.unlink()
    model = args.model.resolve() if args.model else default_model()
    servers = {"A": StoreServer("A", "kv_both", True), "B": StoreServer("B", "kv_consumer", True)}
    if args.ttft_requests > 0:
        servers |= {"A_off": StoreServer("A_off", "kv_both", False),
                    "B_off": StoreServer("B_off", "kv_consumer", False)}
    phases: list[StorePhase] = []
    ttft = None
    errors: list[str] = []
    groups: dict[str, int] = {}
    client = None
    with ProcessGroup() as group:
        try:
            master = Master(work, group, prefix="store.")
            groups["mooncake-master"] = master.managed.pgid
            specs = {name: server_spec(s, model, work, args.python, master.config) for name, s in servers.items()}
            for name in ("A", "B"):
                servers[name].managed = group.start(specs[name])
                groups[specs[name].name] = servers[name].managed.pgid
            log(f"started mooncake_master (rpc {master.rpc}, metrics {master.metrics}) and servers A, B "
                f"(logs in {work})")
            group.wait_healthy([servers["A"].managed, servers["B"].managed], timeout=STARTUP_TIMEOUT_S)
            log(f"[store] A and B healthy after {time.monotonic() - t0:.0f} s")
            if args.ttft_requests > 0:
                # Started now, so they do not slow A's and B's start; needed last.
                for name in ("A_off", "B_off"):
                    servers[name].managed = group.start(specs[name])
                    groups[specs[name].name] = servers[name].managed.pgid
            client_log = work / "store.client.log"
            with stderr_to(client_log):
                client = master.client()
            with httpx.Client(trust_env=False) as http:
                demo = Demo(master, servers["A"], servers["B"], client, http, client_log)
                for phase in ["clean", *args.kinds]:
                    ph = demo.run_phase(phase)
                    phases.append(ph)
                    log(phase_line(ph))
                if args.ttft_requests > 0:
                    group.wait_healthy([servers["A_off"].managed, servers["B_off"].managed],
                                       timeout=STARTUP_TIMEOUT_S)
                    log(f"[store] A_off and B_off healthy after {time.monotonic() - t0:.0f} s")
                    ttft = measure_ttft(master, {"on": (servers["A"], servers["B"]),
                                                 "off": (servers["A_off"], servers["B_off"])},
                                        args.ttft_requests, http)
                    log(f"[store] ttft          on p50 {ttft['on_p50_ms']:.0f} ms, off p50 "
                        f"{ttft['off_p50_ms']:.0f} ms, ratio {ttft['ratio']:.2f}; store hits on "
                        f"{ttft['store_hits']['on']}, off {ttft['store_hits']['off']} of {args.ttft_requests + 1}")
        except Exception as exc:  # reported as a failure, never a silent pass
            errors.append(f"{type(exc).__name__}: {exc}")
            log(f"[store] stopped: {errors[-1]}")
        finally:
            if client is not None:
                try:
                    with stderr_to(work / "store.client.log"):
                        client.close()
                except Exception:
                    pass
    report = build_report(args, model, phases, ttft, servers, groups, errors, time.monotonic() - t0)
    path = work / REPORT_NAME
    path.write_text(json.dumps(report, indent=2))
    print_table(report)
    log(f"report: {path}")
    return 0 if report["ok"] else 1
