"""Outputs after a load against the producer's one-at-a-time reference: when
one differs, is it the KV or the arithmetic?

A P/D answer is compared with the producer's own greedy output for the same
prompt, computed alone (the reference). When they differ, two causes are
possible, and the evidence tells them apart:

- the KV: the bytes the consumer used differ from the bytes the producer
  sent. The drill connector's witness digests (vllm_kvchecksum.drills.kv_witness,
  scripts/kvcs_soak/truth.py) say so for each load: "victim".
- numerics: the bytes are the same ("clean"), but the model's arithmetic
  depends on what else is in the batch. On a CPU with AMX, vLLM's CPU linear
  layers for small weights (sgl-kernel weight_packed_linear) run AMX brgemm
  for more than 4 rows and an AVX-512 kernel for up to 4, so a token's
  activations round differently alone and in a batch; a greedy decode at a
  near tie then picks another token. It is shown for the request itself: the
  same prompt on the producer alone gives the reference again, and sent with
  other requests at once gives another output.

classify() is the judge, a pure function of that evidence (tests feed it by
hand: tests/demo/test_output_judge.py); probe() gathers the producer's part
of it from a real server. The soak (--outputs) and the demo use both.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

EQUAL = "equal"
KV_DIFFERS = "kv_differs"
KV_UNKNOWN = "kv_unknown"
NUMERICS = "kv_same_output_differs: numerics"
# The prompt's bytes were the producer's, but bytes past the prompt that a
# drill changed on purpose (change_tail) reached the output: the same P/D
# path without the change gives the reference.
PAST_PROMPT = "kv_same_output_differs: bytes past the prompt"
# The same bytes, no batch effect shown, but the same P/D path run alone
# gives this output again while the producer alone gives the reference: the
# P/D path's own arithmetic (the consumer computes the prompt's last token in
# a step of its own, one row, where the single engine computed it inside the
# prompt's prefill), deterministic, not the bytes.
PD_PATH = "kv_same_output_differs: P/D path"
UNEXPLAINED = "kv_same_output_differs: unexplained"
CLASSES = (EQUAL, KV_DIFFERS, KV_UNKNOWN, NUMERICS, PD_PATH, PAST_PROMPT, UNEXPLAINED)


@dataclass
class OutputEvidence:
    """One answer compared with its reference, and what decides why it differs.

    kv: the ground truth of the load behind the answer ("clean": the bytes
    the consumer used are the bytes the producer sent; "victim": some differ;
    anything else, or None: not known). alone: the producer's outputs for the
    prompt, each computed with nothing else running (the reference among
    them, first); batched: its outputs for the prompt sent at once with other
    requests. tail_rerun: for a load whose bytes past the prompt were changed
    on purpose (the demo's change_tail), the output of the same prompt through
    the same P/D path without the change (None: not asked).
    """

    request_id: str
    output: str | None
    reference: str | None
    kv: str | None
    alone: list[str | None] = field(default_factory=list)
    batched: list[str | None] = field(default_factory=list)
    tail_rerun: str | None = None
    # The same request through the same P/D path again, alone (None: not asked).
    pd_alone: str | None = None
    verdict: str = ""  # classify()'s answer
    why: str = ""


def classify(ev: OutputEvidence) -> tuple[str, str]:
    """(class, why) of one answer; see the module docstring.

    equal: the output is the reference. kv_differs: the load's bytes differ
    from what was sent. kv_unknown: the output differs and nothing says
    whether the bytes were the same. For a load whose bytes are the same:
    numerics when the producer alone gives the reference every time and some
    batched run of the same prompt gives something else (and, where the
    bytes past the prompt were changed, the output without the change is the
    same output); where the bytes past the prompt were changed and the same
    path without the change gives the reference, those bytes reached the
    output; else unexplained, with what is missing.
    """
    if ev.output is None or ev.reference is None:
        return KV_UNKNOWN, "no output or no reference to compare"
    if ev.output == ev.reference:
        return EQUAL, "the output is the reference"
    if ev.kv == "victim":
        return KV_DIFFERS, "the bytes the consumer used differ from the bytes the producer sent (witness digests)"
    if ev.kv != "clean":
        return KV_UNKNOWN, f"the output differs and the load's bytes were not compared (ground truth {ev.kv!r})"
    if not ev.alone or any(a != ev.reference for a in ev.alone):
        return UNEXPLAINED, (f"same KV bytes; the producer alone does not give the reference every time "
                             f"({len(ev.alone)} runs): not batching")
    if ev.tail_rerun is not None and ev.tail_rerun != ev.output:
        if ev.tail_rerun == ev.reference:
            return PAST_PROMPT, ("same prompt KV bytes, and the same P/D path without the change past the prompt "
                                 "gives the reference: the changed bytes past the prompt reached the output")
        return UNEXPLAINED, "same prompt KV bytes; with and without the change past the prompt, other outputs"
    changed = sum(b is not None and b != ev.reference for b in ev.batched)
    if not changed and ev.pd_alone is not None and ev.pd_alone == ev.output:
        return PD_PATH, (f"same KV bytes; the producer gave the reference alone ({len(ev.alone)} runs) and batched "
                         f"({len(ev.batched)} runs), and the same P/D path alone gave this output again")
    if not changed:
        return UNEXPLAINED, (f"same KV bytes; the producer gave the reference alone ({len(ev.alone)} runs) and "
                             f"batched ({len(ev.batched)} runs): no batch effect shown")
    same = sum(b == ev.output for b in ev.batched)
    return NUMERICS, (f"same KV bytes; the producer gave the reference alone in {len(ev.alone)} of {len(ev.alone)} "
                      f"runs and another output batched in {changed} of {len(ev.batched)}"
                      + (f", {same} of them the very output of the P/D answer" if same else ""))


def judge(evidence: Sequence[OutputEvidence]) -> dict:
    """Classify each answer in place; the counts by class and the differing answers."""
    for ev in evidence:
        ev.verdict, ev.why = classify(ev)
    counts = Counter(ev.verdict for ev in evidence)
    return {"compared": len(evidence), **{c: counts.get(c, 0) for c in CLASSES},
            "differing": [vars(ev) for ev in evidence if ev.verdict != EQUAL]}


def summary_line(judged: dict) -> str:
    """One line: how many answers equal the reference, and why the others differ."""
    parts = [f"{judged[c]} {c}" for c in CLASSES[1:] if judged.get(c)]
    return (f"{judged['compared']} compared: {judged[EQUAL]} equal to the one-at-a-time reference"
            + (f"; differing: {', '.join(parts)}" if parts else ""))


# One completion on a server: (prompt, max_tokens) -> output text, None on failure.
Complete = Callable[[str, int], "str | None"]

BATCH_ROUNDS = 8
BATCH_COMPANIONS = 7
COMPANION_TOKENS = (4, 8, 16, 32, 64, 96)


def probe(complete: Complete, prompt: str, max_tokens: int, reference: str | None,
          companions: Sequence[tuple[str, int]], rounds: int = BATCH_ROUNDS, seed: int = 0) -> tuple[list, list]:
    """The producer's part of the evidence for one prompt: (alone, batched).

    alone: the reference, then the prompt once more with nothing else sent.
    batched: runs of the prompt sent at once with some of `companions`
    ((prompt, most tokens it may decode)), up to `rounds`, stopping at the
    first that does not give the reference. Each run takes another number of
    companions and other decode lengths (reproducible by `seed`), so the
    batch crosses vLLM's 4-row kernel switch at other steps of the decode:
    which steps a P/D answer decoded with how many others is not known.
    The caller sends nothing else to that server meanwhile.
    """
    rng = random.Random(seed)
    alone = [reference, complete(prompt, max_tokens)]
    batched: list[str | None] = []
    for _ in range(rounds):
        others = [(p, min(most, rng.choice(COMPANION_TOKENS)))
                  for p, most in rng.sample(list(companions), rng.randint(1, len(companions)))]
        with ThreadPoolExecutor(len(others) + 1) as pool:
            mine = pool.submit(complete, prompt, max_tokens)
            for p, n in others:
                pool.submit(complete, p, n)
            batched.append(mine.result())
        if batched[-1] is not None and batched[-1] != reference:
            break
    return alone, batched
