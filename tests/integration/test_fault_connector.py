"""KVChecksumFaultConnector (vllm_kvchecksum.drills.fault_connector): the drill
connector that corrupts loaded KV on the consumer.

Scheduler side: a real patched vLLM Scheduler whose connector is the fault
connector wrapping NixlConnector's scheduler half (pd_harness.make_side,
with its make_config swapped for one naming this connector). Worker side:
the fault connector over real CPU KV caches, wrapping StubLoadConnector (in
production the child is NixlConnector, whose worker half needs a NIXL agent
and a peer; the stub only reports the loads the test says finished).
End to end, the worker side runs inside vLLM's own V1 model-runner connector
path, so the fault lands between the load and the checksum as in vLLM.
"""

from __future__ import annotations

import json
import logging
import random

import numpy as np
import pd_harness
import pytest
import torch
from kv_setup import build_caches
from pd_harness import layer_name, make_request, make_side, prefill, prompt_of, run_local, stats
from vllm.config import (VllmConfig)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorRole,
                                                               KVConnectorTransferResults, SupportsHMA)
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

from vllm_kvchecksum.drills import fault_connector as fc
from vllm_kvchecksum.drills import faults
from vllm_kvchecksum.core.api import layer_block_checksums
from vllm_kvchecksum.core.blocks import request_blocks

PROMPT = 77  # 4 full 16-token blocks and a partial one
NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
NIXL_PUSH = {**NIXL, "kv_connector": "NixlPushConnector"}
STUB = {"kv_connector": "StubLoadConnector", "kv_connector_module_path": __name__, "kv_role": "kv_both"}
DETECTABLE = [k for k in faults.FAULT_KINDS if k != "change_tail"]


class StubLoadConnector(KVConnectorBase_V1, SupportsHMA):
    """The wrapped connector's worker half for these tests: reports the loads
    in `finished` (and `failed`, which also count as finished, as vLLM's
    connectors report them) at the next get_transfer_results."""

    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        self.finished: set[str] = set()
        self.failed: set[str] = set()
        # Checksums delivered with the loads (a connector-owned carrier).
        self.received: dict[str, bytes] = {}
        self.bound: list = []

    def bind_connector_metadata(self, connector_metadata):
        self.bound.append(connector_metadata)
        super().bind_connector_metadata(connector_metadata)

    def start_load_kv(self, forward_context, **kwargs): pass
    def wait_for_layer_load(self, layer_name): pass
    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs): pass
    def wait_for_save(self): pass
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        # With "sync_load_tokens" in its extra config: a connector that loads
        # that many tokens synchronously (in the step's forward).
        n = self._kv_transfer_config.kv_connector_extra_config.get("sync_load_tokens", 0)
        return (n, False) if n and num_computed_tokens == 0 else (0, False)

    def update_state_after_alloc(self, request, blocks, num_external_tokens): pass
    def build_connector_meta(self, scheduler_output): return None
    def request_finished_all_groups(self, request, block_ids): return False, None

    def get_transfer_results(self, finished_req_ids):
        done, failed, received = self.finished | self.failed, self.failed, self.received
        self.finished, self.failed, self.received = set(), set(), {}
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed, kv_checksums=received)


# -- configs -----------------------------------------------------------------

def fault_config(role: str = "kv_consumer", block_size: int = 16, *, faults_cfg=None, connectors=None,
                 enable: bool = True, fail_closed: bool = False, policy: str = "fail", tp: int = 1,
                 pp: int = 1, **kw) -> VllmConfig:
    """pd_harness.make_config, with the fault connector wrapping `connectors`."""
    extra = {"connectors": [NIXL] if connectors is None else connectors}
    if faults_cfg is not None:
        extra["kv_checksum_faults"] = faults_cfg
    return pd_harness.make_config(role, tp, pp, block_size, enable=enable, fail_closed=fail_closed, policy=policy,
                                  connector="KVChecksumFaultConnector", connector_extra=extra,
                                  connector_module_path="vllm_kvchecksum.drills.fault_connector", **kw)


@pytest.fixture
def sides(monkeypatch):
    """make_side, where faults_cfg=... gives a side with the fault connector."""
    plain = pd_harness.make_config

    def make_config(role, tp, pp, block_size, *, faults_cfg=None, connectors=None, **kw):
        if faults_cfg is None:
            return plain(role, tp, pp, block_size, **kw)
        kw.pop("connector", None)
        kw.pop("connector_extra", None)
        return fault_config(role, block_size, faults_cfg=faults_cfg, connectors=connectors, tp=tp, pp=pp, **kw)

    monkeypatch.setattr(pd_harness, "make_config", make_config)
    return make_side


def create(config, role, kv_cache_config):
    return KVConnectorFactory.create_connector(config, role, kv_cache_config)


def read_records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def drill_records(caplog, level) -> list[logging.LogRecord]:
    # One record may reach caplog's handler twice: through the logger and,
    # while vLLM's logging is not configured, through the root logger.
    unique = {id(r): r for r in caplog.records}
    return [r for r in unique.values() if r.name == fc.LOGGER_NAME and r.levelno == level]


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in drill_records(caplog, logging.WARNING)]


# -- 1. config ---------------------------------------------------------------

def test_good_config_parses():
    s = fc.parse_fault_settings({"kv_checksum_faults": {
        "kinds": ["flip_bit", "swap_blocks"], "rate": 0.25, "seed": 7, "log_path": "/tmp/x.jsonl",
        "control_path": "/tmp/c.json"}})
    assert s == fc.FaultSettings(("flip_bit", "swap_blocks"), 0.25, 7, "/tmp/x.jsonl", "/tmp/c.json")
    assert fc.parse_fault_settings({"kv_checksum_faults": {"position": 3}}).position == 3
    assert fc.parse_fault_settings({"kv_checksum_faults": {"target": "sends"}}).target == "sends"
    assert fc.parse_fault_settings({}).target == "loads"
    assert fc.parse_fault_settings({"kv_checksum_faults": {"kinds": "all"}}).kinds == fc.KNOWN_KINDS
    assert set(fc.KNOWN_KINDS) == set(faults.FAULT_KINDS) | {"drop_checksums"}
    # Defaults: every kind, every load, seed 0, no files.
    assert fc.parse_fault_settings({}) == fc.FaultSettings(fc.KNOWN_KINDS, 1.0, 0, None, None)


@pytest.mark.parametrize("section,key", [
    ({"kinds": ["flip_bit", "flip_bits"]}, "kv_checksum_faults.kinds"),
    ({"kinds": "flip_bit"}, "kv_checksum_faults.kinds"),
    ({"rate": 1.5}, "kv_checksum_faults.rate"),
    ({"rate": -0.1}, "kv_checksum_faults.rate"),
    ({"rate": "1"}, "kv_checksum_faults.rate"),
    ({"rate": True}, "kv_checksum_faults.rate"),
    ({"rate": float("nan")}, "kv_checksum_faults.rate"),
    ({"seed": "0"}, "kv_checksum_faults.seed"),
    ({"seed": 1.0}, "kv_checksum_faults.seed"),
    ({"log_path": ""}, "kv_checksum_faults.log_path"),
    ({"control_path": 3}, "kv_checksum_faults.control_path"),
    ({"rates": 1}, "kv_checksum_faults: unknown key"),
    ({"position": -1}, "kv_checksum_faults.position"),
    ({"position": 1.0}, "kv_checksum_faults.position"),
    ({"position": True}, "kv_checksum_faults.position"),
    ({"target": "send"}, "kv_checksum_faults.target"),
    ({"target": None}, "kv_checksum_faults.target"),
])
def test_bad_settings_name_the_key(section, key):
    with pytest.raises(ValueError, match=key):
        fc.parse_fault_settings({"kv_checksum_faults": section})


def test_unknown_kind_lists_the_known_ones():
    with pytest.raises(ValueError, match="known kinds: flip_bit, overwrite_piece.*drop_checksums"):
        fc.parse_fault_settings({"kv_checksum_faults": {"kinds": ["bit_rot"]}})


def test_connector_validates_at_startup():
    # Through vLLM's factory, as the engine builds it.
    kv_cache_config = pd_harness.KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[])
    good = create(fault_config(faults_cfg={"kinds": ["flip_bit"], "rate": 0.5, "seed": 3}),
                  KVConnectorRole.SCHEDULER, kv_cache_config)
    assert isinstance(good, fc.KVChecksumFaultConnector)
    assert good.settings.kinds == ("flip_bit",) and good.settings.rate == 0.5
    assert len(good.sub_connectors) == 1 and type(good.sub_connectors[0]).__name__.startswith("Nixl")
    # The checksum hooks come through MultiConnector's forwarding.
    assert good.can_carry_kv_checksums()
    with pytest.raises(ValueError, match="kv_checksum_faults.kinds.*known kinds"):
        create(fault_config(faults_cfg={"kinds": ["nope"]}), KVConnectorRole.SCHEDULER, kv_cache_config)
    with pytest.raises(ValueError, match="kv_checksum_faults.rate"):
        create(fault_config(faults_cfg={"rate": 2}), KVConnectorRole.SCHEDULER, kv_cache_config)


@pytest.mark.parametrize("connectors", [[], [NIXL, NIXL], "NixlConnector", [{"kv_role": "kv_both"}]],
                         ids=["zero", "two", "not-a-list", "no-name"])
def test_exactly_one_wrapped_connector(connectors):
    kv_cache_config = pd_harness.KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[])
    if hasattr(fc.KVChecksumFaultConnector, "kv_cache_access"):
        # vLLM 0.34 asks the connector class while it builds the config: the
        # same message, before any connector exists.
        with pytest.raises(ValueError, match=r"kv_connector_extra_config\.connectors"):
            fault_config(faults_cfg={}, connectors=connectors)
        return
    config = fault_config(faults_cfg={}, connectors=connectors)
    with pytest.raises(ValueError, match=r"kv_connector_extra_config\.connectors"):
        create(config, KVConnectorRole.SCHEDULER, kv_cache_config)
    # The classmethods vLLM calls before building a connector say the same.
    with pytest.raises(ValueError, match=r"kv_connector_extra_config\.connectors"):
        fc.KVChecksumFaultConnector.get_required_kvcache_layout(config)


# -- 2. control file -----------------------------------------------------------

def test_control_file(tmp_path, fault_logs):
    path = tmp_path / "faults.json"
    control = fc.ControlFile(str(path), ("flip_bit", "swap_blocks"), 0.5)
    assert control.settings() == (("flip_bit", "swap_blocks"), 0.5)  # missing: the config's
    path.write_text('{"kinds": []}')
    assert control.settings() == ((), 0.5)
    path.write_text('{"kinds": ["swap_heads"], "rate": 1}')
    assert control.settings() == (("swap_heads",), 1.0)
    path.write_text('{"rate": 0.125}')
    assert control.settings() == (("flip_bit", "swap_blocks"), 0.125)
    path.write_text('{"kinds": "all"}')
    assert control.settings() == (fc.KNOWN_KINDS, 0.5)
    path.unlink()
    assert control.settings() == (("flip_bit", "swap_blocks"), 0.5)
    assert warnings_of(fault_logs) == []
    # Invalid: no faults, one warning however many loads read it.
    path.write_text('{"kinds": ["flip_bit"], "rate": ')
    for _ in range(3):
        assert control.settings() == ((), 0.0)
    assert len(warnings_of(fault_logs)) == 1 and str(path) in warnings_of(fault_logs)[0]
    for bad in ('["flip_bit"]', '{"kinds": ["nope"]}', '{"rate": 3}', '{"kind": ["flip_bit"]}'):
        path.write_text(bad)
        assert control.settings() == ((), 0.0), bad
    assert len(warnings_of(fault_logs)) == 5


def test_control_file_is_read_only_when_changed(tmp_path, monkeypatch):
    path = tmp_path / "faults.json"
    path.write_text('{"kinds": ["flip_bit"]}')
    control = fc.ControlFile(str(path), (), 1.0)
    reads = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda *a, **k: reads.append(a[0]) or real_open(*a, **k))
    for _ in range(5):
        assert control.settings() == (("flip_bit",), 1.0)
    assert reads == [str(path)]


def test_control_file_switches_a_running_connector(tmp_path, sides):
    control = tmp_path / "faults.json"
    C = sides("kv_consumer", faults_cfg={"kinds": ["flip_bit"], "rate": 1.0, "control_path": str(control)})
    P = make_side("kv_producer")
    plans = []
    for i, text in enumerate([None, '{"kinds": []}', '{"kinds": ["swap_heads"], "rate": 1}', '{"rate": 0}',
                              "not json"]):
        if text is not None:
            control.write_text(text)
        preq, params = prefill(P, prompt_of(PROMPT, seed=i))
        req, out = start_load(C, preq, params)
        plans.append({k: p.kind for k, p in out.kv_connector_metadata.fault_plans.items()})
        assert set(plans[-1]) <= {req.request_id}
    assert [sorted(p.values()) for p in plans] == [["flip_bit"], [], ["swap_heads"], [], []]


# -- 3. determinism ------------------------------------------------------------

def decisions(seed, kinds=fc.KNOWN_KINDS, rate=0.5, n=40):
    decider = fc.FaultDecider(seed, fc.ControlFile(None, kinds, rate))
    return [decider.decide() for _ in range(n)]


def test_same_seed_same_decisions():
    first = decisions(11)
    assert first == decisions(11)
    assert first != decisions(12)
    assert any(d is None for d in first) and any(d is not None for d in first)
    # The documented rule (docs/fault-drills.md), so a run can be replayed.
    rng = random.Random(11)
    expected = []
    for _ in range(40):
        hit = rng.random() < 0.5
        expected.append(fc.FaultDecision(rng.choice(fc.KNOWN_KINDS), rng.getrandbits(63)) if hit else None)
    assert first == expected
    assert all(d is None for d in decisions(1, rate=0.0))
    assert all(d is None for d in decisions(1, kinds=(), rate=1.0))
    assert all(d is not None and d.kind == "flip_bit" for d in decisions(1, kinds=("flip_bit",), rate=1.0))


# -- 4. scheduler side: the plan is the checksum scheduler's blocks -------------

def start_load(C, preq, params):
    """The consumer starts loading a producer request: one schedule()."""
    req = make_request(preq.prompt_token_ids, params=dict(params), block_size=C.block_size)
    C.scheduler.add_request(req)
    out = C.scheduler.schedule()
    assert req.status.name == "WAITING_FOR_REMOTE_KVS", req.status
    return req, out


@pytest.mark.parametrize("num_local,window", [(0, None), (32, None), (0, 32), (48, 32)],
                         ids=["no-hit", "prefix-hit", "sliding-window", "sliding-window-prefix-hit"])
def test_plan_matches_add_recv(num_local, window, sides, tmp_path, monkeypatch):
    null_ids = []

    def spy(*args):
        null_ids.append(args[-1])
        return request_blocks(*args)

    monkeypatch.setattr(fc, "request_blocks", spy)
    log = tmp_path / "injections.jsonl"
    C = sides("kv_consumer", sliding_window=window,
              faults_cfg={"kinds": ["flip_bit"], "rate": 1.0, "seed": 4, "log_path": str(log)})
    P = make_side("kv_producer", sliding_window=window)
    prompt = prompt_of(PROMPT)
    if num_local:
        run_local(C, prompt[:num_local])
    preq, params = prefill(P, prompt)
    req, out = start_load(C, preq, params)
    meta = out.kv_connector_metadata
    assert isinstance(meta, fc.FaultConnectorMetadata) and len(meta.metadata) == 1
    plan = meta.fault_plans[req.request_id]
    recv = C.scheduler.kv_checksum._recvs[req.request_id].blocks
    assert plan.groups == {g: (b.start, b.block_ids) for g, b in recv.groups.items()}
    assert plan.num_tokens == recv.num_tokens
    assert plan.kind == "flip_bit"
    if window:
        assert set(plan.groups) == {0, 1}
        # The sliding-window group is clipped to what NIXL transfers.
        assert len(plan.groups[1][1]) <= -(-window // 16) + 1
    assert plan.groups[0][0] == num_local // 16
    # The null block id the checksum scheduler got from the Scheduler.
    assert null_ids == [C.scheduler.kv_checksum.null_block_id]
    # Sent once: the next step's metadata carries no plan.
    C.run_workers(out)
    assert C.scheduler.schedule().kv_connector_metadata.fault_plans == {}
    assert not log.exists()  # nothing injected yet: the workers do that


def test_plans_are_reproducible(sides):
    cfg = {"kinds": "all", "rate": 1.0, "seed": 9}
    runs = []
    for _ in range(2):
        C = sides("kv_consumer", faults_cfg=cfg)
        P = make_side("kv_producer")
        plans = []
        for i in range(3):
            preq, params = prefill(P, prompt_of(PROMPT, seed=i))
            req, out = start_load(C, preq, params)
            plans.extend((p.kind, p.seed) for p in out.kv_connector_metadata.fault_plans.values())
        runs.append(plans)
    assert runs[0] == runs[1]


def test_sync_loads_are_not_planned(sides, tmp_path):
    # Only async loads are checksummed (add_recv), and only they are reported
    # in finished_recving: a sync load gets no plan, and a record says why.
    log = tmp_path / "injections.jsonl"
    child = {**STUB, "kv_connector_extra_config": {"sync_load_tokens": 32}}
    C = sides("kv_consumer", faults_cfg={"kinds": ["flip_bit"], "log_path": str(log)}, connectors=[child])
    req = make_request(prompt_of(PROMPT), block_size=C.block_size)
    C.scheduler.add_request(req)
    out = C.scheduler.schedule()
    assert req.status.name == "RUNNING" and out.num_scheduled_tokens[req.request_id] == PROMPT - 32
    assert out.kv_connector_metadata.fault_plans == {}
    [record] = read_records(log)
    assert record["request_id"] == req.request_id and record["side"] == "scheduler"
    assert record["skipped"] == "not an asynchronous load (request status RUNNING)"


def test_scheduler_side_errors_do_not_stop_the_engine(sides, tmp_path, monkeypatch, fault_logs):
    log = tmp_path / "injections.jsonl"
    C = sides("kv_consumer", faults_cfg={"kinds": ["flip_bit"], "log_path": str(log)})
    P = make_side("kv_producer")
    conn = C.scheduler.connector

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    # Deciding raises: the load goes on, unfaulted.
    monkeypatch.setattr(conn._decider, "decide", broken)
    preq, params = prefill(P, prompt_of(PROMPT, seed=1))
    req, out = start_load(C, preq, params)
    assert out.kv_connector_metadata.fault_plans == {}
    monkeypatch.undo()
    # Planning raises: the load goes on, and the record says why.
    monkeypatch.setattr(fc, "request_blocks", broken)
    preq, params = prefill(P, prompt_of(PROMPT, seed=2))
    req, out = start_load(C, preq, params)
    assert out.kv_connector_metadata.fault_plans == {}
    [record] = read_records(log)
    assert record["skipped"] == "planning raised RuntimeError: boom" and record["request_id"] == req.request_id
    errors = drill_records(fault_logs, logging.ERROR)
    assert len(errors) == 2 and all(r.exc_info for r in errors)


@pytest.mark.parametrize("kind", ["flip_bit", "drop_checksums"])
def test_loads_the_checksums_skip_get_no_fault(kind, sides, tmp_path):
    # NIXL carries no checksums for a bidirectional load, so add_recv skips
    # it: a fault there would have no verdict to check.
    log = tmp_path / "injections.jsonl"
    C = sides("kv_consumer", faults_cfg={"kinds": [kind], "log_path": str(log)})
    P = make_side("kv_producer")
    preq, params = prefill(P, prompt_of(PROMPT))
    req, out = start_load(C, preq, {**params, "do_remote_decode": True})
    assert req.request_id not in C.scheduler.kv_checksum._recvs
    assert out.kv_connector_metadata.fault_plans == {}
    assert "kv_checksums" in req.kv_transfer_params
    [record] = read_records(log)
    assert record["kind"] == kind and "carries no KV checksums for this load" in record["skipped"]


def test_rate_zero_plans_nothing(sides):
    C = sides("kv_consumer", faults_cfg={"kinds": "all", "rate": 0})
    P = make_side("kv_producer")
    preq, params = prefill(P, prompt_of(PROMPT))
    req, out = start_load(C, preq, params)
    assert out.kv_connector_metadata.fault_plans == {}
    assert "kv_checksums" in req.kv_transfer_params


def test_drop_checksums_makes_the_load_unverified(sides, tmp_path, logs):
    log = tmp_path / "injections.jsonl"
    C = sides("kv_consumer", faults_cfg={"kinds": ["drop_checksums"], "rate": 1.0, "log_path": str(log)})
    P = make_side("kv_producer")
    preq, params = prefill(P, prompt_of(PROMPT))
    assert "kv_checksums" in params
    result = pd_harness.load(C, P, preq, params)
    assert "kv_checksums" not in result.request.kv_transfer_params
    assert result.request.kv_transfer_params["remote_block_ids"] == params["remote_block_ids"]
    assert stats(C) == {"unverified": 1}
    assert "the producer sent no KV checksums" in logs.text
    [record] = read_records(log)
    assert record["kind"] == "drop_checksums" and record["expect"] == "unverified"
    assert record["request_id"] == result.request.request_id and record["side"] == "scheduler"
    assert record["skipped"] is None and record["group"] is None
    assert "KV checksum drill: injected drop_checksums into request" in logs.text


def test_drop_checksums_replaces_the_params_with_a_copy(sides):
    C = sides("kv_consumer", faults_cfg={"kinds": ["drop_checksums"]})
    P = make_side("kv_producer")
    preq, params = prefill(P, prompt_of(PROMPT))
    req, out = start_load(C, preq, params)  # the request holds its own copy of params
    assert "kv_checksums" not in req.kv_transfer_params
    assert out.kv_connector_metadata.fault_plans == {}
    # Whoever else holds the dict the request came with (here: the test) keeps it whole.
    assert "kv_checksums" in params
    original = dict(params)
    req2 = make_request(preq.prompt_token_ids, params=original, block_size=C.block_size)
    C.scheduler.add_request(req2)
    C.scheduler.schedule()
    assert "kv_checksums" in original and "kv_checksums" not in req2.kv_transfer_params


def test_drop_checksums_without_checksums_is_recorded_skipped(sides, tmp_path):
    log = tmp_path / "injections.jsonl"
    C = sides("kv_consumer", faults_cfg={"kinds": ["drop_checksums"], "log_path": str(log)})
    P = make_side("kv_producer", enable=False)
    preq, params = prefill(P, prompt_of(PROMPT))
    pd_harness.load(C, P, preq, params)
    [record] = read_records(log)
    assert "carries no 'kv_checksums'" in record["skipped"] and record["expect"] == "unverified"


# -- 5. worker side --------------------------------------------------------------

BLOCK = 16
HEADS = 2
LAYERS = 3
NUM_BLOCKS = 24


@pytest.fixture
def worker(tmp_path):
    """A fault connector's worker half over real CPU caches, wrapping the stub."""

    def build(faults_cfg=None, num_layers=LAYERS, extra_groups=()):
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=8, dtype=torch.bfloat16)
        groups = [KVCacheGroupSpec([layer_name(i) for i in range(num_layers)], spec),
                  *(KVCacheGroupSpec(list(names), spec) for names in extra_groups)]
        kv_cache_config, caches = build_caches(groups, NUM_BLOCKS, seed=3)
        cfg = {"log_path": str(tmp_path / "injections.jsonl"), **(faults_cfg or {})}
        conn = create(fault_config(faults_cfg=cfg, connectors=[STUB]), KVConnectorRole.WORKER, kv_cache_config)
        conn.register_kv_caches(caches)
        return conn, caches

    return build


def block_sums(caches, block_ids, num_tokens, first_position):
    total = np.zeros(len(block_ids), dtype=np.uint64)
    for name, cache in caches.items():
        layer = int(name.split(".")[2])
        total = total + layer_block_checksums(cache, list(block_ids), num_tokens, first_block_position=first_position,
                                              layer=layer, block_size=BLOCK)
    return total


def raw(caches):
    return {n: t.view(torch.uint8).clone() for n, t in caches.items()}


def changed_block_ids(before, caches):
    out = set()
    for n, t in caches.items():
        diff = (before[n] != t.view(torch.uint8)).reshape(t.shape[0], -1).any(dim=1)
        out |= {int(b) for b in torch.nonzero(diff).flatten()}
    return out


def bind_plans(conn, plans):
    conn.bind_connector_metadata(fc.FaultConnectorMetadata(metadata=(None,), fault_plans=plans))


def finish(conn, finished=(), failed=(), ended=()):
    child = conn.sub_connectors[0]
    child.finished, child.failed = set(finished), set(failed)
    return conn.get_transfer_results(set(ended))


def plan_of(kind, first_position=0, block_ids=(3, 5, 7, 9, 11), num_tokens=4 * BLOCK + 3, seed=5):
    return fc.FaultPlan(kind, seed, num_tokens, {0: (first_position, tuple(block_ids))})


@pytest.mark.parametrize("first_position", [0, 2])
@pytest.mark.parametrize("kind", list(faults.FAULT_KINDS))
def test_worker_injects_at_the_planned_blocks(kind, first_position, worker, tmp_path, fault_logs):
    conn, caches = worker()
    plan = plan_of(kind, first_position, block_ids=(3, 5, 7, 9, 11)[first_position:])
    _, block_ids = plan.groups[0]
    sums, before = block_sums(caches, block_ids, plan.num_tokens, first_position), raw(caches)
    bind_plans(conn, {"r1": plan})
    # Metadata reaches the child as its own (here None), not the wrapper's.
    assert conn.sub_connectors[0].bound == [None]
    results = finish(conn, finished={"r1"})
    assert results.finished_recving == {"r1"} and results.failed_recving == set()
    after = block_sums(caches, block_ids, plan.num_tokens, first_position)
    [record] = read_records(tmp_path / "injections.jsonl")
    assert record["kind"] == kind and record["request_id"] == "r1" and record["group"] == 0
    assert record["skipped"] is None and record["side"] == "worker" and record["tp_rank"] == 0
    assert set(record) == set(fc.RECORD_FIELDS)
    changed_positions = {first_position + i for i in np.nonzero(after != sums)[0]}
    assert set(record["block_ids"]) <= set(block_ids)
    assert [block_ids[p - first_position] for p in record["positions"]] == record["block_ids"]
    if kind == "change_tail":
        assert record["expect"] == "verified" and changed_positions == set()
        assert changed_block_ids(before, caches) == {block_ids[-1]}  # bytes did change, past the prompt
    else:
        assert record["expect"] == "mismatch"
        assert changed_positions == set(record["positions"])
        assert changed_block_ids(before, caches) == set(record["block_ids"])
    assert conn._plans == {}
    [line] = warnings_of(fault_logs)
    assert line.startswith(f"KV checksum drill: injected {kind} into request r1: group 0 block positions "
                           f"{record['positions']}")


@pytest.mark.parametrize("kind", [k for k in faults.FAULT_KINDS if faults.takes_position(k)])
@pytest.mark.parametrize("position", [2, 4])
def test_a_configured_position_is_the_one_hit(kind, position, worker, tmp_path):
    conn, caches = worker({"position": position})
    plan = plan_of(kind, 1, block_ids=(5, 7, 9, 11))
    bind_plans(conn, {"r1": plan})
    finish(conn, finished={"r1"})
    [record] = read_records(tmp_path / "injections.jsonl")
    assert record["skipped"] is None and record["positions"][0] == position, record


def test_a_configured_position_leaves_kinds_without_one_alone(worker, tmp_path):
    conn, caches = worker({"position": 2})
    bind_plans(conn, {"r1": plan_of("change_tail", 1, block_ids=(5, 7, 9, 11))})
    finish(conn, finished={"r1"})
    [record] = read_records(tmp_path / "injections.jsonl")
    assert record["skipped"] is None, record


def test_a_configured_position_the_load_lacks_is_skipped(worker, tmp_path):
    conn, caches = worker({"position": 0})
    before = raw(caches)
    bind_plans(conn, {"r1": plan_of("flip_bit", 1, block_ids=(5, 7, 9, 11))})
    finish(conn, finished={"r1"})
    [record] = read_records(tmp_path / "injections.jsonl")
    assert record["skipped"] and record["positions"] == []
    assert changed_block_ids(before, caches) == set()


def test_log_line_names_the_spot():
    inj = faults.Injection("flip_bit", "model.layers.1.self_attn.attn", (3,), (9,), True, token=5, head=1,
                           byte=17, bit=2)
    record = fc.injection_record(request_id="R", kind="flip_bit", side="worker", group=0, injection=inj,
                                 tp_rank=0, pp_rank=0, now=1.5, pid=42)
    assert record == {"time": 1.5, "pid": 42, "side": "worker", "request_id": "R", "kind": "flip_bit", "group": 0,
                      "positions": [3], "block_ids": [9], "expect": "mismatch", "skipped": None, "tp_rank": 0,
                      "pp_rank": 0, "layer": "model.layers.1.self_attn.attn", "token": 5, "head": 1, "byte": 17,
                      "bit": 2, "other_layer": None, "other_token": None, "other_head": None,
                      "source_block_id": None}
    assert json.loads(json.dumps(record)) == record
    assert fc.describe_record(record) == (
        "KV checksum drill: injected flip_bit into request R: group 0 block positions [3] (layer "
        "model.layers.1.self_attn.attn, token 5, head 1, byte 17, bit 2); expect mismatch")
    tail = faults.Injection("change_tail", "l", (4,), (2,), False, token=3)
    assert fc.expect_of("change_tail", tail, None) == "verified"
    assert fc.expect_of("flip_bit", inj, "why") == "verified"  # skipped: no fault
    assert fc.expect_of("drop_checksums", None, None) == "unverified"
    skipped = fc.injection_record(request_id="R", kind="swap_blocks", side="worker", skipped="one block")
    assert fc.describe_record(skipped) == "KV checksum drill: skipped swap_blocks for request R: one block"
    assert skipped["positions"] == [] and skipped["layer"] is None


def test_failed_and_ended_loads_are_not_injected(worker, tmp_path):
    conn, caches = worker({"kinds": ["flip_bit"]})
    before = raw(caches)
    bind_plans(conn, {"failed": plan_of("flip_bit"), "ended": plan_of("flip_bit"), "later": plan_of("flip_bit")})
    results = finish(conn, failed={"failed"}, ended={"ended"})
    assert results.failed_recving == {"failed"} and results.finished_recving == {"failed"}
    assert set(conn._plans) == {"later"}
    # An ended request's load reported finished later is not touched either.
    finish(conn, finished={"ended"})
    assert changed_block_ids(before, caches) == set()
    assert not (tmp_path / "injections.jsonl").exists()
    finish(conn, ended={"later"})
    assert conn._plans == {}


@pytest.mark.parametrize("kind,plan_kw,why", [
    ("swap_blocks", dict(block_ids=(3,), num_tokens=10), "swap_blocks needs two loaded blocks"),
    ("change_tail", dict(num_tokens=5 * BLOCK), "the last block is full"),
    ("swap_layers", dict(), "swap_layers needs two layers"),
])
def test_a_kind_that_does_not_fit_is_skipped(kind, plan_kw, why, worker, tmp_path, fault_logs):
    conn, caches = worker(num_layers=1 if kind == "swap_layers" else LAYERS)
    before = raw(caches)
    bind_plans(conn, {"r1": plan_of(kind, **plan_kw)})
    finish(conn, finished={"r1"})
    assert changed_block_ids(before, caches) == set()
    [record] = read_records(tmp_path / "injections.jsonl")
    assert why in record["skipped"] and record["expect"] == "verified" and record["positions"] == []
    [line] = warnings_of(fault_logs)
    assert line.startswith(f"KV checksum drill: skipped {kind} for request r1: ") and why in line


def test_an_injection_that_raises_is_logged_not_raised(worker, monkeypatch, fault_logs, tmp_path):
    conn, caches = worker()

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(faults, "inject", broken)
    bind_plans(conn, {"r1": plan_of("flip_bit"), "r2": plan_of("swap_heads")})
    results = finish(conn, finished={"r1", "r2"})
    assert results.finished_recving == {"r1", "r2"}
    errors = drill_records(fault_logs, logging.ERROR)
    assert len(errors) == 2 and errors[0].exc_info is not None and "r1" in errors[0].getMessage()
    assert conn._plans == {}
    records = read_records(tmp_path / "injections.jsonl")
    assert [r["skipped"] for r in records] == ["injection raised RuntimeError: boom"] * 2


def test_groups_the_checksums_skip_get_no_fault(worker, tmp_path):
    # Group 1's layer name holds no layer number: the checksum worker skips
    # the group (group_plan), so a fault there would have no verdict.
    conn, caches = worker(extra_groups=[["model.decoder.attn"]])
    skipped_cache = caches["model.decoder.attn"]
    before = skipped_cache.view(torch.uint8).clone()
    for seed in range(6):
        plan = fc.FaultPlan("flip_bit", seed, 4 * BLOCK + 3, {0: (0, (3, 5, 7, 9, 11)), 1: (0, (3, 5, 7, 9, 11))})
        bind_plans(conn, {f"r{seed}": plan})
        finish(conn, finished={f"r{seed}"})
    only_skipped = fc.FaultPlan("flip_bit", 0, 4 * BLOCK + 3, {1: (0, (3, 5, 7, 9, 11))})
    bind_plans(conn, {"last": only_skipped})
    finish(conn, finished={"last"})
    assert torch.equal(before, skipped_cache.view(torch.uint8))
    records = read_records(tmp_path / "injections.jsonl")
    assert [r["group"] for r in records[:-1]] == [0] * 6
    assert "checksummed on this worker" in records[-1]["skipped"]


def test_an_unwritable_log_path_warns_once(worker, tmp_path, fault_logs):
    conn, caches = worker({"log_path": str(tmp_path)})  # a directory
    before = raw(caches)
    for seed, rid in enumerate(("r1", "r2")):
        bind_plans(conn, {rid: plan_of("flip_bit", seed=seed)})
        finish(conn, finished={rid})
    assert changed_block_ids(before, caches)  # injected all the same
    lines = warnings_of(fault_logs)
    assert sum("cannot append to log_path" in line for line in lines) == 1
    assert sum(line.startswith("KV checksum drill: injected flip_bit") for line in lines) == 2


def test_misplace_block_copies_another_loads_block(worker, tmp_path):
    conn, caches = worker()
    bind_plans(conn, {"a": plan_of("flip_bit", block_ids=(1, 2, 4, 6, 8))})
    finish(conn, finished={"a"})
    bind_plans(conn, {"b": plan_of("misplace_block", block_ids=(3, 5, 7, 9, 11))})
    finish(conn, finished={"b"})
    first, second = read_records(tmp_path / "injections.jsonl")
    assert second["kind"] == "misplace_block" and second["source_block_id"] in (1, 2, 4, 6, 8)
    # The ring is bounded.
    assert conn._recent.maxlen == fc.RECENT_LOADS


def test_only_tp_rank_zero_of_stage_zero_injects(worker, monkeypatch, tmp_path):
    for ranks in [(1, 0), (0, 1)]:
        monkeypatch.setattr(fc, "_parallel_ranks", lambda ranks=ranks: ranks)
        conn, caches = worker()
        before = raw(caches)
        bind_plans(conn, {"r1": plan_of("flip_bit")})
        assert conn._plans == {}
        finish(conn, finished={"r1"})
        assert changed_block_ids(before, caches) == set()
    assert not (tmp_path / "injections.jsonl").exists()


# -- 6. end to end: the checksums report what was injected -------------------------

def runner_step(C, conn, finished=(), received=None):
    """One consumer engine step with the worker half in vLLM's V1 model-runner
    connector path (KVConnectorModelRunnerMixin, no forward): bind the
    metadata, get_transfer_results, then checksum_step, in vLLM's order.
    `conn`'s stand-in child reports `finished` as loaded (with the
    checksums `received`, as a connector-owned carrier delivers them)."""
    conn.sub_connectors[0].finished = set(finished)
    conn.sub_connectors[0].received = dict(received or {})
    return pd_harness.runner_step(C, pd_harness.DEFAULT_RUNNER, connector=conn)


@pytest.fixture(params=["pull", "push"])
def drill(sides, tmp_path, request):
    """A consumer with the fault connector on both halves, a control file to
    switch the fault kind, and a producer; NIXL pull (checksums in
    kv_transfer_params) or push (delivered by the workers' connector)."""
    push = request.param == "push"
    control = tmp_path / "faults.json"
    log = tmp_path / "injections.jsonl"
    cfg = {"kinds": [], "rate": 1.0, "seed": 1, "log_path": str(log), "control_path": str(control)}
    C = sides("kv_consumer", faults_cfg=cfg, fail_closed=True, connectors=[NIXL_PUSH] if push else None)
    conn = create(fault_config(faults_cfg=cfg, connectors=[STUB]), KVConnectorRole.WORKER,
                  C.scheduler.kv_cache_config)
    conn.register_kv_caches(C.workers[0].caches)
    P = make_side("kv_producer", connector=NIXL_PUSH["kv_connector"] if push else "NixlConnector")
    prompts = iter(range(100))

    def run(kind, num_local=0):
        """Load one request with `kind` (None: no fault); its verdict,
        client stop_reason, and the drill's records for it."""
        control.write_text(json.dumps({"kinds": [kind] if kind else []}))
        prompt = prompt_of(PROMPT, seed=next(prompts))
        if num_local:
            run_local(C, prompt[:num_local])
        preq, params = prefill(P, prompt)
        carried = params.pop("kv_checksums") if push else None
        before = dict(stats(C))
        req = make_request(preq.prompt_token_ids, params=dict(params), block_size=C.block_size)
        C.scheduler.add_request(req)
        runner_step(C, conn)
        assert req.status.name == "WAITING_FOR_REMOTE_KVS"
        # The transfer; then the child reports the load finished.
        C.write_tokens(req.request_id, num_local, req.num_computed_tokens, source=P,
                       source_id=preq.request_id)
        _, outputs = runner_step(C, conn, finished={req.request_id},
                                 received={req.request_id: carried} if push else None)
        after = stats(C)
        [verdict] = [k for k in after if after[k] != before.get(k, 0)]
        out = outputs.get(req.request_id)
        records = [r for r in read_records(log) if r["request_id"] == req.request_id] if log.exists() else []
        return verdict, (out.stop_reason if out is not None else None), records

    return run


def test_drill_phases_get_the_expected_verdicts(drill):
    verdict, _, records = drill(None)
    assert (verdict, records) == ("verified", [])
    for kind in ["flip_bit", "overwrite_piece", "swap_tokens", "swap_heads", "swap_layers", "swap_blocks",
                 "misplace_block"]:
        verdict, stop_reason, [record] = drill(kind)
        assert record["expect"] == "mismatch" and verdict == "mismatch", kind
        # Reported exactly at the injected block positions.
        assert stop_reason == (f"kv_checksum_mismatch: the KV loaded from the producer is corrupt "
                               f"(group {record['group']} blocks {sorted(record['positions'])})"), kind
    verdict, stop_reason, [record] = drill("change_tail")
    assert record["skipped"] is None and record["expect"] == verdict == "verified"
    assert stop_reason is None
    verdict, stop_reason, [record] = drill("drop_checksums")
    assert record["expect"] == verdict == "unverified"
    assert stop_reason.startswith("kv_checksum_unverified")


def test_drill_after_a_local_prefix_hit(drill):
    verdict, stop_reason, [record] = drill("flip_bit", num_local=32)
    assert verdict == "mismatch" and record["positions"][0] >= 2
    assert stop_reason.endswith(f"(group 0 blocks {sorted(record['positions'])})")


def test_every_worker_drops_connector_delivered_checksums(worker, monkeypatch, tmp_path):
    """drop_checksums with a connector-owned carrier: any worker's copy
    reaches the scheduler, so every worker drops its own (one records it)."""
    for ranks in [(0, 0), (1, 0), (0, 1)]:
        monkeypatch.setattr(fc, "_parallel_ranks", lambda ranks=ranks: ranks)
        conn, _ = worker()
        bind_plans(conn, {"r1": plan_of("drop_checksums")})
        conn.sub_connectors[0].received = {"r1": b"CS", "r2": b"other"}
        results = finish(conn, finished={"r1", "r2"})
        assert results.kv_checksums == {"r2": b"other"}, ranks
    [record] = read_records(tmp_path / "injections.jsonl")
    assert (record["kind"], record["side"], record["skipped"], record["expect"]) == \
        ("drop_checksums", "worker", None, "unverified")


# -- target "sends": faults on a producer's held sends, never on loads ------------

def test_target_sends_puts_no_fault_on_a_load(sides, tmp_path):
    log = tmp_path / "injections.jsonl"
    C = sides("kv_consumer", faults_cfg={"kinds": ["flip_bit", "drop_checksums"], "rate": 1.0,
                                         "log_path": str(log), "target": "sends"})
    P = make_side("kv_producer")
    preq, params = prefill(P, prompt_of(PROMPT))
    req, out = start_load(C, preq, params)
    assert out.kv_connector_metadata.fault_plans == {} and out.kv_connector_metadata.send_fault_plans == {}
    assert "kv_checksums" in req.kv_transfer_params
    assert not log.exists()


def test_drop_checksums_does_not_apply_to_sends(sides, tmp_path):
    log = tmp_path / "injections.jsonl"
    P = sides("kv_producer", faults_cfg={"kinds": ["drop_checksums"], "rate": 1.0, "log_path": str(log),
                                         "target": "sends"})
    preq, params = prefill(P, prompt_of(PROMPT))
    assert "kv_checksums" in params
    out, _ = P.step()
    assert out.kv_connector_metadata.send_fault_plans == {}
    [record] = read_records(log)
    assert (record["request_id"], record["kind"]) == (preq.request_id, "drop_checksums")
    assert record["skipped"] == "drop_checksums does not apply to a producer's sends"


def test_target_loads_puts_no_fault_on_a_send(sides, tmp_path):
    # The ground truth (witness_path) follows the sends too; the faults must not.
    log = tmp_path / "injections.jsonl"
    P = sides("kv_producer", faults_cfg={"kinds": ["flip_bit"], "rate": 1.0, "log_path": str(log),
                                         "witness_path": str(tmp_path / "witness.jsonl")})
    prefill(P, prompt_of(PROMPT))
    out, _ = P.step()
    assert out.kv_connector_metadata.send_fault_plans == {}
    assert not log.exists()


def test_only_tp_rank_zero_of_stage_zero_injects_into_sends(worker, monkeypatch, tmp_path):
    for ranks, injects in [((1, 0), False), ((0, 1), False), ((0, 0), True)]:
        monkeypatch.setattr(fc, "_parallel_ranks", lambda ranks=ranks: ranks)
        conn, caches = worker()
        before = raw(caches)
        conn.bind_connector_metadata(fc.FaultConnectorMetadata(metadata=(None,),
                                                               send_fault_plans={"r1": plan_of("flip_bit")}))
        assert bool(changed_block_ids(before, caches)) is injects, ranks
    assert len(read_records(tmp_path / "injections.jsonl")) == 1
