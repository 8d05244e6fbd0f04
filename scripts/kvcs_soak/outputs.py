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
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

EQUAL = "equal"
KV_DIFFERS = "kv_differs"
KV_UNKNOWN = "kv_unknown"
NUMERICS = "kv_same_output_differs: numerics"
# The rows of the prompt's blocks that the witness digests (the same rows the
# checksum reads) were the producer's, but a drill's change that was to stay
# past the prompt (change_tail) reached the output: the same P/D path without
# the change gives the reference. On vLLM's CPU backend a partial block's
# tokens are not its first rows (scripts/kvcs_soak/cpu_kv_rows.py), so the
# change hit KV of the prompt that neither reads.
UNCOVERED = "kv_differs: outside the rows checked"
# The same bytes, no batch effect shown, but the same P/D path run alone
# gives this output again while the producer alone gives the reference: the
# P/D path's own arithmetic (the consumer computes the prompt's last token in
# a step of its own, one row, where the single engine computed it inside the
# prompt's prefill), deterministic, not the bytes.
PD_PATH = "kv_same_output_differs: P/D path"
# The same bytes, no batch effect shown in the probe's rounds, the same P/D
# path alone gives the reference, and where the answer first parts from the
# reference, its token is the reference's second choice within NEAR_TIE of
# the first (a tie of bf16 logits): any rounding difference flips it.
NEAR_TIE = "kv_same_output_differs: numerics at a tie"
# The most the reference's first choice may lead the answer's token by, in
# log-probability (the logits' difference), at the token where they part:
# one step of bf16 between 1 and 2 (2**-7). The logits are bf16 (vLLM's
# lm_head in the model's dtype), so the two are then a step or two apart.
NEAR_TIE_NATS = 2.0 ** -7
LOGPROBS = 5  # top choices asked for per token
UNEXPLAINED = "kv_same_output_differs: unexplained"
CLASSES = (EQUAL, KV_DIFFERS, UNCOVERED, KV_UNKNOWN, NUMERICS, NEAR_TIE, PD_PATH, UNEXPLAINED)


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
    # Where the answer first parts from the reference, from the reference's
    # top log-probabilities (divergence()): None when not asked.
    margin: dict | None = None
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
    same output); where a change meant to stay past the prompt was made and
    the same path without it gives the reference, it reached KV the witness
    does not read (kv_differs: outside the rows checked); else unexplained,
    with what is missing.
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
            return UNCOVERED, ("the rows the witness (and the checksum) read were the producer's, but the same P/D "
                               "path without the change gives the reference: the change reached KV the consumer "
                               "used outside those rows")
        return UNEXPLAINED, "same prompt KV bytes; with and without the change past the prompt, other outputs"
    changed = sum(b is not None and b != ev.reference for b in ev.batched)
    m = ev.margin or {}
    if not changed and ev.pd_alone == ev.reference and m.get("rank") == 2 and m.get("gap") is not None \
            and m["gap"] <= NEAR_TIE_NATS:
        return NEAR_TIE, (f"same KV bytes; the same P/D path alone gives the reference; where the answer parts from "
                          f"it (token {m['position']}), its token is the reference's second choice, "
                          f"{m['gap']:.4g} nats behind the first: a tie that a rounding difference flips (no batch "
                          f"effect in {len(ev.batched)} batched runs on the producer)")
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


def divergence(output: str, tokens: Sequence[str], top: Sequence[dict | None]) -> dict | None:
    """Where `output` first parts from the reference whose completion
    log-probabilities are (tokens, top): {"position", "token", "output_token",
    "rank" (of the answer's token among the reference's top choices there,
    None when not among them), "gap" (first choice minus the answer's token,
    in nats)}; None when they do not part. Whitespace between tokens is
    skipped (word-level tokenizers leave it out of the tokens)."""
    pos = 0
    for k, tok in enumerate(tokens):
        while pos < len(output) and output[pos].isspace():
            pos += 1
        want = tok.strip()
        if not want:  # a whitespace token (a newline): skipped like the whitespace
            continue
        if output.startswith(want, pos):
            pos += len(want)
            continue
        choices = {t.strip(): lp for t, lp in (top[k] or {}).items()} if k < len(top) else {}
        here = [t for t in choices if t and t != want and output.startswith(t, pos)]
        if not here:
            return {"position": k, "token": want, "output_token": None, "rank": None, "gap": None}
        mine = max(here, key=len)
        ranked = sorted(choices, key=lambda t: -choices[t])
        return {"position": k, "token": want, "output_token": mine, "rank": ranked.index(mine) + 1,
                "gap": choices[ranked[0]] - choices[mine]}
    return None


def margin_of(body: dict, output: str) -> dict | None:
    """divergence() of `output` from a completion answer `body` asked with
    logprobs (the reference again); None when the answer has no logprobs."""
    try:
        lp = body["choices"][0]["logprobs"]
        return divergence(output, lp["tokens"], lp["top_logprobs"])
    except (KeyError, IndexError, TypeError):
        return None


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
STAGGER_S = 1.0


def _after(delay: float, complete: Complete, prompt: str, max_tokens: int):
    time.sleep(delay)
    return complete(prompt, max_tokens)


def probe(complete: Complete, prompt: str, max_tokens: int, reference: str | None,
          companions: Sequence[tuple[str, int]], rounds: int = BATCH_ROUNDS, seed: int = 0) -> tuple[list, list]:
    """The producer's part of the evidence for one prompt: (alone, batched).

    alone: the reference, then the prompt once more with nothing else sent.
    batched: runs of the prompt sent at once with some of `companions`
    ((prompt, most tokens it may decode)), up to `rounds`, stopping at the
    first that does not give the reference. Each run takes another number of
    companions and other decode lengths (reproducible by `seed`), every
    other run spreads their arrivals over up to STAGGER_S seconds, so the
    batch crosses vLLM's 4-row kernel switch at other steps of the decode:
    which steps a P/D answer decoded with how many others is not known.
    The caller sends nothing else to that server meanwhile.
    """
    rng = random.Random(seed)
    alone = [reference, complete(prompt, max_tokens)]
    batched: list[str | None] = []
    for r in range(rounds):
        others = [(p, min(most, rng.choice(COMPANION_TOKENS)))
                  for p, most in rng.sample(list(companions), rng.randint(1, len(companions)))]
        # Every other round the companions arrive spread over the prompt's
        # decode, so their prefills share steps with its decode tokens (a
        # P/D consumer's steps mix loads, recomputed last tokens and decodes).
        delays = [rng.uniform(0.0, STAGGER_S) if r % 2 else 0.0 for _ in others]
        with ThreadPoolExecutor(len(others) + 1) as pool:
            mine = pool.submit(complete, prompt, max_tokens)
            for (p, n), delay in zip(others, delays):
                pool.submit(_after, delay, complete, p, n)
            batched.append(mine.result())
        if batched[-1] is not None and batched[-1] != reference:
            break
    return alone, batched
