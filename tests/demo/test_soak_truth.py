"""The soak's rules (scripts/kvcs_soak): ground truth against verdicts, counters, traffic, configs."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from kvcs_soak import soak, truth


def send(rid, digests, tp=1):
    return {"side": "send", "request_id": rid, "digests": {"0": digests}, "tp_size": tp}


def load(rid, remote, digests, tp=1, side="load"):
    return {"side": side, "request_id": rid, "remote_request_id": remote, "digests": {"0": digests}, "tp_size": tp}


SENT = {"0": "a", "1": "b", "2": "c"}


def test_a_load_is_a_victim_where_its_bytes_differ_and_clean_otherwise():
    sends = [send("p1", SENT), send("p2", SENT)]
    loads = [load("c1", "p1", {"1": "b", "2": "c"}),      # after a local hit: positions 1.. only
             load("c2", "p2", {"0": "a", "1": "X", "2": "c"}),
             load("c3", "p-gone", {"0": "a"}),            # its producer's digests are missing
             load("c4", "p1", {"0": "a"}, tp=2),          # another TP size: keys (global heads) still compare
             load("c5", "p1", {}, side="load_failed")]
    got = {t.request_id: (t.truth, t.positions) for t in truth.judge_loads(sends, loads, set())}
    assert got == {"c1": ("clean", {}), "c2": ("victim", {"0": [1]}), "c3": ("unknown", {}),
                   "c4": ("clean", {}), "c5": ("load_failed", {})}


def test_loads_that_do_not_name_the_producer_request_pair_by_client():
    """Push and Mooncake: the consumer's params come from the proxy, so the
    client's X-Request-Id (soak-N, on both legs) pairs a load with its send."""
    sends = [send("cmpl-soak-7-0-aa", SENT), send("cmpl-soak-8-0-bb", {"0": "z"})]
    loads = [load("cmpl-soak-7-0-cc", "soak-7", {"0": "a"}), load("cmpl-soak-8-0-dd", None, {"0": "a"}),
             load("cmpl-other", None, {"0": "a"})]
    got = [t.truth for t in truth.judge_loads(sends, loads, set())]
    assert got == ["clean", "victim", "unknown"]


def test_a_load_the_connector_failed_after_its_digests_is_a_failed_load():
    sends = [send("p", SENT)]
    loads = [load("c1", "p", {"0": "X"}), load("c1", "p", {}, side="load_failed"), load("c2", "p", {"0": "a"})]
    assert [(t.request_id, t.truth) for t in truth.judge_loads(sends, loads, set())] == [
        ("c1", "load_failed"), ("c2", "clean")]


def test_a_load_holding_a_block_its_producer_did_not_digest_is_unknown():
    sends = [send("p", {"0": "a", "1": "b"})]
    [t] = truth.judge_loads(sends, [load("c", "p", {"1": "b", "2": "c"})], set())
    assert t.truth == "unknown"


def test_only_clean_loads_reported_mismatched_are_false_alarms():
    sends = [send("p", SENT)]
    loads = [load("u", "p-gone", {"0": "a"}), load("f", "p", {}, side="load_failed"), load("c", "p", {"0": "a"})]
    det = truth.detection(truth.judge_loads(sends, loads, {"u", "f", "c"}))
    assert det["false_alarms"] == ["c"]


def test_a_producer_sent_twice_is_judged_by_its_last_send():
    sends = [send("p1", {"0": "old"}), send("p1", {"0": "new"})]
    [t] = truth.judge_loads(sends, [load("c1", "p1", {"0": "new"})], set())
    assert t.truth == "clean"


def test_detection_counts_missed_victims_and_false_alarms():
    sends = [send("p", SENT)]
    loads = [load("caught", "p", {"0": "X"}), load("missed", "p", {"0": "X"}),
             load("fine", "p", {"0": "a"}), load("cried", "p", {"0": "a"})]
    det = truth.detection(truth.judge_loads(sends, loads, {"caught", "cried"}))
    assert (det["victim"], det["clean"], det["victims_caught"]) == (2, 2, 1)
    assert det["victims_missed"] == ["missed"] and det["false_alarms"] == ["cried"]


def ended(rid, finished):
    """The drill's line for a witnessed load's request ending (fault_connector._load_ended)."""
    return {"side": "scheduler", "event": "request_ended", "request_id": rid, "load_finished": finished,
            "status": "FINISHED_ABORTED"}


def test_a_victim_is_excused_only_by_its_own_line_saying_it_ended_unjudged():
    sends = [send("p", SENT)]
    loads = [load("cmpl-soak-3-0-ab", "p", {"0": "X"}), ended("cmpl-soak-3-0-ab", False),
             # Verified (its load was reported finished, so judged), then its client hung up.
             load("cmpl-soak-4-0-cd", "p", {"0": "X"}), ended("cmpl-soak-4-0-cd", True),
             # Ended unjudged, but its client never hung up.
             load("cmpl-soak-5-0-ef", "p", {"0": "X"}), ended("cmpl-soak-5-0-ef", False),
             # No line at all.
             load("cmpl-soak-6-0-01", "p", {"0": "X"}),
             # Caught: never excused, never missed.
             load("cmpl-soak-7-0-23", "p", {"0": "X"}), ended("cmpl-soak-7-0-23", False)]
    truths = truth.judge_loads(sends, loads, {"cmpl-soak-7-0-23"})
    assert [t.ended_unjudged for t in truths] == [True, False, True, False, True]
    det = truth.detection(truths, hung_up={3, 4, 6, 7})
    assert det["victims_ended_unjudged"] == ["cmpl-soak-3-0-ab"]
    assert det["victims_missed"] == ["cmpl-soak-4-0-cd", "cmpl-soak-5-0-ef", "cmpl-soak-6-0-01"]
    assert det["victims_caught"] == 1
    # However many other loads ended unjudged, a verified victim is missed.
    others = [x for i in range(10) for x in (load(f"cmpl-soak-{20 + i}-0-aa", "p", {"0": "a"}),
                                             ended(f"cmpl-soak-{20 + i}-0-aa", False))]
    det = truth.detection(truth.judge_loads(sends, loads[2:4] + others, set()), hung_up={4, *range(20, 30)})
    assert det["victims_missed"] == ["cmpl-soak-4-0-cd"] and det["victims_ended_unjudged"] == []
    assert truth.client_index("cmpl-soak-12-prefill-0-ab") == 12 and truth.client_index("cmpl-x") is None


def test_behind_a_proxy_with_ids_of_its_own_only_the_loads_own_line_excuses_it():
    sends = [send("p", SENT)]
    loads = [load("uuid-1", "p", {"0": "X"}), ended("uuid-1", False),
             load("uuid-2", "p", {"0": "X"}), ended("uuid-2", True), load("uuid-3", "p", {"0": "X"})]
    det = truth.detection(truth.judge_loads(sends, loads, set()), hung_up=None)
    assert det["victims_ended_unjudged"] == ["uuid-1"] and det["victims_missed"] == ["uuid-2", "uuid-3"]


def test_mismatch_lines_name_the_consumer_request():
    text = ("ERROR 12-04 [scheduler.py:825] KV checksum mismatch for request 'cmpl-soak-3-0-ab12': group 0 "
            "differs at block positions 2 (1 of 5 compared); failing the load\n"
            "WARNING KV loads are unverified (no_producer_checksums), ... e.g. KV checksums of request 'x'\n")
    assert truth.mismatched_requests(text) == {"cmpl-soak-3-0-ab12"}


def test_counters_reconcile_only_when_every_load_and_send_is_counted():
    delta = {"loads_verified": 7, "loads_mismatched": 2, "loads_unverified/no_producer_checksums": 1,
             "loads_not_compared/request_ended": 3, "loads_not_compared/load_failed": 1, "mismatched_blocks": 5}
    assert truth.reconcile_consumer(delta, 14)["difference"] == 0
    assert truth.reconcile_consumer(delta, 15)["difference"] == 1
    assert truth.reconcile_producer({"sent": 9, "not_sent/sum_failed": 1}, 10)["difference"] == 0
    assert truth.reconcile_producer({"sent": 9}, 10)["difference"] == 1


def test_a_torn_witness_line_is_skipped(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps(send("p", SENT)) + "\n" + '{"side": "lo' + "\n" + json.dumps(send("q", SENT)))
    # A killed process's torn line, then lines of the processes that went on.
    assert truth.read_lines(path) == [send("p", SENT), send("q", SENT)]
    assert truth.read_lines(tmp_path / "missing.jsonl") == []


def test_traffic_is_reproducible_and_varied():
    a, b = soak.plan_traffic(400, seed=3), soak.plan_traffic(400, seed=3)
    assert a == b and a != soak.plan_traffic(400, seed=4)
    lengths = [len(p.prompt.split()) for p in a]
    assert min(lengths) == 1 and max(lengths) > 8 * soak.WORDS_PER_BLOCK
    assert all(n + p.max_tokens < soak.MAX_MODEL_LEN for n, p in zip(lengths, a))
    assert 0.1 < sum(p.disconnect_after_s is not None for p in a) / len(a) < 0.2
    aborts = [p for p in a if p.abort_in_transfer]
    assert 0.02 < len(aborts) / len(a) < 0.08 and all(p.disconnect_after_s <= 0.3 for p in aborts)
    # Families: many prompts share a first block with another.
    firsts = [" ".join(p.prompt.split()[:soak.WORDS_PER_BLOCK]) for p in a]
    assert len(set(firsts)) < len(firsts) * 0.6
    assert {p.max_tokens for p in a} >= {1, 96}


def test_both_servers_witness_and_only_the_consumer_stalls(tmp_path):
    args = SimpleNamespace(lease_s=2, seed=5, stall_rate=0.1, stall_s=3.0)
    for role in ("kv_producer", "kv_consumer"):
        cfg = soak.kv_config(role, tmp_path / "w.jsonl", args, soak.control_path(tmp_path))
        assert cfg["kv_connector"] == "KVChecksumFaultConnector" and cfg["kv_checksum_fail_closed"]
        extra = cfg["kv_connector_extra_config"]
        [child] = extra["connectors"]
        assert child["kv_connector_extra_config"] == {"kv_lease_duration": 2} and child["kv_role"] == role
        if role == "kv_consumer":
            assert extra["kv_checksum_faults"]["stall_s"] == 3.0
        drill = extra["kv_checksum_faults"]
        assert drill["rate"] == 0.0 and drill["witness_path"] == str(tmp_path / "w.jsonl")
        # Stalls only through the consumer's control file, set per phase.
        assert drill.get("stall_rate", 0) == 0 and ("control_path" in drill) == (role == "kv_consumer")
        from vllm_kvchecksum.drills.fault_connector import ControlFile, parse_fault_settings

        parse_fault_settings(extra)  # the drill connector accepts it
    control = ControlFile(str(soak.control_path(tmp_path)), (), 0.0)
    for rate in (0.25, 0.0):
        soak.set_stalls(tmp_path, rate)
        assert control.stall_rate() == rate and control.settings() == ((), 0.0)


@pytest.mark.parametrize("argv, requests", [([], 1000), (["--ci"], soak.CI_PRESET["requests"])])
def test_ci_preset(argv, requests):
    assert soak.parse_args(argv).requests == requests


def test_vllms_toy_proxy_drives_the_pull_layout_only(capsys):
    assert soak.parse_args(["--proxy", "vllm"]).proxy == "vllm"
    with pytest.raises(SystemExit):
        soak.parse_args(["--proxy", "vllm", "--mode", "push"])
    assert "pull layout only" in capsys.readouterr().err


def test_vllm_pd_tests_pass_only_with_tests_green_and_every_load_verified():
    from kvcs_soak import vllm_pd_tests as v

    assert v.judge(0, {"loads_verified": 3}) == []
    assert v.judge(1, {"loads_verified": 3}) == ["vLLM's P/D tests failed (pytest exit 1)"]
    assert v.judge(0, {}) == ["the consumer verified no load: the tests made no P/D transfer with checksums"]
    assert v.judge(0, {"loads_verified": 2, "loads_unverified/no_producer_checksums": 1}) == [
        "loads not verified: {'loads_unverified/no_producer_checksums': 1}"]
    assert v.judge(0, {"loads_verified": 2, "loads_mismatched": 1}) == ["loads not verified: {'loads_mismatched': 1}"]
    assert v.judge(0, {"loads_verified": 2, "loads_not_compared/load_failed": 1}) == [
        "loads not verified: {'loads_not_compared/load_failed': 1}"]
    assert v.kv_config()["enable_kv_checksum"] and v.kv_config()["kv_role"] == "kv_both"


def test_only_failures_while_the_producer_was_down_are_excused():
    planned = soak.plan_traffic(4, seed=1)
    answers = [soak.Answer(0, 200, None, False, 1.0, started_s=5.0),
               soak.Answer(1, 502, "prefill leg unreachable", False, 1.0, started_s=12.0),   # while down
               soak.Answer(2, 500, "Internal server error", False, 4.0, started_s=8.0),      # in flight at the kill
               soak.Answer(3, 500, "Internal server error", False, 1.0, started_s=30.0)]     # after it came back
    args = SimpleNamespace(min_clean=0, min_judged=0, proxy="project")
    counts = {"consumer": {"preemptions": 1}, "producer": {"finished": 0}}
    rss = {"wave1": {"producer": 1.0}, "wave2": {"producer": 1.0}}
    report = soak.build_report(args, answers, planned, counts, [], 0, {"producer": True}, rss, 1.0, death=(10.0, 20.0))
    assert report["answers"]["failed_by_the_producers_death"] == 2
    assert [a["index"] for a in report["unexpected"]] == [3]
    no_death = soak.build_report(args, answers, planned, counts, [], 0, {"producer": True}, rss, 1.0)
    assert [a["index"] for a in no_death["unexpected"]] == [1, 2, 3]
    # Mooncake: the consumer's receive from the dead producer times out only
    # after the lease + 60 s, and the requests queued behind it fail too.
    # The window ends 5 + 60 s after the producer was healthy again (at 20).
    def unexpected(mode, started_s):
        args = SimpleNamespace(min_clean=0, min_judged=0, proxy="project", mode=mode, lease_s=5.0)
        late = answers[:3] + [soak.Answer(3, 500, "Internal server error", False, 1.0, started_s=started_s)]
        report = soak.build_report(args, late, planned, counts, [], 0, {"producer": True}, rss, 1.0,
                                   death=(10.0, 20.0))
        return [a["index"] for a in report["unexpected"]]

    assert unexpected("mooncake", 84.0) == [] and unexpected("mooncake", 86.0) == [3]
    assert unexpected("push", 30.0) == [3] and unexpected("pull", 30.0) == [3]


def test_the_report_fails_without_preemption_and_with_an_unexplained_error_or_too_few_clean_loads():
    planned = soak.plan_traffic(2, seed=1)
    rss = {"wave1": {"consumer": 1.0}, "wave2": {"consumer": 1.0}}

    def report(consumer_preempted, producer_preempted, answers, min_clean=0, min_judged=0, truths=None):
        counts = {"consumer": {"preemptions": consumer_preempted}, "producer": {"preemptions": producer_preempted}}
        truths = truths or [truth.LoadTruth("cmpl-soak-0-x", "clean")]
        return soak.build_report(SimpleNamespace(min_clean=min_clean, min_judged=min_judged, proxy="project"),
                                 answers, planned, counts, truths, 0, {"consumer": True}, rss, 1.0)

    ok = [soak.Answer(0, 200, None, False, 1.0), soak.Answer(1, 200, None, False, 1.0)]
    assert report(0, 2, ok)["ok"] and report(3, 0, ok)["ok"]
    assert any("no preemption" in f for f in report(0, 0, ok)["failures"])
    failed = [ok[0], soak.Answer(1, 500, "Internal server error", False, 1.0)]
    assert any("another reason" in f for f in report(1, 0, failed)["failures"])
    mismatch = [ok[0], soak.Answer(1, 503, "kv_checksum_mismatch: ...", False, 1.0)]
    assert report(1, 0, mismatch)["ok"]
    assert any("clean loads" in f for f in report(1, 0, ok, min_clean=2)["failures"])
    # The floor on judged loads counts victims with the clean ones (a slow
    # machine's lease expiries turn clean loads into victims), nothing else.
    caught = truth.LoadTruth("cmpl-soak-1-x", "victim", {0: [1]}, "mismatch")
    both = [truth.LoadTruth("cmpl-soak-0-x", "clean"), caught]
    assert report(1, 0, ok, min_judged=2, truths=both)["ok"]
    assert report(1, 0, ok, min_clean=1, min_judged=2, truths=both)["ok"]
    # A load the connector failed was never judged: no floor counts it.
    failed = truth.LoadTruth("cmpl-soak-1-y", "load_failed")
    assert any("2 needed" in f for f in report(1, 0, ok, min_judged=2, truths=[both[0], failed])["failures"])
    assert report(1, 0, ok, min_judged=2, truths=[both[0], failed, caught])["ok"]
    unknown = [both[0], truth.LoadTruth("cmpl-soak-1-x", "unknown")]
    assert any("2 needed" in f for f in report(1, 0, ok, min_judged=2, truths=unknown)["failures"])
    assert any("clean loads" in f for f in report(1, 0, ok, min_clean=1, truths=[caught])["failures"])
    # A missed victim was still judged (the miss is its own failure), and an
    # unknown load is left out once, not twice.
    missed = truth.LoadTruth("cmpl-soak-1-x", "victim", {0: [1]}, "verified_or_other")
    failures = report(1, 0, ok, min_judged=2, truths=[both[0], missed])["failures"]
    assert any("not reported mismatched" in f for f in failures)
    assert not any("judged against" in f for f in failures)
    assert report(1, 0, ok, min_judged=2, truths=[both[0], both[0], unknown[1]])["ok"]


def test_state_held_after_the_traffic_is_a_leak():
    planned = soak.plan_traffic(1, seed=1)
    rss = {"wave1": {"consumer": 1.0}, "wave2": {"consumer": 1.0}}
    counts = {"consumer": {"preemptions": 1}, "producer": {}}
    ok = [soak.Answer(0, 200, None, False, 1.0)]

    def report(held):
        return soak.build_report(SimpleNamespace(min_clean=0, min_judged=0, proxy="project"), ok, planned, counts,
                                 [truth.LoadTruth("cmpl-soak-0-x", "clean")], 0, {"consumer": True}, rss, 1.0,
                                 held=held)

    zero = {g: 0.0 for g in soak.HELD_GAUGES}
    assert report({"consumer": zero, "producer": zero})["ok"]
    bad = report({"consumer": dict(zero, loads_in_flight=2.0), "producer": zero})
    assert not bad["ok"] and any("still held" in f and "loads_in_flight" in f for f in bad["failures"])
    missing = report({"consumer": dict(zero, held_blocks=None), "producer": zero})
    assert not missing["ok"] and any("held_blocks" in f for f in missing["failures"])


def test_the_gpu_flow_command_lines(tmp_path):
    """make soak VLLM_DEVICE=cuda MODEL=...: each server on a GPU of its own,
    vLLM's GPU flags, no CPU transfer buffer, the same small KV cache and
    drill connector; the CPU flow keeps its CPU settings."""
    from kvcs_demo.setups import Setup

    for device in ("cuda", "cpu"):
        args = soak.parse_args(["--device", device, "--model-path", str(tmp_path / "model"), "--out", str(tmp_path)])
        setup = Setup("soak", args.model_path, policy="fail", faults=False, mode=args.mode)
        specs = soak.server_specs(setup, args, tmp_path)
        for side, gpu in (("producer", "0"), ("consumer", "1")):
            argv, env = specs[side].argv, specs[side].env
            assert argv[argv.index("serve") + 1] == str(tmp_path / "model")
            assert argv[argv.index("--num-gpu-blocks-override") + 1] == "24"
            kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
            [child] = kv["kv_connector_extra_config"]["connectors"]
            if device == "cuda":
                assert env["CUDA_VISIBLE_DEVICES"] == gpu and "--gpu-memory-utilization" in argv
                assert "kv_buffer_device" not in child and "--kv-cache-memory-bytes" not in argv
            else:
                assert "CUDA_VISIBLE_DEVICES" not in env and child["kv_buffer_device"] == "cpu"
                assert "--enforce-eager" in argv
            assert kv["kv_connector"] == "KVChecksumFaultConnector" and kv["kv_checksum_fail_closed"]


def test_the_cost_baseline_is_the_same_stack_with_checksums_off(tmp_path):
    args = soak.parse_args(["--cost", "50", "--out", str(tmp_path)])
    on = soak.kv_config("kv_consumer", tmp_path / "w.jsonl", args, soak.control_path(tmp_path))
    off = soak.kv_config("kv_consumer", None, args, soak.control_path(tmp_path), checksums=False)
    assert on["enable_kv_checksum"] and "enable_kv_checksum" not in off and "kv_checksum_fail_closed" not in off
    assert "witness_path" not in off["kv_connector_extra_config"]["kv_checksum_faults"]
    assert off["kv_connector"] == on["kv_connector"]
    assert off["kv_connector_extra_config"]["connectors"] == on["kv_connector_extra_config"]["connectors"]
    answers = [soak.Answer(i, 200, None, False, latency) for i, latency in enumerate([0.1, 0.3, 0.2, 0.4])]
    answers.append(soak.Answer(9, 500, "x", False, 9.0))
    summary = soak.latency_summary(answers, 2.0)
    assert summary == {"ok": 4, "p50_ms": 300.0, "p99_ms": 400.0, "throughput_rps": 2.0}


def test_the_kv_cache_pool_grows_with_the_models_groups(tmp_path):
    """Gemma-2's sliding-window and full groups share one pool: 24 blocks
    would not hold one 512-token request of both (the server refuses to
    start), so the default is 24 per group. --blocks overrides it."""
    assert soak.parse_args(["--out", str(tmp_path)]).blocks == 24
    assert soak.parse_args(["--model", "gemma2", "--out", str(tmp_path)]).blocks == 48
    assert soak.parse_args(["--model", "gemma2", "--blocks", "30", "--out", str(tmp_path)]).blocks == 30
    # granite-h: a Mamba2 state group and an attention group.
    assert soak.parse_args(["--model", "granite-h", "--out", str(tmp_path)]).blocks == 48


def test_where_each_caught_victim_happened(tmp_path):
    from vllm_kvchecksum.engine import incident

    record = dict(request_id="cmpl-soak-1-x", verdict="mismatch", source="producer", groups={0: [2]},
                  remote_request_id="p-1", remote_engine_id="e", engine_id="c", connector="NixlConnector",
                  carrier="kv_transfer_params", tp_size=1, pp_size=1, block_sizes={0: 32}, producer_tp_size=1,
                  producer_block_sizes={0: 32}, now=0.0)
    consumer, producer = tmp_path / "consumer.log", tmp_path / "producer.log"
    consumer.write_text("\n".join(incident.INCIDENT_MARK + json.dumps(incident.incident_record(**dict(record, **c)))
                                  for c in ({}, {"request_id": "cmpl-soak-2-x", "remote_request_id": "p-2"})))
    late = incident.producer_record(request_id="p-1", transfer_id=None, result=incident.READ_AFTER_RELEASE, groups={},
                                    engine_id="e", connector="NixlConnector", carrier=None, tp_size=1, pp_size=1,
                                    block_sizes={0: 32}, reason="", now=0.0)
    producer.write_text("Releasing expired KV blocks for request p-1 which were retrieved by 0 remote worker(s) before "
                        f"lease expired.\n{incident.INCIDENT_MARK}{json.dumps(late)}\n"
                        "Releasing expired KV blocks for request p-5 which were retrieved by 0 remote worker(s) before "
                        "lease expired.\nPotentially invalid KV blocks for unrecognized request p-2 were retrieved by a "
                        "decode worker")
    consumer.write_text(consumer.read_text() + "\n" + incident.INCIDENT_MARK + json.dumps(incident.incident_record(
        **dict(record, request_id="cmpl-soak-5-x", remote_request_id="p-5"))))
    truths = [truth.LoadTruth("cmpl-soak-1-x", "victim", verdict="mismatch"),
              truth.LoadTruth("cmpl-soak-2-x", "victim", verdict="mismatch"),
              truth.LoadTruth("cmpl-soak-3-x", "victim", verdict="mismatch"),
              truth.LoadTruth("cmpl-soak-5-x", "victim", verdict="mismatch"),
              truth.LoadTruth("cmpl-soak-4-x", "clean")]
    where = soak.where_of_victims(truths, consumer, producer)
    assert where == {incident.RELEASED_BEFORE_READ: 1, incident.NOT_RECHECKED: 1, soak.NO_INCIDENT: 1,
                     incident.UNKNOWN_RELEASED: 1}

    def judged(where, mode, died=False):
        report = {"where": where, "failures": [], "ok": True}
        soak.judge_where(report, mode, died)
        return report

    assert judged({incident.RELEASED_BEFORE_READ: 3}, "pull")["ok"]
    assert not judged(where, "push")["ok"]  # a victim without an incident line, in any mode
    assert not judged({incident.RELEASED_BEFORE_READ: 1, incident.NOT_RECHECKED: 1}, "pull")["ok"]
    assert judged({incident.NOT_RECHECKED: 2}, "push")["ok"]
    # A pull victim whose read after the release went unlogged: only a killed
    # producer (that took its last lines with it) excuses that.
    released_unread = {incident.RELEASED_BEFORE_READ: 2, incident.UNKNOWN_RELEASED: 1}
    assert not judged(released_unread, "pull")["ok"]
    assert judged(released_unread, "pull", died=True)["ok"]
    assert not judged({incident.RELEASED_BEFORE_READ: 1, incident.NOT_RECHECKED: 1}, "pull", died=True)["ok"]


def test_the_producers_rechecks_are_counted_and_judged(tmp_path):
    import json

    from vllm_kvchecksum.engine import incident

    def line(verdict, rid):
        return incident.INCIDENT_MARK + json.dumps(incident.producer_record(
            request_id=rid, transfer_id=None, result=verdict, groups={0: [1]} if verdict == "changed" else {},
            engine_id="p", connector="NixlConnector", carrier="kv_transfer_params", tp_size=1, pp_size=1,
            block_sizes={0: 32}, reason="", now=0.0))

    log = tmp_path / "producer.log"
    log.write_text("\n".join([line("intact", "a"), line("intact", "b"), "other line", line("not_rechecked", "c"),
                              line(incident.READ_AFTER_RELEASE, "a")]))
    rechecks = soak.producer_rechecks(log)
    assert rechecks == {"intact": 2, "not_rechecked": 1}  # a read after the release is no re-check
    assert soak.producer_reads_after_release(log) == {"a"}

    def judged(rechecks, sent, died=False):
        report = {"failures": [], "ok": True}
        soak.judge_rechecks(report, rechecks, sent, died)
        return report

    assert judged(rechecks, 3)["ok"] and judged(rechecks, 3)["producer_rechecks"] == rechecks
    assert not judged(rechecks, 4)["ok"]  # a send never re-checked
    assert not judged(rechecks, 2)["ok"]  # a send re-checked twice
    assert judged(rechecks, 4, died=True)["ok"]  # ... unless the producer was killed
    assert "false alarms" in judged({"intact": 2, "changed": 1}, 3)["failures"][0]
    # Re-checks that judged nothing (none could compare) fail the run, also
    # with one per send and after the producer's death.
    for died in (False, True):
        nothing = judged({"not_rechecked": 3}, 3, died)
        assert not nothing["ok"] and "judged none of its 3 sends" in nothing["failures"][0]
    assert judged({"not_rechecked": 2, "intact": 1}, 3)["ok"]
    assert judged({}, 0)["ok"]  # nothing sent, nothing to re-check
    assert not judged({}, 2, died=True)["ok"]


def test_every_pull_victim_was_read_after_its_producer_released_it():
    truths = [truth.LoadTruth("c1", "victim", remote_request_id="p1"),
              truth.LoadTruth("c2", "victim", remote_request_id="p2"),
              truth.LoadTruth("c3", "clean", remote_request_id="p3")]

    def judged(late, counted, mode="pull", died=False):
        report = {"failures": [], "ok": True}
        soak.judge_reads_after_release(report, truths, late, counted, mode, died)
        return report

    ok = judged({"p1", "p2", "p3"}, 3)  # a clean load read after the release: its blocks were not reused yet
    assert ok["ok"] and ok["producer_read_after_release"] == {"reads": 3, "counted": 3, "victims": 2,
                                                              "victims_without": []}
    missing = judged({"p1"}, 1)
    assert not missing["ok"] and missing["producer_read_after_release"]["victims_without"] == ["c2"]
    assert missing["producer_read_after_release"]["victims"] == 1
    assert judged({"p1"}, 1, mode="push")["ok"]  # push and Mooncake make victims otherwise
    assert not judged({"p1", "p2"}, 3)["ok"]  # the counter and the lines disagree
    assert judged({"p1"}, 3, died=True)["ok"]  # the killed producer took its last lines with it


def test_a_victim_names_its_producers_request():
    got = truth.judge_loads([send("p1", SENT)], [load("c1", "p1", {"0": "X"})], set())
    assert [(t.truth, t.remote_request_id) for t in got] == [("victim", "p1")]


def ranked(side, rid, digests, rank, tp, remote=None):
    return {"side": side, "request_id": rid, "remote_request_id": remote, "digests": digests, "tp_rank": rank,
            "tp_size": tp}


def test_each_tp_rank_digests_its_own_heads_and_the_sides_may_differ_in_tp():
    # Producer TP 2: rank 0 holds KV head 0, rank 1 head 1; the consumer (TP 1) holds both.
    sends = [ranked("send", "p", {"0": {"0:h0": "a0", "1:h0": "b0"}}, 0, 2),
             ranked("send", "p", {"0": {"0:h1": "a1", "1:h1": "b1"}}, 1, 2)]
    whole = {"0:h0": "a0", "0:h1": "a1", "1:h0": "b0", "1:h1": "b1"}

    def judged(loaded, sends=sends):
        [t] = truth.judge_loads(sends, [ranked("load", "c", {"0": loaded}, 0, 1, "p")], set())
        return t.truth, t.positions

    assert judged(whole) == ("clean", {})
    assert judged({**whole, "1:h1": "X"}) == ("victim", {"0": [1]})  # a head only the producer's rank 1 held
    assert judged(whole, sends[:1]) == ("unknown", {})  # rank 1's digests missing: head 1 not judged


def test_a_consumers_ranks_are_merged_and_a_replicated_head_counts_on_every_rank():
    # Consumer TP 2 with one KV head: both ranks hold it.
    sends = [ranked("send", "p", {"0": {"0:h0": "a"}}, 0, 1)]
    loads = [ranked("load", "c", {"0": {"0:h0": "a"}}, 0, 2, "p"), ranked("load", "c", {"0": {"0:h0": "X"}}, 1, 2, "p")]
    for order in (loads, loads[::-1]):  # the bad copy first or last in the witness file
        [t] = truth.judge_loads(sends, order, set())
        assert (t.truth, t.positions) == ("victim", {"0": [0]})
    # One load per occurrence: a request loaded twice (each on both ranks) is two loads.
    twice = loads[:1] + [ranked("load", "c", {"0": {"0:h0": "a"}}, 1, 2, "p")]
    assert [x.truth for x in truth.judge_loads(sends, twice + twice, set())] == ["clean", "clean"]
    # A failed load's lines, one per rank, are one failed load.
    failed = [ranked("load_failed", "f", {}, r, 2, "p") for r in (0, 1)]
    assert [x.truth for x in truth.judge_loads(sends, failed, set())] == ["load_failed"]


def test_mamba_state_shards_compare_only_at_equal_tp_sizes():
    sends = [ranked("send", "p", {"0": {"0:tp2.0": "s0"}, "1": {"0:h0": "a"}}, 0, 2),
             ranked("send", "p", {"0": {"0:tp2.1": "s1"}, "1": {"0:h1": "b"}}, 1, 2)]
    tp1 = ranked("load", "c", {"0": {"0:tp1.0": "whole"}, "1": {"0:h0": "a", "0:h1": "b"}}, 0, 1, "p")
    [t] = truth.judge_loads(sends, [tp1], set())
    assert (t.truth, t.positions) == ("clean", {})  # the state is not judged, the attention KV is
    tp2 = [ranked("load", "c", {"0": {"0:tp2.0": "s0"}, "1": {"0:h0": "a"}}, 0, 2, "p"),
           ranked("load", "c", {"0": {"0:tp2.1": "X"}, "1": {"0:h1": "b"}}, 1, 2, "p")]
    [t] = truth.judge_loads(sends, tp2, set())
    assert (t.truth, t.positions) == ("victim", {"0": [0]})
    # At equal TP sizes a rank's state shard the producer did not digest leaves the load unknown.
    [t] = truth.judge_loads(sends[:1], [tp2[0], {**tp2[1], "digests": {"0": {"0:tp2.1": "s1"}}}], set())
    assert t.truth == "unknown"


def test_a_tp_2_producer(tmp_path):
    args = soak.parse_args(["--producer-tp", "2", "--out", str(tmp_path)])
    specs = soak.server_specs(soak.soak_setup(args, tmp_path / "model"), args, tmp_path)
    tp = {side: spec.argv[spec.argv.index("--tensor-parallel-size") + 1] for side, spec in specs.items()}
    assert tp == {"producer": "2", "consumer": "1"}
    assert soak.parse_args(["--out", str(tmp_path)]).producer_tp == 1
    # The cost baseline is the same stack, checksums off.
    off = soak.cost_setup(soak.soak_setup(args, tmp_path / "model"))
    assert (off.producer_tp, off.checksums, off.mode) == (2, True, "pull")


def test_rss_growing_in_the_second_wave_beyond_the_limit_is_a_leak():
    planned = soak.plan_traffic(1, seed=1)
    counts = {"consumer": {"preemptions": 1}, "producer": {}}
    ok = [soak.Answer(0, 200, None, False, 1.0)]

    def report(consumer_wave2, producer_wave2):
        rss = {"wave1": {"consumer": 2000.0, "producer": 2000.0},
               "wave2": {"consumer": consumer_wave2, "producer": producer_wave2}}
        return soak.build_report(SimpleNamespace(min_clean=0, min_judged=0, proxy="project"), ok, planned, counts,
                                 [truth.LoadTruth("cmpl-soak-0-x", "clean")], 0, {"consumer": True}, rss, 1.0)

    limit = 2000.0 * (1 + soak.RSS_GROWTH_LIMIT)
    assert report(2003.0, 1990.0)["ok"] and report(limit, limit)["ok"]
    assert report(1500.0, 2000.0)["ok"]  # memory given back is no leak
    grown = report(2003.0, limit + 1)
    assert not grown["ok"] and grown["failures"] == [
        f"RSS grew in the second wave, which repeats the first, by more than 10% (MiB): {{'producer': 201}}; "
        "a leak, ours or vLLM's"]


def test_the_producers_death_is_on_by_default_in_every_mode_and_off_in_ci():
    assert all(soak.parse_args(["--mode", mode]).kill_producer for mode in ("pull", "push", "mooncake"))
    assert not soak.parse_args(["--mode", "push", "--no-kill-producer"]).kill_producer
    assert not soak.parse_args(["--ci"]).kill_producer


def test_the_judged_floor_is_half_the_requests_unless_given():
    assert soak.parse_args(["--ci"]).min_judged == 150
    assert soak.parse_args(["--requests", "151"]).min_judged == 75
    assert soak.parse_args(["--ci", "--min-judged", "7"]).min_judged == 7
    assert soak.parse_args([]).min_clean == 1
    assert soak.parse_args(["--min-judged", "0"]).min_judged == 0
    assert soak.parse_args(["--ci", "--min-judged", "0"]).min_judged == 0
    with pytest.raises(SystemExit):
        soak.parse_args(["--min-judged", "7.5"])
