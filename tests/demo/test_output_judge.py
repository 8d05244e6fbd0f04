"""The judge of outputs that differ from the one-at-a-time reference (scripts/kvcs_soak/outputs.py),
fed by hand, and the soak's use of it: its pairing of answers with loads, and its failure rule."""

from __future__ import annotations

import threading
import time

import pytest

from kvcs_soak import outputs, soak, truth
from kvcs_soak.outputs import OutputEvidence, classify

REF = " w10 w11 w12"
OTHER = " w10 w99 w12"


def ev(output=OTHER, kv="clean", alone=(REF, REF), batched=(REF, OTHER, REF), tail_rerun=None, reference=REF):
    return OutputEvidence("r", output, reference, kv, list(alone), list(batched), tail_rerun)


def test_an_output_equal_to_the_reference_is_equal_whatever_else_is_known():
    assert classify(ev(output=REF, kv=None, alone=(), batched=()))[0] == outputs.EQUAL
    assert classify(ev(output=REF, kv="victim"))[0] == outputs.EQUAL


def test_different_bytes_decide_it_is_the_kv_before_any_batch_effect():
    """A load whose bytes differ from what was sent is the KV, even where the
    producer also shows a batch effect for the prompt."""
    assert classify(ev(kv="victim"))[0] == outputs.KV_DIFFERS


def test_without_a_comparison_of_the_bytes_nothing_is_concluded():
    for kv in (None, "unknown", "clean+unknown", "load_failed"):
        assert classify(ev(kv=kv))[0] == outputs.KV_UNKNOWN, kv
    assert classify(ev(reference=None))[0] == outputs.KV_UNKNOWN


def test_same_bytes_and_the_producer_changes_its_output_with_the_batch_is_numerics():
    verdict, why = classify(ev())
    assert verdict == outputs.NUMERICS
    assert "2 of 2" in why and "1 of 3" in why


def test_same_bytes_and_no_batch_effect_shown_is_unexplained():
    assert classify(ev(batched=(REF, REF, REF)))[0] == outputs.UNEXPLAINED
    assert classify(ev(batched=()))[0] == outputs.UNEXPLAINED
    # A batched run that failed (None) shows no effect.
    assert classify(ev(batched=(None, REF)))[0] == outputs.UNEXPLAINED


def test_no_batch_effect_but_the_p_d_path_alone_gives_the_output_again_is_the_path():
    e = ev(batched=(REF, REF))
    e.pd_alone = OTHER
    assert classify(e)[0] == outputs.PD_PATH
    e.pd_alone = REF  # alone, the P/D path gives the reference: the difference needed the concurrency
    assert classify(e)[0] == outputs.UNEXPLAINED
    e = ev()
    e.pd_alone = REF
    assert classify(e)[0] == outputs.NUMERICS  # a batch effect shown decides it first


def tie(gap=0.0, rank=2):
    return {"position": 1, "token": "w11", "output_token": "w99", "rank": rank, "gap": gap}


def test_no_batch_effect_but_a_tie_where_they_part_and_the_p_d_path_alone_right_is_numerics_at_a_tie():
    e = ev(batched=(REF, REF))
    e.pd_alone, e.margin = REF, tie(0.0)
    assert classify(e)[0] == outputs.NEAR_TIE
    e.margin = tie(outputs.NEAR_TIE_NATS)
    assert classify(e)[0] == outputs.NEAR_TIE
    for margin in (tie(2 * outputs.NEAR_TIE_NATS), tie(0.0, rank=3), tie(None, rank=None), None):
        e.margin = margin
        assert classify(e)[0] == outputs.UNEXPLAINED, margin
    e.margin, e.pd_alone = tie(0.0), None  # the P/D path alone not asked: not enough
    assert classify(e)[0] == outputs.UNEXPLAINED
    e.kv = "victim"  # different bytes decide it, tie or not
    assert classify(e)[0] == outputs.KV_DIFFERS


def test_divergence_finds_where_the_answer_parts_and_how_close_the_choices_were():
    tokens = ["w10", "w11", "w12"]
    top = [{"w10": -1.0, "w5": -2.0}, {"w11": -1.5, "w99": -1.5, "w7": -3.0}, {"w12": -1.0}]
    assert outputs.divergence(REF, tokens, top) is None
    assert outputs.divergence(OTHER, tokens, top) == {"position": 1, "token": "w11", "output_token": "w99",
                                                      "rank": 2, "gap": 0.0}
    # The answer's token is not among the top choices: no rank, no gap.
    assert outputs.divergence(" w10 w42 w12", tokens, top) == {"position": 1, "token": "w11", "output_token": None,
                                                               "rank": None, "gap": None}
    # Tokens that carry their own space (byte-level BPE), and the third choice.
    assert outputs.divergence(" a c", [" a", " b"], [{" a": -1.0}, {" b": -1.0, " x": -1.2, " c": -2.0}]) == {
        "position": 1, "token": "b", "output_token": "c", "rank": 3, "gap": 1.0}
    # A whitespace token (a newline) is skipped, not taken for where they part.
    assert outputs.divergence(" a\n b c", [" a", "\n", " b", " d"],
                              [{" a": -1.0}, {"\n": -1.0}, {" b": -1.0}, {" d": -1.0, " c": -1.0}])["position"] == 3
    body = {"choices": [{"logprobs": {"tokens": tokens, "top_logprobs": top}}]}
    assert outputs.margin_of(body, OTHER)["rank"] == 2
    assert outputs.margin_of({"choices": [{"logprobs": None}]}, OTHER) is None


def test_a_producer_that_is_not_deterministic_alone_is_not_a_batch_effect():
    assert classify(ev(alone=(REF, OTHER)))[0] == outputs.UNEXPLAINED
    assert classify(ev(alone=()))[0] == outputs.UNEXPLAINED


def test_a_change_meant_past_the_prompt_that_reaches_the_output_is_the_kv_not_numerics():
    """change_tail: the digested rows agree, but if the same P/D path without
    the change gives the reference, the change reached KV the consumer used."""
    assert classify(ev(tail_rerun=REF))[0] == outputs.UNCOVERED
    assert classify(ev(tail_rerun=REF, batched=(REF,)))[0] == outputs.UNCOVERED
    assert classify(ev(tail_rerun=" w1 w2 w3"))[0] == outputs.UNEXPLAINED
    assert classify(ev(tail_rerun=OTHER))[0] == outputs.NUMERICS


def test_judge_counts_by_class_and_keeps_the_differing_texts():
    got = outputs.judge([ev(output=REF), ev(), ev(kv="victim"), ev(batched=(REF,))])
    assert {k: got[k] for k in outputs.CLASSES} == {
        outputs.EQUAL: 1, outputs.NUMERICS: 1, outputs.KV_DIFFERS: 1, outputs.KV_UNKNOWN: 0, outputs.UNCOVERED: 0,
        outputs.PD_PATH: 0, outputs.NEAR_TIE: 0, outputs.UNEXPLAINED: 1}
    assert [d["verdict"] for d in got["differing"]] == [outputs.NUMERICS, outputs.KV_DIFFERS, outputs.UNEXPLAINED]
    assert all(d["output"] == OTHER and d["reference"] == REF for d in got["differing"])
    line = outputs.summary_line(got)
    assert line.startswith("4 compared: 1 equal") and "1 kv_same_output_differs: numerics" in line


class FakeServer:
    """A completion function standing in for the producer: it answers "p"
    with REF, except in batched round `changes_in` (1-based) where it answers
    OTHER; it notes which companions were in flight with each run of "p"."""

    def __init__(self, changes_in=None):
        self.lock, self.changes_in = threading.Lock(), changes_in
        self.runs_of_p, self.companions, self.in_flight, self.overlaps = 0, [], set(), []

    def __call__(self, prompt, n):
        if prompt != "p":
            with self.lock:
                self.companions.append((prompt, n))
                self.in_flight.add(prompt)
            time.sleep(0.5)  # long enough for the prompt's run to see it in flight
            with self.lock:
                self.in_flight.discard(prompt)
            return "x"
        with self.lock:
            self.runs_of_p += 1
            run = self.runs_of_p
        seen = set()
        if run > 1:  # a batched round: wait (bounded) for its companions to be in flight with it
            deadline = time.monotonic() + 10
            while not seen and time.monotonic() < deadline:
                with self.lock:
                    seen = set(self.in_flight)
                time.sleep(0.01)
        self.overlaps.append(seen)
        return OTHER if run - 1 == self.changes_in else REF


COMPANIONS = [(f"c{i}", 10) for i in range(7)]


@pytest.fixture(autouse=True)
def short_stagger(monkeypatch):
    monkeypatch.setattr(outputs, "STAGGER_S", 0.2)


def test_probe_runs_the_prompt_alone_then_with_companions_at_once_until_it_changes():
    server = FakeServer(changes_in=3)
    alone, batched = outputs.probe(server, "p", 5, REF, COMPANIONS, rounds=8, seed=3)
    assert alone == [REF, REF] and server.overlaps[0] == set()  # the second run alone: nothing else sent
    assert batched == [REF, REF, OTHER]  # stopped at the first other output
    assert all(server.overlaps[1:])  # every batched run had companions in flight with it
    assert {p for p, _ in server.companions} <= {p for p, _ in COMPANIONS}
    assert all(n <= 10 for _, n in server.companions)  # never past what a companion may decode


def test_probe_runs_every_round_when_the_output_never_changes_and_varies_the_batch():
    server = FakeServer()
    alone, batched = outputs.probe(server, "p", 5, REF, COMPANIONS, rounds=6, seed=1)
    assert batched == [REF] * 6 and server.runs_of_p == 7
    again = FakeServer()
    outputs.probe(again, "p", 5, REF, COMPANIONS, rounds=6, seed=1)
    assert sorted(again.companions) == sorted(server.companions)  # reproducible by seed


def test_the_soak_pairs_each_answer_with_its_loads_ground_truth():
    t = [truth.LoadTruth("cmpl-soak-1-0-a", "clean"), truth.LoadTruth("cmpl-soak-2-0-a", "clean"),
         truth.LoadTruth("cmpl-soak-2-0-b", "victim"), truth.LoadTruth("cmpl-soak-3-0-a", "unknown"),
         truth.LoadTruth("cmpl-soak-4-0-a", "clean"), truth.LoadTruth("cmpl-soak-4-0-b", "unknown"),
         truth.LoadTruth("cmpl-other", "clean")]
    assert soak.kv_truth_by_client(t) == {1: "clean", 2: "victim", 3: "unknown", 4: "clean+unknown"}


def test_the_soak_fails_only_on_an_unexplained_difference():
    for judged, fails in ((outputs.judge([ev(), ev(kv="victim"), ev(kv=None)]), False),
                          (outputs.judge([ev(batched=(REF,))]), True), (None, False)):
        report = {"outputs": judged, "failures": [], "ok": True}
        soak.judge_outputs(report)
        assert report["ok"] is not fails, judged
        assert bool(report["failures"]) is fails


def demo_request(phase, problem="output differs from the single-engine reference"):
    from kvcs_demo import demo

    return demo.RequestResult(f"demo.x.{phase}.000.r", phase, 200, "verified", None, "verified", None, {}, False,
                              output=OTHER, reference=REF, ok=not problem, problem=problem)


@pytest.mark.parametrize("cls, passes", [(outputs.NUMERICS, True), (outputs.NEAR_TIE, True),
                                         (outputs.KV_DIFFERS, False), (outputs.UNCOVERED, False),
                                         (outputs.PD_PATH, False), (outputs.UNEXPLAINED, False),
                                         (outputs.KV_UNKNOWN, False)])
def test_the_demo_passes_a_differing_clean_output_only_when_shown_numerics(monkeypatch, tmp_path, cls, passes):
    """A verified load whose output differs failed the demo; now it passes when
    its class says numerics, and change_tail is reported, never judged."""
    from kvcs_demo import demo
    from kvcs_demo.setups import Setup

    monkeypatch.setattr(demo, "_output_class", lambda *a: (cls, "why"))
    clean, tail = demo_request("clean"), demo_request("change_tail", problem="")
    demo.explain_outputs(Setup("x", tmp_path), "http://proxy", [demo.PhaseResult("clean", [clean]),
                                                                 demo.PhaseResult("change_tail", [tail])])
    assert clean.output_class == cls and clean.ok is passes
    assert (clean.problem == "") is passes and (passes or cls in clean.problem)
    assert tail.output_class == cls and tail.ok and tail.problem == ""


def test_the_demo_says_when_the_evidence_could_not_be_gathered(monkeypatch, tmp_path):
    from kvcs_demo import demo
    from kvcs_demo.setups import Setup

    def broken(*a):
        raise OSError("connection refused")

    monkeypatch.setattr(demo, "_output_class", broken)
    clean = demo_request("clean")
    demo.explain_outputs(Setup("x", tmp_path), "http://proxy", [demo.PhaseResult("clean", [clean])])
    assert clean.output_class == outputs.KV_UNKNOWN and not clean.ok
    assert "evidence not gathered: OSError: connection refused" in clean.problem
