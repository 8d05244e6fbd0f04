"""The soak's ground truth: digests of the KV bytes a transfer moved (kv_witness).

The fault connector's worker half over real CPU caches digests a producer
request's sent blocks and a load's received blocks; the digests agree for a
faithful copy and differ exactly at the blocks a fault changed. Its
scheduler half plans the digests of every async load (the checksum
scheduler's blocks) and of every send, and stalls a step when asked.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
from test_fault_connector import (BLOCK, PROMPT, STUB, bind_plans, create, fault_config, finish, plan_of,
                                  read_records, sides, start_load, worker)  # noqa: F401 (fixtures)
from pd_harness import make_side, prefill, prompt_of, run_local, stats
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from vllm_kvchecksum.drills import fault_connector as fc
from vllm_kvchecksum.drills.kv_witness import differing_positions, head_digests, key_position, state_block_digests

SENT = (3, 5, 7, 9, 11)
COPY = (13, 15, 17, 19, 21)
NUM_TOKENS = 4 * BLOCK + 3


def copy_blocks(caches, src, dst):
    for t in caches.values():
        t[list(dst)] = t[list(src)]


def witness(conn, *, loads=None, sends=None, plans=None):
    conn.bind_connector_metadata(fc.FaultConnectorMetadata(metadata=(None,), fault_plans=plans or {},
                                                           witness_loads=loads or {}, witness_sends=sends or {}))


def records(tmp_path, side):
    return [r for r in read_records(tmp_path / "witness.jsonl") if r["side"] == side]


@pytest.mark.parametrize("fault", [None, "flip_bit", "swap_blocks", "change_tail"])
def test_a_loads_digests_differ_from_its_senders_exactly_where_its_bytes_do(fault, worker, tmp_path):
    conn, caches = worker({"witness_path": str(tmp_path / "witness.jsonl")})
    witness(conn, sends={"p": fc.WitnessPlan(NUM_TOKENS, {0: (0, SENT)})})
    finish(conn)
    [sent] = records(tmp_path, "send")
    # One digest per block position and global KV head.
    assert sent["request_id"] == "p" and sorted(sent["digests"]["0"]) == [f"{p}:h{h}" for p in range(5) for h in range(2)]
    # The transfer: a faithful copy of the sent blocks (positions 1.. after a
    # one-block local hit), then the fault, if any, on the load.
    copy_blocks(caches, SENT, COPY)
    load = fc.WitnessPlan(NUM_TOKENS, {0: (1, COPY[1:])}, remote_request_id="p")
    witness(conn, loads={"c": load}, plans={"c": plan_of(fault, first_position=1, block_ids=COPY[1:])} if fault else None)
    finish(conn, finished={"c"})
    [loaded] = records(tmp_path, "load")
    assert loaded["remote_request_id"] == "p" and {key_position(k) for k in loaded["digests"]["0"]} == {1, 2, 3, 4}
    differ = differing_positions(sent["digests"]["0"], loaded["digests"]["0"])
    injected = [r for r in read_records(tmp_path / "injections.jsonl")] if fault else []
    if fault in (None, "change_tail"):
        # change_tail writes only past the prompt's last token: not the request's KV.
        assert differ == []
    else:
        assert injected and differ == sorted(injected[0]["positions"])


def test_digests_cover_only_the_requests_token_slots(worker):
    _, caches = worker()
    heads = dict.fromkeys(caches, 0)
    before = head_digests(caches, heads, SENT, 0, NUM_TOKENS, BLOCK)
    name = next(iter(caches))
    caches[name][SENT[-1], :, BLOCK - 1].view(torch.uint8).bitwise_xor_(0xFF)  # past token NUM_TOKENS
    assert head_digests(caches, heads, SENT, 0, NUM_TOKENS, BLOCK) == before
    caches[name][SENT[-1], :, 2].view(torch.uint8).bitwise_xor_(0xFF)  # the last token's slot
    after = head_digests(caches, heads, SENT, 0, NUM_TOKENS, BLOCK)
    assert sorted(k for k in before if before[k] != after[k]) == ["4:h0", "4:h1"]


def test_failed_and_ended_loads_leave_no_load_digest(worker, tmp_path):
    conn, _ = worker({"witness_path": str(tmp_path / "witness.jsonl")})
    plan = fc.WitnessPlan(NUM_TOKENS, {0: (0, SENT)}, remote_request_id="p")
    witness(conn, loads={"failed": plan, "ended": plan, "late": plan})
    finish(conn, finished={"ended"}, failed={"failed"}, ended={"ended"})
    assert [(r["side"], r["request_id"]) for r in read_records(tmp_path / "witness.jsonl")] == [
        ("load_failed", "failed")]
    assert set(conn._witness_loads) == {"late"}


def test_every_tp_rank_of_stage_zero_digests_its_own_heads(worker, monkeypatch, tmp_path):
    # TP 2, this worker rank 1: its two local KV heads are the model's heads 2 and 3.
    monkeypatch.setattr(fc, "_parallel_ranks", lambda: (1, 0))
    monkeypatch.setattr(fc, "_tp_size", lambda: 2)
    monkeypatch.setattr("vllm_kvchecksum.engine.runner.uniform_model_kv_heads", lambda config: 4)
    conn, _ = worker({"witness_path": str(tmp_path / "witness.jsonl")})
    assert not conn.injects and conn.witnesses
    witness(conn, sends={"p": fc.WitnessPlan(NUM_TOKENS, {0: (0, SENT)})})
    finish(conn)
    [sent] = records(tmp_path, "send")
    assert sent["tp_rank"] == 1 and sorted(sent["digests"]["0"]) == [f"{p}:h{h}" for p in range(5) for h in (2, 3)]


def test_a_later_pipeline_stage_digests_nothing(worker, monkeypatch, tmp_path):
    monkeypatch.setattr(fc, "_parallel_ranks", lambda: (0, 1))
    conn, _ = worker({"witness_path": str(tmp_path / "witness.jsonl")})
    assert not conn.witnesses
    witness(conn, sends={"p": fc.WitnessPlan(NUM_TOKENS, {0: (0, SENT)})})
    finish(conn)
    assert not (tmp_path / "witness.jsonl").exists()


def test_a_heads_digest_is_that_heads_bytes_in_every_layer(worker):
    _, caches = worker()
    heads = dict.fromkeys(caches, 0)
    before = head_digests(caches, heads, SENT, 0, NUM_TOKENS, BLOCK)
    for name, position in ((sorted(caches)[-1], 2), (sorted(caches)[0], 3)):  # the last layer, then the first
        caches[name][SENT[position], 1, 5].view(torch.uint8).bitwise_xor_(0x01)  # head 1 of that block position
        after = head_digests(caches, heads, SENT, 0, NUM_TOKENS, BLOCK)
        assert [k for k in before if before[k] != after[k]] == [f"{position}:h1"]
        caches[name][SENT[position], 1, 5].view(torch.uint8).bitwise_xor_(0x01)
    # Positions from first_position on, past 9 too.
    assert sorted(head_digests(caches, heads, SENT, 9, 10 * BLOCK + 3, BLOCK))[:2] == ["10:h0", "10:h1"]
    # Numbered from each layer's first global head.
    assert sorted(head_digests(caches, dict.fromkeys(caches, 6), SENT, 0, NUM_TOKENS, BLOCK))[:2] == ["0:h6", "0:h7"]


def test_every_async_load_and_send_is_planned_by_the_checksum_schedulers_blocks(sides, tmp_path):
    path = tmp_path / "witness.jsonl"
    C = sides("kv_consumer", faults_cfg={"kinds": [], "rate": 0.0, "witness_path": str(path)})
    P = sides("kv_producer", faults_cfg={"kinds": [], "rate": 0.0, "witness_path": str(path)})
    prompt = prompt_of(PROMPT)
    run_local(C, prompt[:32])
    sched = P.scheduler.schedule
    sends = []

    def spy():
        out = sched()
        sends.append((out.kv_connector_metadata.witness_sends, out.kv_checksum_scheduled))
        return out

    P.scheduler.schedule = spy
    preq, params = prefill(P, prompt)
    [(plans, scheduled)] = [(w, s) for w, s in sends if w]
    # The blocks the checksum scheduler has the workers checksum in the same step.
    blocks = scheduled.reqs_to_send[preq.request_id]
    assert plans == {preq.request_id: fc.WitnessPlan(blocks.num_tokens, {g: (b.start, tuple(b.block_ids))
                                                                        for g, b in blocks.groups.items()})}
    req, out = start_load(C, preq, params)
    plan = out.kv_connector_metadata.witness_loads[req.request_id]
    recv = C.scheduler.kv_checksum._recvs[req.request_id].blocks
    assert plan == fc.WitnessPlan(recv.num_tokens, {g: (b.start, b.block_ids) for g, b in recv.groups.items()},
                                  remote_request_id=preq.request_id)
    assert plan.groups[0][0] == 2  # after the local hit
    [started] = [r for r in read_records(path) if r["side"] == "scheduler"]
    assert (started["event"], started["request_id"], started["remote_request_id"]) == (
        "load_started", req.request_id, preq.request_id)
    # Planned once.
    C.run_workers(out)
    assert C.scheduler.schedule().kv_connector_metadata.witness_loads == {}


def test_a_stall_holds_the_step_before_its_transfers_are_posted(worker, monkeypatch):
    slept = []
    monkeypatch.setattr(fc.time, "sleep", slept.append)
    conn, _ = worker()
    conn.bind_connector_metadata(fc.FaultConnectorMetadata(metadata=(None,), stall_s=2.5))
    conn.bind_connector_metadata(fc.FaultConnectorMetadata(metadata=(None,)))
    assert slept == [2.5] and conn.sub_connectors[0].bound[0] is None


@pytest.mark.parametrize("section, key", [({"stall_s": 61}, "stall_s"), ({"stall_s": -1}, "stall_s"),
                                          ({"stall_s": True}, "stall_s"),
                                          ({"stall_rate": 2}, "stall_rate"), ({"witness_path": ""}, "witness_path")])
def test_bad_witness_and_stall_settings_name_the_key(section, key):
    with pytest.raises(ValueError, match=f"kv_checksum_faults.{key}"):
        fc.parse_fault_settings({"kv_checksum_faults": section})


def test_stalls_are_drawn_per_load_started(sides, monkeypatch):
    C = sides("kv_consumer", faults_cfg={"kinds": [], "rate": 0.0, "stall_rate": 1.0, "stall_s": 1.5})
    P = make_side("kv_producer")
    preq, params = prefill(P, prompt_of(PROMPT))
    monkeypatch.setattr(fc.time, "sleep", lambda s: None)
    _, out = start_load(C, preq, params)
    assert out.kv_connector_metadata.stall_s == 1.5
    assert C.scheduler.schedule().kv_connector_metadata.stall_s == 0.0


def test_only_the_step_that_finishes_the_prompt_is_witnessed(sides, tmp_path):
    """A producer request that decodes on (max_tokens 3) is digested once,
    in its prompt's step, over the prompt's tokens."""
    from pd_harness import forward_of, make_request

    P = sides("kv_producer", faults_cfg={"kinds": [], "rate": 0.0, "witness_path": str(tmp_path / "w.jsonl")})
    req = make_request(prompt_of(PROMPT), remote_decode=True, block_size=P.block_size)
    req.max_tokens = req.sampling_params.max_tokens = 3
    P.scheduler.add_request(req)
    forward, plans = forward_of(P, req), []
    for _ in range(6):
        out, _ = P.step(forward=forward)
        plans.append(out.kv_connector_metadata.witness_sends)
        if req.is_finished():
            break
    assert req.is_finished() and len(plans) == 3
    assert [list(p) for p in plans] == [[req.request_id], [], []]
    assert plans[0][req.request_id].num_tokens == PROMPT
    P.scheduler.schedule()
    assert P.scheduler.connector._producer_reqs == {}  # forgotten once finished


def test_stalls_follow_the_control_file(sides, tmp_path):
    control = tmp_path / "control.json"
    C = sides("kv_consumer", faults_cfg={"kinds": [], "rate": 0.0, "stall_rate": 0.0, "stall_s": 1.5,
                                         "control_path": str(control)})
    P = make_side("kv_producer")
    stalls = []
    for rate in (0.0, 1.0, "bad"):
        control.write_text(json.dumps({"stall_rate": rate}))
        preq, params = prefill(P, prompt_of(PROMPT, seed=len(stalls)))
        _, out = start_load(C, preq, params)
        stalls.append(out.kv_connector_metadata.stall_s)
    # An invalid control file: no faults and no stalls.
    assert stalls == [0.0, 1.5, 0.0]


def test_each_load_draws_its_stall(sides, monkeypatch):
    """stall_rate is a share of the loads, drawn per load (seeded): some
    steps stall, some do not."""
    C = sides("kv_consumer", faults_cfg={"kinds": [], "rate": 0.0, "stall_rate": 0.5, "stall_s": 1.0, "seed": 2})
    P = make_side("kv_producer")
    monkeypatch.setattr(fc.time, "sleep", lambda s: None)
    stalls = set()
    for seed in range(12):
        preq, params = prefill(P, prompt_of(PROMPT, seed=seed))
        _, out = start_load(C, preq, params)
        C.run_workers(out)
        stalls.add(out.kv_connector_metadata.stall_s)
    assert stalls == {0.0, 1.0}


def test_a_load_whose_blocks_the_connector_names_failed_is_a_failed_load(worker, tmp_path):
    """Some connectors (Mooncake) report a failed load as finished and name
    its bad blocks in get_block_ids_with_load_errors, in the same step."""
    conn, _ = worker({"witness_path": str(tmp_path / "witness.jsonl")})
    witness(conn, loads={"bad": fc.WitnessPlan(NUM_TOKENS, {0: (0, SENT)}, remote_request_id="p"),
                         "good": fc.WitnessPlan(NUM_TOKENS, {0: (0, COPY)}, remote_request_id="q")})
    finish(conn, finished={"bad", "good"})
    conn.sub_connectors[0].get_block_ids_with_load_errors = lambda: {SENT[2]}
    assert conn.get_block_ids_with_load_errors() == {SENT[2]}
    sides_seen = [(r["side"], r["request_id"]) for r in read_records(tmp_path / "witness.jsonl")]
    assert sides_seen == [("load", "bad"), ("load", "good"), ("load_failed", "bad")]
    # Only this step's loads: a later step's errors name no earlier load.
    assert conn.get_block_ids_with_load_errors() == {SENT[2]}
    assert len(read_records(tmp_path / "witness.jsonl")) == 3


def test_a_load_whose_blocks_are_named_before_it_finishes_is_a_failed_load(worker, tmp_path):
    """Mooncake's receiver thread queues a failed load's bad blocks and its
    finished report apart: the blocks can come a step before the load is
    reported, and vLLM fails the request on the blocks alone."""
    conn, _ = worker({"witness_path": str(tmp_path / "witness.jsonl")})
    # The bad block is the first of the second group, whose load starts at
    # the request's third block (the first two were a local prefix hit).
    witness(conn, loads={"bad": fc.WitnessPlan(NUM_TOKENS, {0: (0, (23,)), 1: (2, SENT[:2])}, remote_request_id="p"),
                         "pending": fc.WitnessPlan(NUM_TOKENS, {0: (0, COPY)}, remote_request_id="q")})
    finish(conn)
    conn.sub_connectors[0].get_block_ids_with_load_errors = lambda: {SENT[0]}
    assert conn.get_block_ids_with_load_errors() == {SENT[0]}
    # Reported finished later: not digested as a load that arrived; the
    # other load in flight is, when it finishes.
    finish(conn, finished={"bad", "pending"})
    assert [(r["side"], r["request_id"]) for r in read_records(tmp_path / "witness.jsonl")] == [
        ("load_failed", "bad"), ("load", "pending")]


def test_a_load_planned_in_an_earlier_step_is_digested_when_it_finishes(worker, tmp_path):
    """Loads span steps: the plan bound with the step that started the load
    is kept through later steps' metadata until the load finishes."""
    conn, _ = worker({"witness_path": str(tmp_path / "witness.jsonl")})
    witness(conn, loads={"slow": fc.WitnessPlan(NUM_TOKENS, {0: (0, SENT)}, remote_request_id="p")})
    finish(conn)
    witness(conn, loads={"other": fc.WitnessPlan(NUM_TOKENS, {0: (0, COPY)}, remote_request_id="q")})
    finish(conn)
    witness(conn)
    finish(conn, finished={"slow"})
    assert [(r["side"], r["request_id"]) for r in read_records(tmp_path / "witness.jsonl")] == [("load", "slow")]


def test_two_loads_in_one_step_draw_a_stall_each_and_stall_once(sides, monkeypatch):
    """Each load that starts draws (seeded), also without witness_path; a
    step whose loads drew several stalls stalls once, for stall_s."""
    import random

    # Seed 0: the six steps draw 1, 1, 2, 0, 1, 1 stalls.
    C = sides("kv_consumer", faults_cfg={"kinds": [], "rate": 0.0, "stall_rate": 0.5, "stall_s": 1.0, "seed": 0})
    P = make_side("kv_producer")
    monkeypatch.setattr(fc.time, "sleep", lambda s: None)
    rng, got, expected, draws = random.Random(0 ^ 0x5EED), [], [], []
    from pd_harness import make_request

    for step in range(6):
        reqs = []
        for k in range(2):
            preq, params = prefill(P, prompt_of(PROMPT, seed=10 * step + k))
            req = make_request(preq.prompt_token_ids, params=dict(params), block_size=C.block_size)
            C.scheduler.add_request(req)
            reqs.append(req)
        out = C.scheduler.schedule()
        assert all(r.status.name == "WAITING_FOR_REMOTE_KVS" for r in reqs)
        C.run_workers(out)
        got.append(out.kv_connector_metadata.stall_s)
        draws.append([rng.random() < 0.5 for _ in reqs].count(True))
        expected.append(1.0 if draws[-1] else 0.0)
    assert 2 in draws and 0 in draws  # a step with two stalls drawn, one with none
    assert got == expected


def test_a_load_the_witness_cannot_plan_is_recorded_started_and_skipped(sides, tmp_path):
    """A synchronous load is no async load: its load_started line says why it
    is skipped (the soak counts only the others as started)."""
    from test_fault_connector import STUB as stub

    path = tmp_path / "w.jsonl"
    C = sides("kv_consumer", faults_cfg={"kinds": [], "rate": 0.0, "witness_path": str(path)},
              connectors=[{**stub, "kv_connector_extra_config": {"sync_load_tokens": 32}}])
    from pd_harness import make_request

    req = make_request(prompt_of(PROMPT), block_size=C.block_size)
    C.scheduler.add_request(req)
    out = C.scheduler.schedule()
    assert out.kv_connector_metadata.witness_loads == {}
    [line] = read_records(path)
    assert line["event"] == "load_started" and line["skipped"].startswith("not an asynchronous load")
    # Nor does its end say anything of a load the soak does not judge.
    from vllm.v1.request import RequestStatus

    C.scheduler.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    C.scheduler.schedule()
    assert [r["event"] for r in read_records(path)] == ["load_started"]


def test_control_file_changes_and_removal_restore_the_configs_stall_rate(tmp_path):
    control = fc.ControlFile(str(tmp_path / "c.json"), (), 0.0, stall_rate=0.25)
    assert control.stall_rate() == 0.25
    (tmp_path / "c.json").write_text(json.dumps({"stall_rate": 1.0}))
    assert control.stall_rate() == 1.0
    (tmp_path / "c.json").write_text(json.dumps({"rate": 0.0}))
    assert control.stall_rate() == 0.25
    (tmp_path / "c.json").write_text("{not json")
    assert control.stall_rate() == 0.0  # invalid: no stalls, whatever the config says
    (tmp_path / "c.json").unlink()
    assert control.stall_rate() == 0.25


def test_a_send_is_witnessed_over_its_whole_prompt_after_a_hit_and_after_a_resume(sides, tmp_path):
    """The producer's digests cover the prompt's blocks from position 0 even
    when its prompt step starts after a prefix-cache hit, and only the
    prompt's tokens when a resumed request recomputes its outputs with it."""
    from pd_harness import forward_of, make_request

    P = sides("kv_producer", faults_cfg={"kinds": [], "rate": 0.0, "witness_path": str(tmp_path / "w.jsonl")})
    prompt = prompt_of(PROMPT)

    def run(req, preempt_after=None):
        P.scheduler.add_request(req)
        forward, plans, scheduled = forward_of(P, req), [], []
        for step in range(8):
            out, _ = P.step(forward=forward)
            plans.append(out.kv_connector_metadata.witness_sends.get(req.request_id))
            scheduled.append((out.num_scheduled_tokens.get(req.request_id, 0), req.num_computed_tokens))
            if step == preempt_after:
                P.scheduler.running.remove(req)
                P.scheduler._preempt_request(req, 0.0)
            if req.is_finished():
                return [p for p in plans if p is not None], scheduled
        raise AssertionError("the request did not finish")

    [first], _ = run(make_request(prompt, remote_decode=True, block_size=P.block_size))
    assert first.num_tokens == PROMPT and first.groups[0][0] == 0
    [second], scheduled = run(make_request(prompt, remote_decode=True, block_size=P.block_size))
    assert scheduled[0][0] < PROMPT  # its prompt step started after a prefix-cache hit
    assert second.num_tokens == PROMPT and second.groups[0][0] == 0
    assert len(second.groups[0][1]) == len(first.groups[0][1])
    resumed = make_request(prompt_of(PROMPT, seed=9), remote_decode=True, block_size=P.block_size)
    resumed.max_tokens = resumed.sampling_params.max_tokens = 4
    plans, scheduled = run(resumed, preempt_after=1)
    assert resumed.num_preemptions == 1 and len(plans) == 2
    # The resumed prompt step computed past the prompt; the digests do not.
    assert scheduled[2][0] and scheduled[2][1] > PROMPT
    assert [p.num_tokens for p in plans] == [PROMPT, PROMPT] and plans[1].groups[0][0] == 0


# -- Mamba state ------------------------------------------------------------------


@pytest.fixture
def hybrid_worker(tmp_path):
    """A fault connector's worker half over real CPU caches of an attention
    group and a Mamba2 state group (hybrid_harness's layers), witnessing."""
    from hybrid_harness import ATTENTION_LAYERS, MAMBA_LAYERS, Mamba2Layer, mamba_layer_name
    from pd_harness import layer_name
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    attention = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    mamba = Mamba2Layer().spec(1, BLOCK, attention.page_size_bytes)
    groups = [KVCacheGroupSpec([layer_name(i) for i in ATTENTION_LAYERS], attention),
              KVCacheGroupSpec([mamba_layer_name(i) for i in MAMBA_LAYERS], mamba)]
    from kv_setup import build_caches

    kv_cache_config, caches = build_caches(groups, 24, seed=5)
    cfg = {"log_path": str(tmp_path / "injections.jsonl"), "witness_path": str(tmp_path / "witness.jsonl")}
    conn = create(fault_config(faults_cfg=cfg, connectors=[STUB]), KVConnectorRole.WORKER, kv_cache_config)
    conn.register_kv_caches(caches)
    covered = sum(b for b in (mamba.shapes[0][0] * mamba.shapes[0][1] * 2,
                              mamba.shapes[1][0] * mamba.shapes[1][1] * mamba.shapes[1][2] * 4))
    return conn, caches, [mamba_layer_name(i) for i in MAMBA_LAYERS], covered


def test_a_mamba_states_digest_covers_the_transferred_states_and_nothing_else(hybrid_worker, tmp_path):
    conn, caches, mamba_layers, covered = hybrid_worker
    assert conn._state_layers == {1: dict.fromkeys(mamba_layers, covered)}
    state, copy = 6, 9
    sent = fc.WitnessPlan(NUM_TOKENS, {0: (0, SENT), 1: (0, (state,))})
    witness(conn, sends={"p": sent})
    finish(conn)
    for name in mamba_layers:
        caches[name][copy] = caches[name][state]
    assert caches[mamba_layers[1]][copy].numel() == covered  # the page view holds the two states, no padding
    load = fc.WitnessPlan(NUM_TOKENS, {0: (0, SENT), 1: (0, (copy,))}, remote_request_id="p")
    witness(conn, loads={"c": load})
    finish(conn, finished={"c"})
    # A bit of the second layer's temporal state, last covered byte.
    caches[mamba_layers[1]][copy].view(torch.uint8).view(-1)[covered - 1] ^= 0x01
    witness(conn, loads={"d": load})
    finish(conn, finished={"d"})
    [s] = records(tmp_path, "send")
    clean, bad = records(tmp_path, "load")
    assert sorted(s["digests"]) == ["0", "1"] and list(s["digests"]["1"]) == ["0:tp1.0"]
    assert differing_positions(s["digests"]["1"], clean["digests"]["1"]) == []
    assert differing_positions(s["digests"]["1"], bad["digests"]["1"]) == [0]
    assert differing_positions(s["digests"]["0"], bad["digests"]["0"]) == []


def test_state_positions_start_at_the_plans_first_position(hybrid_worker):
    conn, caches, mamba_layers, covered = hybrid_worker
    pages = {name: (caches[name], covered) for name in mamba_layers}
    assert list(state_block_digests(pages, (6, 7), 11)) == [11, 12]


def test_a_state_group_the_checksums_skip_is_not_digested(hybrid_worker, monkeypatch, tmp_path):
    conn, caches, mamba_layers, covered = hybrid_worker
    monkeypatch.setattr(conn, "_state_layers", {})
    witness(conn, sends={"p": fc.WitnessPlan(NUM_TOKENS, {0: (0, SENT), 1: (0, (6,))})})
    finish(conn)
    [s] = records(tmp_path, "send")
    assert sorted(s["digests"]) == ["0"]


def test_only_keys_both_sides_digested_are_compared():
    sent = {"0:h0": "a", "1:h0": "b"}
    assert differing_positions(sent, {"0:h0": "a", "2:h0": "z"}) == []  # position 2: not the producer's
    assert differing_positions(sent, {"1:h0": ["b", "X"], "0:h0": "a"}) == [1]


def test_a_keys_position_is_all_its_digits():
    assert key_position("12:h3") == 12 and key_position(7) == 7
    assert differing_positions({"12:h0": "a", "0:tp2.1": "s"}, {"12:h0": "b", "0:tp2.1": "s"}) == [12]


def test_a_state_shard_is_named_by_tp_size_and_rank(hybrid_worker, monkeypatch, tmp_path):
    conn, caches, mamba_layers, covered = hybrid_worker
    monkeypatch.setattr(fc, "_parallel_ranks", lambda: (1, 0))
    monkeypatch.setattr(fc, "_tp_size", lambda: 2)
    conn.register_kv_caches(caches)
    assert conn.witnesses and set(conn._state_layers) == {1}
    witness(conn, sends={"p": fc.WitnessPlan(NUM_TOKENS, {1: (0, (6,))})})
    finish(conn)
    [s] = records(tmp_path, "send")
    assert list(s["digests"]["1"]) == ["0:tp2.1"]


def test_groups_the_checksums_skip_are_not_witnessed(monkeypatch):
    from types import SimpleNamespace

    cache = SimpleNamespace(name="model.layers.0.self_attn.attn", first_head=0)
    plans = {0: SimpleNamespace(skip_reason="a reason", caches=[cache], state=False),
             1: SimpleNamespace(skip_reason=None, caches=[cache], state=False)}
    monkeypatch.setattr(fc, "_worker_plans", lambda *args: plans)
    assert fc.witnessed_layers(None, None, {}, 0, 1) == ({1: {cache.name: 0}}, {})


def test_a_loads_request_ending_says_whether_its_load_was_judged_first(sides, tmp_path):
    """The soak excuses a victim only on its own evidence that its request
    ended before its load could be judged (kvcs_soak/truth.py): one
    "request_ended" line per witnessed load, load_finished false exactly
    when the checksum scheduler counted it not_compared{request_ended}, also
    for a request its failed check ends in the step that reports its load
    (before the connector hears of that step)."""
    from pd_harness import load
    from vllm.v1.request import RequestStatus

    path = tmp_path / "witness.jsonl"
    C = sides("kv_consumer", faults_cfg={"kinds": [], "rate": 0.0, "witness_path": str(path)}, fail_closed=True,
              policy="fail")
    P = sides("kv_producer", faults_cfg={"kinds": [], "rate": 0.0})
    counters = C.scheduler.kv_checksum._metrics

    def ended():
        return {r["request_id"]: (r["load_finished"], r["status"]) for r in read_records(path)
                if r.get("event") == "request_ended"}

    def ended_unjudged():
        return sum(v for k, v in counters.items() if "request_ended" in k)

    # Ended (its client hung up) while its load is in flight: never judged.
    # Written when the next step is scheduled: no step reported the load.
    preq, params = prefill(P, prompt_of(PROMPT))
    aborted, out = start_load(C, preq, params)
    C.run_workers(out)
    C.scheduler.finish_requests(aborted.request_id, RequestStatus.FINISHED_ABORTED)
    C.scheduler.schedule()
    assert ended() == {aborted.request_id: (False, "FINISHED_ABORTED")} and ended_unjudged() == 1
    # Ended after its load was judged (verified), whatever ends it.
    preq, params = prefill(P, prompt_of(PROMPT, seed=1))
    verified = load(C, P, preq, params).request
    assert stats(C).get("verified") == 1
    C.scheduler.finish_requests(verified.request_id, RequestStatus.FINISHED_ABORTED)
    assert ended()[verified.request_id] == (True, "FINISHED_ABORTED")
    # Ended by its own verdict (a mismatch under fail-closed), in the step
    # that reported the load: judged.
    preq, params = prefill(P, prompt_of(PROMPT, seed=2))
    failed = load(C, P, preq, params, tamper=lambda req: C.corrupt(req.request_id, position=2)).request
    assert stats(C).get("mismatch") == 1
    assert ended()[failed.request_id] == (True, "FINISHED_ERROR")
    assert ended_unjudged() == 1
    # Ended (its client hung up) after the workers finished its load, before
    # that step's update (the batch queue full: no step is scheduled between):
    # the checksum scheduler dropped it unjudged, though the update reports it.
    preq, params = prefill(P, prompt_of(PROMPT, seed=3))
    late, out = start_load(C, preq, params)
    C.run_workers(out)
    out = C.scheduler.schedule()
    merged = C.run_workers(out, finished_recving={late.request_id})
    C.scheduler.finish_requests(late.request_id, RequestStatus.FINISHED_ABORTED)
    C.update(out, merged)
    assert ended()[late.request_id] == (False, "FINISHED_ABORTED")
    # (The update took the step's counts: they are in what it reported.)
    assert sum(v for k, v in C.reported_metrics.items() if "request_ended" in k) == 2
    assert stats(C).get("verified") == 1
    # A request without a load writes no such line.
    run_local(C, prompt_of(PROMPT)[:32])
    assert len(ended()) == 4
