"""kvcs_demo.store (make demo --mode store) without servers.

The pure parts: prompts, which key holds which block position, the byte
edits each store fault makes on a value, parsing the loading server's log
lines, the counter deltas and the verdict of each phase, the TTFT checks,
the server configs, and --mode store's arguments. No vLLM server, master or
store client runs here (tests/e2e/test_store_demo.py runs them).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvcs_demo import demo, store
from kvcs_demo.demo import parse_args
from kvcs_demo.store import (BLOCK, BLOCKS, ENTRY_BYTES, FAULT_POSITIONS, HITS, STORE_FAULTS, TAIL, StorePhase,
                             StoreServer, build_report, diff, expand_positions, flatten_counts, flip_entry_bit,
                             flip_kv_bit, in_namespace, judge_phase, keys_in_order, parse_log, plan_fault,
                             print_table, prompt_tokens, store_kv_config, ttft_problems, ttft_summary, verdict_of)

VALUE_LEN = 4 * 2 * BLOCK * 2 * 32 * 2 + ENTRY_BYTES  # tiny Llama: layers x K,V x tokens x heads x dim x bf16


def key(prompt: str, pos: int) -> str:
    return f"model@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@kv_checksums@{prompt}{pos:02d}"


def value(seed: int) -> bytes:
    return bytes((seed * 31 + i * 7) % 251 for i in range(VALUE_LEN))


# ----------------------------------------------------------------- prompts, keys

def test_prompts_are_their_own_and_of_the_right_length():
    a, b = prompt_tokens("store.clean"), prompt_tokens("store.flip_bit")
    assert len(a) == BLOCKS * BLOCK + TAIL == 135
    assert a == prompt_tokens("store.clean")  # deterministic
    assert a[:BLOCK] != b[:BLOCK]  # distinct first blocks: no prefix shared
    assert all(4 <= t < 512 for t in a + b)
    assert len(prompt_tokens("x", blocks=2, tail=0)) == 64


def test_keys_in_order_maps_each_new_key_to_its_block_position():
    other = {key("o", 0), key("o", 1)}
    snapshots = [set(other)]
    for pos in range(4):
        snapshots.append(snapshots[-1] | {key("p", pos)})
    assert keys_in_order(snapshots) == [key("p", 0), key("p", 1), key("p", 2), key("p", 3)]
    # The order the keys sort in does not matter: only the step that added each.
    reversed_names = [set(other)]
    for pos, name in enumerate(["zz", "yy", "xx"]):
        reversed_names.append(reversed_names[-1] | {name})
    assert keys_in_order(reversed_names) == ["zz", "yy", "xx"]


@pytest.mark.parametrize("bad, message", [
    ([set(), {"a"}, {"a"}], "storing block 1 added 0 keys"),
    ([set(), {"a", "b"}], "storing block 0 added 2 keys"),
    ([{"x"}, {"a"}], "keys vanished while storing block 0"),
])
def test_keys_in_order_fails_loudly(bad, message):
    with pytest.raises(ValueError, match=message):
        keys_in_order(bad)


def test_namespaces_split_checksummed_and_plain_keys():
    keys = {key("p", 0), "model@tp_rank:0@group:0@abcd"}
    assert in_namespace(keys, True) == {key("p", 0)}
    assert in_namespace(keys, False) == {"model@tp_rank:0@group:0@abcd"}


# ----------------------------------------------------------------- fault byte edits

def test_flip_bit_changes_one_bit_of_the_kv_and_leaves_the_entry():
    v = value(1)
    out, detail = flip_kv_bit(v)
    assert len(out) == len(v)
    changed = [i for i in range(len(v)) if out[i] != v[i]]
    assert changed == [detail["byte"]] and detail["byte"] < len(v) - ENTRY_BYTES
    assert bin(out[detail["byte"]] ^ v[detail["byte"]]).count("1") == 1
    assert out[-ENTRY_BYTES:] == v[-ENTRY_BYTES:]


def test_change_entry_changes_one_bit_of_the_last_eight_bytes_only():
    v = value(2)
    out, detail = flip_entry_bit(v)
    changed = [i for i in range(len(v)) if out[i] != v[i]]
    assert changed == [detail["byte"]] and detail["byte"] >= len(v) - ENTRY_BYTES
    assert bin(out[detail["byte"]] ^ v[detail["byte"]]).count("1") == 1
    assert out[:-ENTRY_BYTES] == v[:-ENTRY_BYTES]


@pytest.mark.parametrize("edit", [flip_kv_bit, flip_entry_bit])
def test_a_value_without_kv_is_refused(edit):
    with pytest.raises(ValueError, match="no KV"):
        edit(b"\0" * ENTRY_BYTES)


def _prompt(name: str):
    keys = [key(name, p) for p in range(BLOCKS)]
    return keys, {k: value(10 * ord(name[0]) + p) for p, k in enumerate(keys)}


def test_every_plan_changes_exactly_the_values_at_its_positions():
    keys, values = _prompt("p")
    donor_keys, donor_values = _prompt("c")
    donor = {p: (k, donor_values[k]) for p, k in enumerate(donor_keys)}
    assert set(FAULT_POSITIONS) == set(STORE_FAULTS)
    for kind in STORE_FAULTS:
        plan = plan_fault(kind, keys, values, donor)
        assert plan.kind == kind and plan.positions == sorted(FAULT_POSITIONS[kind])
        assert set(plan.writes) == {keys[p] for p in plan.positions}, kind
        for k, new in plan.writes.items():
            assert new != values[k] and len(new) == len(values[k]), kind


def test_swap_values_exchanges_two_values_whole():
    keys, values = _prompt("p")
    plan = plan_fault("swap_values", keys, values, {})
    i, j = plan.positions
    assert plan.writes == {keys[i]: values[keys[j]], keys[j]: values[keys[i]]}


def test_other_prefix_stores_the_donor_value_of_the_same_position():
    keys, values = _prompt("p")
    donor_keys, donor_values = _prompt("c")
    donor = {p: (k, donor_values[k]) for p, k in enumerate(donor_keys)}
    plan = plan_fault("other_prefix", keys, values, donor)
    [p] = plan.positions
    assert plan.writes == {keys[p]: donor_values[donor_keys[p]]}
    assert plan.detail == {"donor_key": donor_keys[p]}


def test_plans_refuse_what_would_not_be_a_fault():
    keys, values = _prompt("p")
    with pytest.raises(ValueError, match="outside the prompt"):
        plan_fault("flip_bit", keys[:1], values, {})
    same = {k: value(0) for k in keys}  # two equal values: a swap changes nothing
    with pytest.raises(ValueError, match="would not change"):
        plan_fault("swap_values", keys, same, {})
    with pytest.raises(ValueError, match="unknown store fault"):
        plan_fault("bogus", keys, values, {}, positions=(0,))
    with pytest.raises(ValueError, match="donor value has 3 bytes"):
        plan_fault("other_prefix", keys, values, {2: ("d", b"abc")})


# ----------------------------------------------------------------- log parsing

B_LOG = """\
INFO 12-03 10:00:00 [scheduler.py:1] KV checksums of request 'cmpl-store.clean.b-0-9f' verified (offloaded KV loaded back): group 0 verified (4 blocks compared)
WARNING 12-03 10:00:05 [scheduler.py:2] KV checksum mismatch for request 'cmpl-store.swap_values.b-0-1a' (offloaded KV loaded back): group 0 differs at block positions 0, 2 (2 of 4 compared); failing the load (kv_checksum_fail_closed).
INFO 12-03 10:00:05 [scheduler.py:224] Removing 2 Mooncake store blocks of request cmpl-store.swap_values.b-0-1a that failed their KV checksums (block positions [0, 2]).
INFO 12-03 10:00:05 [worker.py:2199] Mooncake store: removed 2 keys of 2 blocks that failed their KV checksums.
WARNING 12-03 10:00:09 [scheduler.py:2] KV checksum mismatch for request 'cmpl-store.other.b-0-2b' (offloaded KV loaded back): group 0 differs at block positions 1-3 (3 of 4 compared); failing the load (kv_checksum_fail_closed).
"""


def test_parse_log_reads_positions_removal_and_keys():
    got = parse_log(B_LOG, "store.swap_values.b")
    assert got == {"reported": {0: [0, 2]}, "verified_logged": False, "removal_logged": [0, 2],
                   "keys_removed_logged": 2}
    clean = parse_log(B_LOG, "store.clean.b")
    assert clean["reported"] == {} and clean["verified_logged"] and clean["removal_logged"] is None
    assert parse_log(B_LOG, "store.other.b")["reported"] == {0: [1, 2, 3]}
    assert parse_log("", "x") == {"reported": {}, "verified_logged": False, "removal_logged": None,
                                  "keys_removed_logged": 0}


def test_a_pd_mismatch_line_is_not_taken_for_a_store_one():
    pd = "KV checksum mismatch for request 'cmpl-r-0': group 0 differs at block positions 1 (1 of 4 compared)"
    assert parse_log(pd, "cmpl-r")["reported"] == {}


def test_expand_positions():
    assert expand_positions("1") == [1]
    assert expand_positions("3, 0-1") == [0, 1, 3]


# ----------------------------------------------------------------- counters and verdicts

def test_flatten_counts_keeps_offloaded_counters_and_store_hits():
    samples = {("vllm:kv_checksum_offloaded_loads_verified_total", (("engine", "0"),)): 2.0,
               ("vllm:kv_checksum_offloaded_loads_unverified_total", (("reason", "not_stored"),)): 1.0,
               ("vllm:external_prefix_cache_hits_total", (("engine", "0"),)): 128.0,
               ("vllm:external_prefix_cache_queries_total", ()): 135.0,
               ("vllm:num_requests_running", ()): 1.0}
    assert flatten_counts(samples) == {"offloaded_loads_verified": 2, "offloaded_loads_unverified/not_stored": 1,
                                       HITS: 128}


@pytest.mark.parametrize("delta, want", [
    ({"offloaded_loads_verified": 1, HITS: 128}, "verified"),
    ({"offloaded_loads_mismatched": 1, "offloaded_loads_verified": 1}, "mismatch"),  # a recompute's reload
    ({"offloaded_loads_unverified/x": 1}, "unverified"),
    ({"offloaded_loads_not_checked/y": 1}, "not_checked"),
    ({HITS: 0}, "no_load"),
])
def test_verdict_of(delta, want):
    assert verdict_of(delta) == want


def test_diff_drops_unchanged_counters():
    assert diff({"a": 3, "b": 1}, {"a": 1, "b": 1}) == {"a": 2}


def good_clean() -> StorePhase:
    return StorePhase("clean", "store.clean.b", keys=[key("c", p) for p in range(4)],
                      metrics={"offloaded_loads_verified": 1, HITS: BLOCKS * BLOCK}, verdict="verified",
                      verified_logged=True, status=200, output_equal=True)


def good_fault(kind: str = "swap_values") -> StorePhase:
    want = sorted(FAULT_POSITIONS[kind])
    return StorePhase(kind, f"store.{kind}.b", keys=[key("f", p) for p in range(4)], expected="mismatch",
                      expected_positions=want,
                      metrics={"offloaded_loads_mismatched": 1, "offloaded_mismatched_blocks": len(want),
                               "offloaded_loads_verified": 1, HITS: 32},
                      verdict="mismatch", reported={0: want}, removal_logged=want, keys_removed_logged=len(want),
                      keys_removed=want, status=200, output_equal=True)


def test_judge_passes_what_went_right():
    assert judge_phase(good_clean()).ok
    for kind in STORE_FAULTS:
        ph = judge_phase(good_fault(kind))
        assert ph.ok and ph.problem == "", (kind, ph.problem)


@pytest.mark.parametrize("change, problem", [
    ({"output_equal": False}, "output differs from A's"),
    ({"output_equal": None, "status": 500}, "HTTP 500"),
    ({"verdict": "verified", "metrics": {"offloaded_loads_verified": 1}}, "expected one mismatched load"),
    ({"reported": {0: [0]}}, "reported positions {0: [0]}, injected {0: [0, 2]}"),
    ({"reported": {}}, "reported positions {}"),
    ({"removal_logged": None}, "removal logged for positions None"),
    ({"keys_removed": [0]}, "keys gone from the store at positions [0], expected [0, 2]"),
    ({"keys_removed": []}, "keys gone from the store at positions []"),
    ({"other_keys_removed": 1}, "1 keys of other prompts vanished"),
    ({"metrics": {"offloaded_loads_mismatched": 1, "offloaded_mismatched_blocks": 1}}, "1 mismatched blocks"),
    ({"keys_removed_logged": 0}, "B's worker logged 0 keys removed, expected 2"),
    ({"metrics": {"offloaded_loads_mismatched": 1, "offloaded_mismatched_blocks": 2,
                  "offloaded_loads_unverified/r": 1}}, "unverified or not checked"),
])
def test_judge_flags_each_wrong_fault_outcome(change, problem):
    ph = judge_phase(StorePhase(**{**good_fault().__dict__, **change}))
    assert not ph.ok and problem in ph.problem, ph.problem


@pytest.mark.parametrize("change, problem", [
    ({"verdict": "mismatch", "metrics": {"offloaded_loads_mismatched": 1, HITS: 128}}, "expected one verified"),
    ({"verdict": "no_load", "metrics": {}}, "expected one verified"),
    ({"metrics": {"offloaded_loads_verified": 1, HITS: 96}}, "store hits 96 tokens, expected 128"),
    ({"reported": {0: [1]}}, "mismatch reported"),
    ({"keys_removed": [1]}, "keys removed at positions [1]"),
    ({"output_equal": False}, "differs"),
])
def test_judge_flags_each_wrong_clean_outcome(change, problem):
    ph = judge_phase(StorePhase(**{**good_clean().__dict__, **change}))
    assert not ph.ok and problem in ph.problem, ph.problem


def test_ttft_summary_and_checks():
    t = ttft_summary({"on": [0.030, 0.050, 0.040], "off": [0.020, 0.040, 0.030]}, {"on": 4, "off": 4}, 3, 4, 0)
    assert t["on_p50_ms"] == pytest.approx(40) and t["off_p50_ms"] == pytest.approx(30)
    assert t["ratio"] == pytest.approx(4 / 3) and t["on_ms"] == [30.0, 50.0, 40.0]
    assert ttft_problems(t, 3) == []
    assert ttft_problems(None, 0) == []
    assert ttft_problems(None, 3) == ["ttft: not measured"]
    missed = dict(t, store_hits={"on": 4, "off": 3})
    assert ttft_problems(missed, 3) == ["ttft: 3 of 4 off requests hit the store for every block"]
    assert "1 mismatched" in ttft_problems(dict(t, mismatched_on=1), 3)[0]
    assert "2 of 3 on requests answered" in ttft_problems(dict(t, on_ms=[1.0, 2.0]), 3)[0]


# ----------------------------------------------------------------- report

def _args(kinds=STORE_FAULTS, ttft=0):
    return argparse.Namespace(kinds=list(kinds), ttft_requests=ttft)


def test_report_passes_only_when_every_phase_ran_and_passed(capsys):
    servers = {"A": StoreServer("A", "kv_both", True, port=1)}
    phases = [judge_phase(good_clean()), *(judge_phase(good_fault(k)) for k in STORE_FAULTS)]
    report = build_report(_args(), Path("/m"), phases, None, servers, {"A": 5}, [], 12.0)
    assert report["ok"] and report["failures"] == [] and report["mode"] == "store"
    assert report["phases"][1]["reported"] == {"0": [1]}  # flip_bit
    assert report["phases"][3]["reported"] == {"0": [0, 2]}  # swap_values
    print_table(report)
    out = capsys.readouterr().out
    assert "swap_values" in out and "every check passed" in out
    short = build_report(_args(), Path("/m"), phases[:2], None, servers, {}, [], 1.0)
    assert not short["ok"] and "not every one of clean" in short["failures"][0]
    bad = phases[:]
    bad[2] = judge_phase(StorePhase(**{**good_fault("flip_bit").__dict__, "keys_removed": []}))
    assert not build_report(_args(), Path("/m"), bad, None, servers, {}, [], 1.0)["ok"]
    broken = build_report(_args(), Path("/m"), [], None, servers, {}, ["ServerFailed: x"], 1.0)
    assert broken["failures"] == ["ServerFailed: x"] and not broken["ok"]
    no_ttft = build_report(_args(ttft=2), Path("/m"), phases, None, servers, {}, [], 1.0)
    assert no_ttft["failures"] == ["ttft: not measured"]


# ----------------------------------------------------------------- servers and arguments

def test_store_kv_configs():
    extra = {"kv_connector_extra_config": {"lookup_rpc_port": 7}}
    assert store_kv_config("kv_both", True, 7) == {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
                                                   **extra, "enable_kv_checksum": True}
    assert store_kv_config("kv_consumer", True, 7) == {
        "kv_connector": "MooncakeStoreConnector", "kv_role": "kv_consumer", **extra, "enable_kv_checksum": True,
        "kv_checksum_fail_closed": True, "kv_load_failure_policy": "recompute"}
    # The baseline pair differs by the checksums alone.
    assert store_kv_config("kv_consumer", False, 7) == {
        "kv_connector": "MooncakeStoreConnector", "kv_role": "kv_consumer", **extra,
        "kv_load_failure_policy": "recompute"}
    assert store_kv_config("kv_both", False, 7) == {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
                                                    **extra}


def test_server_spec_uses_the_demo_cpu_settings(tmp_path):
    s = StoreServer("B", "kv_consumer", True)
    spec = store.server_spec(s, Path("/models/tiny"), tmp_path, "/py", tmp_path / "mc.json")
    argv = spec.argv
    assert argv[:5] == ["/py", "-m", "vllm.entrypoints.cli.main", "serve", "/models/tiny"]
    assert argv[argv.index("--block-size") + 1] == "32"
    assert argv[argv.index("--kv-transfer-config") + 1] == \
        '{"kv_connector":"MooncakeStoreConnector","kv_role":"kv_consumer","kv_connector_extra_config":' \
        f'{{"lookup_rpc_port":{spec.port}}},"enable_kv_checksum":true,"kv_checksum_fail_closed":true,' \
        '"kv_load_failure_policy":"recompute"}'
    # Each server's scheduler reaches its own worker: lookup sockets of their own.
    other = store.server_spec(StoreServer("A", "kv_both", True), Path("/m"), tmp_path, "/py", tmp_path / "mc.json")
    assert json.loads(other.argv[other.argv.index("--kv-transfer-config") + 1])[
        "kv_connector_extra_config"]["lookup_rpc_port"] == other.port != spec.port
    assert spec.env["MOONCAKE_CONFIG_PATH"] == str(tmp_path / "mc.json")
    assert spec.env["VLLM_HOST_IP"] == "127.0.0.1" and spec.env["OMP_NUM_THREADS"] == "1"
    assert spec.log_path == tmp_path / "store.B.log" and s.url == f"http://127.0.0.1:{spec.port}"


def test_parse_args_store_mode(capsys):
    args = parse_args(["--mode", "store"])
    assert args.kinds == list(STORE_FAULTS) and args.ttft_requests == 5
    assert parse_args(["--mode", "store", "--kinds", "swap_values", "--ttft-requests", "0"]).kinds == ["swap_values"]
    # The P/D defaults are unchanged.
    assert parse_args([]).kinds == list(demo.FAULT_KINDS) and parse_args([]).ttft_requests == 20
    with pytest.raises(SystemExit):
        parse_args(["--mode", "store", "--kinds", "swap_blocks"])  # a P/D kind
    assert "unknown fault kinds ['swap_blocks']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--kinds", "swap_values"])  # a store kind in P/D mode
    capsys.readouterr()
    with pytest.raises(SystemExit):
        parse_args(["--mode", "store", "--device", "cuda", "--model", "X"])
    assert "CPU backend only" in capsys.readouterr().err


def test_main_dispatches_store_mode(monkeypatch):
    seen = []
    monkeypatch.setattr(store, "run", lambda args: seen.append(args.mode) or 7)
    assert demo.main(["--mode", "store", "--ttft-requests", "0"]) == 7 and seen == ["store"]


def test_startup_lines_keep_the_checksum_lines_only(tmp_path):
    path = tmp_path / "b.log"
    path.write_text(
        "(EngineCore pid=1) INFO 12-03 [kv_checksums.py:107] KV checksums: every block stored in the Mooncake store "
        "carries its checksum (key namespace '@kv_checksums'), and every load from the store is checked.\n"
        "(Worker pid=2) INFO 12-03 [worker.py:74] KV checksums enabled on PP stage 0: groups [0] checksummed\n"
        "(EngineCore pid=1) WARNING 12-03 [scheduler.py:223] Removing 1 Mooncake store blocks of request r that "
        "failed their KV checksums (block positions [1]).\n"
        "(Worker pid=2) INFO 12-03 [worker.py:2198] Mooncake store: removed 1 keys of 1 blocks that failed their "
        "KV checksums.\n")
    lines = store.startup_lines(path)
    assert len(lines) == 2 and lines[0].startswith("KV checksums: every block") and "PP stage 0" in lines[1]
    assert store.startup_lines(tmp_path / "missing.log") == [] and store.startup_lines(None) == []
