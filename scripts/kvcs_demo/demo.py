"""make demo: real disaggregated vLLM servers that catch bad KV transfers.

    .venv/bin/python -m kvcs_demo            (with scripts/ on PYTHONPATH; `make demo` does this)

Starts real OpenAI-compatible vLLM servers of the patched tree (producers and
consumers over NIXL: NixlConnector, or NixlPushConnector with --mode push,
UCX on loopback on CPU; or MooncakeConnector with --mode mooncake, the
Mooncake Transfer Engine over TCP on loopback) and the project's own
P/D proxy, each a separate process in its own process group; waits on their
health endpoints; then, per setup (see setups.py), runs a clean phase and one
phase per fault kind, with the consumer's fault-injecting connector
(vllm_kvchecksum.drills.fault_connector) switched by its control file. Each request's
verdict is read from the consumer's Prometheus /metrics (the counter that
moved), each injection from the connector's JSON lines, the reported block
positions from the client's error (policy "fail") or the consumer's mismatch
log line (the other policies), and each output is compared with the
producer's own single-engine output. Then a hostile client, and TTFT with
checksums on vs off. Prints one progress line per phase and a table, writes
build/demo/report.json (schema: docs/e2e.md), and exits non-zero when any
check fails. Every process it started is stopped on exit, Ctrl-C or failure.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import re
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvcs_demo import alerts, prom
from kvcs_demo.client import OUTPUT_TOKENS, completion, error_of, text_of
from kvcs_demo.servers import ProcessGroup, ServerSpec, free_port_block
from kvcs_demo.setups import (MODES, ROOT, Setup, cpu_setups, gpu_plan, gpu_setups, kv_transfer_config, make_models,
                              mooncake_bootstrap, push_target, server_argv, server_env, visible_gpus)
from kvcs_demo.store import STORE_FAULTS, expand_positions
from kvcs_demo.summary import log, log_ending
from vllm_kvchecksum.engine import incident

# A producer-side phase: the producer's drill connector flips a bit in a
# finished request's held KV, after its checksums were sent and before its
# transfer completes; its re-check must find it (and the consumer's check,
# when the read comes after the flip).
PRODUCER_FLIP = "producer_flip_bit"
FAULT_KINDS = ("flip_bit", "overwrite_piece", "swap_tokens", "swap_heads", "swap_layers", "swap_blocks",
               "misplace_block", "change_tail", "drop_checksums", PRODUCER_FLIP)
# Where a producer's re-check line may still be on its way: the transfer's
# completion reaches the producer after the consumer's verdict.
WHERE_WAIT_S = 20.0
PROMPT_WORDS = 150  # 151 tokens with BOS: 5 blocks of 32, the last one partial (change_tail needs that)
METRIC = "vllm:kv_checksum_"
LOAD_COUNTERS = ("loads_verified", "loads_mismatched", "loads_unverified", "loads_not_compared")
VERDICT_WAIT_S = 15.0
STARTUP_TIMEOUT_S = 900.0
STARTUP_PROGRESS_S = 15.0  # a "waiting for ..." line this often while servers start


# ----------------------------------------------------------------- requests

def prompt_of(key: str) -> str:
    """A prompt of its own for `key`: words drawn from sha256(key), so two
    requests share no first block (no prefix-cache hit between requests)."""
    words, counter = [], 0
    while len(words) < PROMPT_WORDS:
        digest = hashlib.sha256(f"{key}/{counter}".encode()).digest()
        words += [f"w{int.from_bytes(digest[i:i + 2], 'little') % 500 + 4}" for i in range(0, len(digest), 2)]
        counter += 1
    return " ".join(words[:PROMPT_WORDS])


# ----------------------------------------------------------------- verdicts

def checksum_counts(url: str, attempts: int = 3) -> dict[str, float]:
    """The consumer's vllm:kv_checksum_* counters, flattened to "name" / "name/label".

    A scrape that fails is tried again (a busy 2-core machine can miss the
    timeout once); the last failure is raised.
    """
    for attempt in range(attempts):
        try:
            samples = prom.scrape(url)
            break
        except prom.ScrapeError:
            if attempt == attempts - 1:
                raise
    counts: dict[str, float] = {}
    for (name, labels), value in samples.items():
        if not name.startswith(METRIC) or not name.endswith("_total"):
            continue
        key = name[len(METRIC):-len("_total")]
        # The counter's own label (reason, rollback), not vLLM's (model_name, engine).
        label = next((v for k, v in labels if k not in ("model_name", "engine")), None)
        key = f"{key}/{label}" if label else key
        counts[key] = counts.get(key, 0) + value
    return counts


def diff(after: dict[str, float], before: dict[str, float]) -> dict[str, int]:
    return {k: int(v - before.get(k, 0)) for k, v in after.items() if v - before.get(k, 0)}


def counter_total(counts: dict, name: str) -> int:
    """A counter's value summed over its labels ("name" and "name/label" keys)."""
    return sum(v for k, v in counts.items() if k.split("/")[0] == name)


def loads_in(delta: dict[str, int]) -> int:
    return sum(v for k, v in delta.items() if k.split("/")[0] in LOAD_COUNTERS)


def verdict_of(delta: dict[str, int]) -> tuple[str, str | None]:
    """(verdict, reason) of the one load a counter delta holds."""
    if loads_in(delta) > 1 or any(v < 0 for v in delta.values()):
        return "ambiguous", json.dumps(delta, sort_keys=True)
    for key, n in delta.items():
        name, _, label = key.partition("/")
        if n and name in LOAD_COUNTERS:
            return {"loads_verified": "verified", "loads_mismatched": "mismatch", "loads_unverified": "unverified",
                    "loads_not_compared": "not_compared"}[name], label or None
    return "no_load", None


def wait_for_verdict(url: str, before: dict[str, float]) -> dict[str, int]:
    """The counter delta once one more load is counted (bounded wait on /metrics)."""
    deadline = time.monotonic() + VERDICT_WAIT_S
    while True:
        delta = diff(checksum_counts(url), before)
        if loads_in(delta) >= 1 or time.monotonic() > deadline:
            return delta
        time.sleep(0.1)


_CLIENT_POSITIONS = re.compile(r"group (\d+) blocks \[([\d, ]*)\]")
_LOG_MISMATCH = re.compile(r"KV checksum mismatch for request '([^']*)': (.*)")
_LOG_GROUP = re.compile(r"group (\d+) differs at block positions ([\d, \-]+) \(")


def positions_from_client_error(message: str) -> dict[int, list[int]]:
    return {int(g): sorted(int(p) for p in ps.split(",") if p.strip())
            for g, ps in _CLIENT_POSITIONS.findall(message)}


def positions_from_log(log_path: Path, request_id: str) -> dict[int, list[int]]:
    """The block positions of the consumer's mismatch line for the request."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return {}
    for rid, rest in _LOG_MISMATCH.findall(text):
        if request_id in rid:
            return {int(g): expand_positions(ps) for g, ps in _LOG_GROUP.findall(rest)}
    return {}


def injections_for(path: Path | None, request_id: str) -> list[dict]:
    if path is None or not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and request_id in str(rec.get("request_id", "")):
            out.append(rec)
    return out


# ----------------------------------------------------------------- phases

@dataclass
class RequestResult:
    request_id: str
    phase: str
    status: int
    verdict: str
    reason: str | None
    expected: str
    injection: dict | None
    reported: dict[int, list[int]]
    output_equal: bool | None  # None: no output (the request failed)
    error: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    ok: bool = False
    problem: str = ""
    # Joined from both servers' incident lines once the setup's phases ran:
    # where a mismatch happened, and the producer's re-check of this request.
    where: str | None = None
    producer_recheck: str | None = None
    # The texts compared for output_equal: the consumer's output through the
    # proxy, and the producer's own single-engine output (None: not asked for).
    output: str | None = None
    reference: str | None = None
    # Why a verified load's output differs from the reference (kvcs_soak.outputs:
    # kv_differs, kv_same_output_differs: numerics, ...), and its evidence.
    output_class: str | None = None
    output_evidence: dict | None = None


@dataclass
class PhaseResult:
    phase: str
    requests: list[RequestResult] = field(default_factory=list)
    metrics: dict[str, int] = field(default_factory=dict)
    # --alerts: what Prometheus showed for the setup after the phase (alerts.check_phase).
    alerts: dict | None = None


def expected_verdict(phase: str, injection: dict | None) -> str:
    if phase == "clean" or injection is None or injection.get("skipped"):
        return "verified"
    return injection.get("expect", "mismatch")


def judge(res: RequestResult, setup: Setup) -> None:
    """Whether the request went as the policy and the injection say it must."""
    problems = []
    if res.phase != "clean" and res.injection is None:
        problems.append("no injection recorded (rate 1)")
    if res.phase == PRODUCER_FLIP and res.verdict == "verified":
        # The consumer read before the flip landed: its KV was good. The
        # producer's re-check must still find the flip (join_where).
        pass
    elif res.verdict != res.expected:
        problems.append(f"verdict {res.verdict} ({res.reason}), expected {res.expected}")
    elif res.phase == "drop_checksums" and res.reason != "no_producer_checksums":
        problems.append(f"unverified for {res.reason}, expected no_producer_checksums")
    if res.expected == "mismatch" and res.verdict == "mismatch" and res.injection is not None:
        want = {int(res.injection["group"]): sorted(res.injection["positions"])}
        if res.reported != want:
            problems.append(f"reported positions {res.reported}, injected {want}")
    failed_check = res.verdict in ("mismatch", "unverified")
    if failed_check and setup.policy == "fail":
        if res.status == 200 or "kv_checksum_" not in res.error:
            problems.append(f"policy fail: expected an error naming the KV checksum failure, got {res.status} "
                            f"{res.error[:120]!r}")
    elif res.status != 200:
        problems.append(f"HTTP {res.status}: {res.error[:160]}")
    # change_tail: only the checksum's verdict is required; what the model
    # decodes after bytes past the prompt changed is the attention kernel's
    # business (see docs/e2e.md), reported in output_equal, not judged.
    must_equal = (not failed_check or setup.policy == "recompute" or res.expected == "unverified") \
        and res.phase != "change_tail"
    if res.status == 200 and must_equal and not res.output_equal:
        problems.append(OUTPUT_PROBLEM)
    res.problem = "; ".join(problems)
    res.ok = not problems


def run_request(client: httpx.Client, setup: Setup, proxy: str, phase: str, index: int) -> RequestResult:
    rid = f"demo.{setup.name}.{phase}.{index:03d}.r"
    prompt = prompt_of(rid)
    consumer = setup.urls["consumer"]
    t0 = time.perf_counter()
    # The single-engine reference (the producer's own greedy output), where an
    # output is expected: not for faults that fail the request under "fail".
    reference = None
    if phase in ("clean", "change_tail", PRODUCER_FLIP) or setup.policy != "fail":
        status, ref_body = completion(client, setup.urls["producer"], prompt)
        reference = text_of(ref_body)
    t1 = time.perf_counter()
    before = checksum_counts(consumer)
    t2 = time.perf_counter()
    status, body = completion(client, f"{proxy}/pairs/{setup.name}", prompt, request_id=rid)
    t3 = time.perf_counter()
    delta = wait_for_verdict(consumer, before)
    t4 = time.perf_counter()
    timings = {"reference_ms": (t1 - t0) * 1000, "scrape_ms": (t2 - t1) * 1000, "pd_ms": (t3 - t2) * 1000,
               "verdict_wait_ms": (t4 - t3) * 1000}
    verdict, reason = verdict_of(delta)
    error = error_of(body) if status != 200 else ""
    injections = injections_for(setup.producer_injections_path if phase == PRODUCER_FLIP
                                else setup.injections_path, rid)
    injection = injections[0] if injections else None
    if status != 200 and "kv_checksum_mismatch" in error:
        reported = positions_from_client_error(error)
    elif verdict == "mismatch":
        reported = positions_from_log(setup.logs["consumer"], rid)
    else:
        reported = {}
    out = text_of(body) if status == 200 else None
    res = RequestResult(rid, phase, status, verdict, reason, expected_verdict(phase, injection), injection,
                        reported, None if out is None or reference is None else out == reference, error,
                        timings=timings, output=out, reference=reference)
    judge(res, setup)
    return res


def set_faults(setup: Setup, kind: str | None) -> None:
    """The phase's fault: on the consumer's loads, or (PRODUCER_FLIP) on the producer's sends."""
    on_producer = kind == PRODUCER_FLIP
    for path, own in ((setup.control_path, None if on_producer else kind),
                      (setup.producer_control_path, "flip_bit" if on_producer else None)):
        if path is None:
            continue
        control = {"kinds": [], "rate": 0.0} if own is None else {"kinds": [own], "rate": 1.0}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(control))
        os.replace(tmp, path)  # atomic: the connector never reads half a file


def producer_rechecks(text: str) -> dict[str, tuple[str, dict]]:
    """A producer log's re-check lines: request id (and transfer id) -> (result, changed positions).

    A line for a read after the release is no re-check: left out."""
    out = {}
    for line in incident.read_incidents(text):
        if line.get("side") == "producer" and line.get("verdict") != incident.READ_AFTER_RELEASE:
            for key in ("request_id", "transfer_id"):
                if isinstance(line.get(key), str):
                    out[line[key]] = (line.get("verdict"), line.get("groups") or {})
    return out


def join_where(setup: Setup, phases: list[PhaseResult]) -> None:
    """Where each request's KV went bad, from both servers' incident lines, and the judgement of it.

    A fault injected into a load (on the consumer) must read "intact on the
    producer"; a flip in a held send (PRODUCER_FLIP) must be "changed" in the
    producer's re-check at the flipped positions, and, where the consumer's
    check failed too, read "changed on the producer". With checksums, every
    P/D request must have been re-checked by the producer.
    """
    if not setup.checksums:
        return
    reqs = [r for ph in phases for r in ph.requests]
    deadline = time.monotonic() + WHERE_WAIT_S
    while True:
        consumer = setup.logs["consumer"].read_text(errors="replace")
        producer = setup.logs["producer"].read_text(errors="replace")
        rechecks = producer_rechecks(producer)
        for r in reqs:
            r.producer_recheck = next((v for k, (v, _) in rechecks.items() if r.request_id in k), None)
        if all(r.producer_recheck for r in reqs if r.verdict in ("verified", "mismatch", "unverified")) \
                or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    places = {line.get("request_id"): place for line, place in incident.attribute([consumer], [producer])}
    for r in reqs:
        r.where = next((place for rid, place in places.items() if isinstance(rid, str) and r.request_id in rid),
                       None)
        problems = []
        if r.verdict == "mismatch" and r.where is None:
            problems.append("no incident line for the mismatch")
        elif r.phase == PRODUCER_FLIP and r.injection is not None and not r.injection.get("skipped"):
            changed = next((groups for k, (v, groups) in rechecks.items() if r.request_id in k and v == "changed"),
                           None)
            want = {str(r.injection["group"]): sorted(r.injection["positions"])}
            if changed != want:
                problems.append(f"the producer's re-check reported {r.producer_recheck} {changed}, flipped {want}")
            if r.verdict == "mismatch" and r.where != incident.CHANGED_ON_PRODUCER:
                problems.append(f"where {r.where!r}, expected {incident.CHANGED_ON_PRODUCER!r}")
        elif r.verdict == "mismatch" and r.where != incident.INTACT_ON_PRODUCER:
            problems.append(f"where {r.where!r}, expected {incident.INTACT_ON_PRODUCER!r} (the fault was "
                            f"injected on the consumer)")
        elif r.phase != PRODUCER_FLIP and r.producer_recheck not in ("intact", None):
            problems.append(f"the producer's re-check says {r.producer_recheck}, nothing was injected there")
        if r.producer_recheck is None and r.verdict in ("verified", "mismatch"):
            problems.append("the producer wrote no re-check line for the request")
        if problems:
            r.problem = "; ".join(filter(None, [r.problem, *problems]))
            r.ok = False


OUTPUT_PROBLEM = "output differs from the single-engine reference"


def load_truths(setup: Setup) -> dict[str, str]:
    """Each consumer request's load ground truth from both witness files
    ("clean", "victim", ...; kvcs_soak.truth), by request id."""
    from kvcs_soak import truth  # the soak's judge of the witness lines (scripts/kvcs_soak)

    if not setup.witness_paths:
        return {}
    sends = truth.read_lines(setup.witness_paths["producer"])
    loads = truth.read_lines(setup.witness_paths["consumer"])
    out: dict[str, str] = {}
    for t in truth.judge_loads(sends, loads, set()):
        out[t.request_id] = "victim" if "victim" in (out.get(t.request_id), t.truth) else t.truth
    return out


def explain_outputs(setup: Setup, proxy: str, phases: list[PhaseResult]) -> None:
    """Why each verified load's output differs from the reference, once the setup's phases ran.

    The evidence (kvcs_soak.outputs): the witness digests of the bytes the
    consumer used against those the producer sent; the same prompt through
    the same P/D path again with no fault (for change_tail: without the
    change); on the producer, the prompt alone again, sent at once with
    other prompts, and with its top choices where the answer parts from it.
    A difference shown to be numerics is no problem of the request (the KV
    was the producer's); any other is one, but for change_tail, whose output
    is reported and not judged.
    """
    from kvcs_soak import outputs

    reqs = [r for ph in phases for r in ph.requests if r.verdict == "verified" and r.status == 200
            and r.reference is not None and r.output is not None and r.output != r.reference]
    if not reqs:
        return
    truths = load_truths(setup)
    with httpx.Client(trust_env=False) as client:
        def complete(prompt: str, max_tokens: int) -> str | None:
            status, body = completion(client, setup.urls["producer"], prompt, max_tokens=max_tokens)
            return text_of(body) if status == 200 else None

        for r in reqs:
            try:
                r.output_class, why = _output_class(setup, proxy, client, complete, truths, r, outputs)
            except Exception as exc:  # the evidence could not be gathered: said, never a silent pass
                r.output_class, why = outputs.KV_UNKNOWN, f"evidence not gathered: {type(exc).__name__}: {exc}"
                r.output_evidence = {"why": why}
            log(f"[{setup.name}] {r.phase}: output differs from the reference: {r.output_class} ({why})")
            if r.phase == "change_tail":
                continue  # its verdict is judged, its output reported (docs/e2e.md)
            problems = [p for p in r.problem.split("; ") if p and p != OUTPUT_PROBLEM]
            if r.output_class not in (outputs.NUMERICS, outputs.NEAR_TIE):
                problems.append(f"{OUTPUT_PROBLEM}: {r.output_class} ({why})")
            r.problem, r.ok = "; ".join(problems), not problems


def _output_class(setup: Setup, proxy: str, client: httpx.Client, complete, truths: dict[str, str],
                  r: RequestResult, outputs) -> tuple[str, str]:
    """One differing output's evidence (explain_outputs) and its class."""
    prompt = prompt_of(r.request_id)
    kv = next((v for rid, v in truths.items() if r.request_id in rid), None)
    ev = outputs.OutputEvidence(r.request_id, r.output, r.reference, kv)
    # The same request through the same P/D path again, with no fault.
    set_faults(setup, None)
    status, body = completion(client, f"{proxy}/pairs/{setup.name}", prompt, request_id=f"{r.request_id}.rerun")
    rerun = text_of(body) if status == 200 else None
    if r.phase == "change_tail":
        ev.tail_rerun = rerun
    else:
        ev.pd_alone = rerun
    # Companions that keep decoding while the prompt's OUTPUT_TOKENS are.
    companions = [(prompt_of(f"{r.request_id}.companion.{i}"), 2 * OUTPUT_TOKENS)
                  for i in range(outputs.BATCH_COMPANIONS)]
    if kv == "clean":
        ev.alone, ev.batched = outputs.probe(complete, prompt, OUTPUT_TOKENS, r.reference, companions)
        status, body = completion(client, setup.urls["producer"], prompt, logprobs=outputs.LOGPROBS)
        ev.margin = outputs.margin_of(body, r.output) if status == 200 else None
    cls, why = outputs.classify(ev)
    r.output_evidence = {**vars(ev), "why": why}
    return cls, why


def wait_ready(group: ProcessGroup, servers: list, setup: Setup, t0: float,
               up: threading.Event | None = None) -> None:
    group.wait_healthy(servers, timeout=STARTUP_TIMEOUT_S, progress=lambda line: log(f"[{setup.name}] {line}"),
                       progress_every=STARTUP_PROGRESS_S)
    log(f"[{setup.name}] producer and consumer healthy after {time.monotonic() - t0:.0f} s")
    if up is not None:
        up.set()


def run_setup(setup: Setup, proxy: str, kinds: list[str], n: int, out: dict, errors: dict,
              ready=lambda: None, prometheus: alerts.Prometheus | None = None) -> None:
    phases: list[PhaseResult] = []
    try:
        ready()
    except Exception as exc:  # a server that failed to start: report it, stop the run
        errors[setup.name] = f"{type(exc).__name__}: {exc}"
        return
    out[setup.name] = phases
    try:
        _run_phases(setup, proxy, kinds, n, phases, prometheus)
        join_where(setup, phases)
        explain_outputs(setup, proxy, phases)
    except Exception as exc:  # reported as a failure of the setup, never a silent pass
        errors[setup.name] = f"{type(exc).__name__}: {exc}"
        log(f"[{setup.name}] stopped: {errors[setup.name]}")


def _run_phases(setup: Setup, proxy: str, kinds: list[str], n: int, phases: list,
                prometheus: alerts.Prometheus | None = None) -> None:
    with httpx.Client(trust_env=False) as client:
        for phase in ["clean", *kinds]:
            set_faults(setup, None if phase == "clean" else phase)
            result = PhaseResult(phase)
            before = checksum_counts(setup.urls["consumer"])
            for i in range(n):
                result.requests.append(run_request(client, setup, proxy, phase, i))
            result.metrics = diff(checksum_counts(setup.urls["consumer"]), before)
            if prometheus is not None:
                result.alerts = alerts.check_phase(prometheus, setup.name, phase, kinds, time.time())
            phases.append(result)
            ok = sum(r.ok for r in result.requests)
            log(f"[{setup.name}] {phase:<15} {n} requests: " + summary(result.metrics)
                + f"; as expected {ok}/{n}" + ("" if ok == n else "  <-- " + next(
                    r.problem for r in result.requests if not r.ok))
                + ("" if result.alerts is None else f"; alerts: {alerts.summary(result.alerts)}"
                   + "".join(f"  <-- {p}" for p in result.alerts["problems"][:1])))
        set_faults(setup, None)


def summary(metrics: dict[str, int]) -> str:
    def total(name):
        return counter_total(metrics, name)
    return (f"verified {total('loads_verified')}, mismatched {total('loads_mismatched')}, "
            f"unverified {total('loads_unverified')}")


# ----------------------------------------------------------------- hostile client

def forged_payloads(real: str) -> dict[str, str]:
    from vllm_kvchecksum.core.payload import MAX_TOKENS, KVChecksumPayload

    payload = KVChecksumPayload.decode(real)
    # Accepted by the decoder (every field below its bounds), yet no consumer
    # block lines up with it: one block of 2**40 - 1 tokens (and no binding
    # to the prompt, which would have to cover them).
    extreme = dataclasses.replace(
        payload, num_tokens=MAX_TOKENS - 1, binding=None,
        groups={gid: dataclasses.replace(g, block_size=MAX_TOKENS - 1, start=0, values=g.values[:1])
                for gid, g in payload.groups.items()})
    return {"malformed": "%%not-a-payload%%" + real[:40], "extreme_values": extreme.encode()}


def run_hostile(setup: Setup, proxy: str) -> list[dict]:
    """Forged kv_checksums straight to the consumer: unverified, and the consumer keeps serving."""
    results = []
    set_faults(setup, None)
    with httpx.Client(trust_env=False) as client:
        for name, _ in (("malformed", None), ("extreme_values", None)):
            rid = f"demo.{setup.name}.hostile-{name}.r"
            prompt = prompt_of(rid)
            status, body = completion(client, setup.urls["producer"], prompt, max_tokens=1,
                                      kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
            params = dict(body.get("kv_transfer_params") or {})
            forged = forged_payloads(params["kv_checksums"])[name]
            params["kv_checksums"] = forged
            before = checksum_counts(setup.urls["consumer"])
            status, body = completion(client, setup.urls["consumer"], prompt, request_id=rid,
                                      kv_transfer_params=params)
            delta = wait_for_verdict(setup.urls["consumer"], before)
            verdict, reason = verdict_of(delta)
            rid_next = f"demo.{setup.name}.after-{name}.r"
            next_status, next_body = completion(client, f"{proxy}/pairs/{setup.name}", prompt_of(rid_next),
                                                request_id=rid_next)
            ok = verdict == "unverified" and next_status == 200 and (
                status != 200 if setup.fail_closed else status == 200)
            results.append({"payload": name, "status": status, "error": error_of(body)[:200], "verdict": verdict,
                            "reason": reason, "next_request_status": next_status, "ok": ok})
            log(f"[{setup.name}] hostile {name:<14} HTTP {status}, verdict {verdict} ({reason}); next request "
                f"HTTP {next_status}" + ("" if ok else "  <-- unexpected"))
    return results


# ----------------------------------------------------------------- TTFT

def measure_ttft(on: Setup, off: Setup, proxy: str, n: int) -> dict:
    """Time to first token through the proxy (prefill, transfer, first decode
    token: max_tokens=1), checksums on vs off, alternating, in the same run."""
    times: dict[str, list[float]] = {"on": [], "off": []}
    failed = {"on": 0, "off": 0}
    errors: dict[str, str] = {"on": "", "off": ""}
    set_faults(on, None)
    with httpx.Client(trust_env=False) as client:
        for i in range(n + 1):
            order = (("on", on), ("off", off)) if i % 2 else (("off", off), ("on", on))
            for label, setup in order:
                rid = f"demo.ttft.{label}.{i:03d}.r"
                t0 = time.perf_counter()
                status, body = completion(client, f"{proxy}/pairs/{setup.name}", prompt_of(rid), max_tokens=1,
                                          request_id=rid)
                elapsed = time.perf_counter() - t0
                if status != 200:
                    failed[label] += 1
                    errors[label] = errors[label] or f"HTTP {status}: {error_of(body)[:160]}"
                if i > 0 and status == 200:  # the first pair warms both paths up
                    times[label].append(elapsed)
    # The two pairs take turns (and turns which goes first), so both see the
    # same machine; p50, as single requests on a shared 2-core box have tails.
    p50 = {k: statistics.median(v) * 1000 if v else None for k, v in times.items()}
    ratio = p50["on"] / p50["off"] if p50["on"] and p50["off"] else None
    return {"requests_each": n, "on_p50_ms": p50["on"], "off_p50_ms": p50["off"], "ratio": ratio,
            "failed": failed, "errors": errors,
            "on_ms": [t * 1000 for t in times["on"]], "off_ms": [t * 1000 for t in times["off"]]}


# ----------------------------------------------------------------- servers

def server_specs(setups: list[Setup], device: str, work: Path, python: str,
                 gpus: list[str] | None = None) -> dict[str, list[ServerSpec]]:
    """Each setup's producer and consumer command lines, on free ports; on
    cuda, on GPUs from `gpus` (gpu_plan: shared when there are fewer than
    the servers need)."""
    specs: dict[str, list[ServerSpec]] = {}
    plan, util = gpu_plan(setups, gpus or []) if device == "cuda" else ({}, None)
    for s in setups:
        for role, side in (("kv_producer", "producer"), ("kv_consumer", "consumer")):
            port = free_port_block(1)
            side_port = free_port_block(8)  # NIXL side channel: base port + rank
            # Mooncake: the producer's worker serves the bootstrap server on
            # this port (all interfaces); each producer has its own.
            bootstrap = free_port_block(1) if s.mode == "mooncake" and role == "kv_producer" else None
            if bootstrap is not None:
                s.bootstrap_port = bootstrap
            if role == "kv_consumer" and s.faults:
                s.control_path = work / f"{s.name}.faults.json"
                s.injections_path = work / f"{s.name}.injections.jsonl"
                s.injections_path.write_text("")
            if role == "kv_producer" and s.faults:
                s.producer_control_path = work / f"{s.name}.producer-faults.json"
                s.producer_injections_path = work / f"{s.name}.producer-injections.jsonl"
                s.producer_injections_path.write_text("")
            set_faults(s, None)
            consumer = role == "kv_consumer"
            # The ground truth of each transfer, where both sides run the
            # drill connector: what an output that differs from the reference
            # is judged by (explain_outputs).
            if s.faults and s.checksums:
                s.witness_paths[side] = work / f"{s.name}.{side}.witness.jsonl"
                s.witness_paths[side].write_text("")
            kv = kv_transfer_config(s, role, device,
                                    control_path=s.control_path if consumer else s.producer_control_path,
                                    injections_path=s.injections_path if consumer else s.producer_injections_path,
                                    witness_path=s.witness_paths.get(side))
            s.logs[side] = work / f"{s.name}.{side}.log"
            s.urls[side] = f"http://127.0.0.1:{port}"
            s.side_ports[side] = side_port
            specs.setdefault(s.name, []).append(ServerSpec(
                f"{s.name}-{side}", server_argv(python, s, role, port, device, kv,
                                                **({"gpu_memory_utilization": util} if util else {})),
                server_env(device, side_port, plan.get((s.name, side)), mode=s.mode, bootstrap_port=bootstrap)
                | {"PYTHONUNBUFFERED": "1"}, port, s.logs[side]))
    return specs


def start_proxy(group: ProcessGroup, setups: list[Setup], work: Path, python: str):
    port = free_port_block(1)
    pairs = [f"--pair={s.name}={s.urls['producer']},{s.urls['consumer']}" for s in setups]
    if any(s.mode == "push" for s in setups):
        # Both legs at once; the consumer leg carries the producer's NIXL
        # coordinates (proxy.py says why).
        pairs += ["--mode=push", *(f"--push-target={push_target(s)}" for s in setups)]
    elif any(s.mode == "mooncake" for s in setups):
        # Both legs at once with one transfer id; the proxy asks each
        # producer's bootstrap server for its engine id (proxy.py says why).
        pairs += ["--mode=mooncake", *(f"--bootstrap={mooncake_bootstrap(s)}" for s in setups)]
    return group.start(ServerSpec("proxy", [python, "-m", "kvcs_demo.proxy", "--port", str(port), *pairs],
                                  {"PYTHONPATH": str(ROOT / "scripts"), "PYTHONUNBUFFERED": "1"}, port,
                                  work / "proxy.log"))


def startup_lines(setup: Setup) -> dict[str, list[str]]:
    """Each server's startup log lines about KV checksums."""
    out = {}
    for side, path in setup.logs.items():
        text = path.read_text(errors="replace") if path.exists() else ""
        out[side] = [ln.split("] ", 1)[-1] for ln in text.splitlines()
                     if "KV checksums" in ln and ("enabled" in ln or "disabled" in ln or "not checksummed" in ln)]
    return out


# ----------------------------------------------------------------- report

def build_report(args, setups, results, hostile, ttft, startup, wall, errors=None) -> dict:
    report = {"command": " ".join(sys.argv), "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                                         "device": args.device},
              "wall_s": round(wall, 1), "mode": args.mode, "requests_per_phase": args.requests, "setups": []}
    failures = [f"{name}: {err}" for name, err in (errors or {}).items()]
    for s in setups:
        if s.checksums and s.name not in results:
            failures.append(f"{s.name}: no phase ran")
        if s.name not in results:
            continue
        ran = [ph.phase for ph in results[s.name]]
        if ran != ["clean", *args.kinds]:
            failures.append(f"{s.name}: phases {ran} ran, not every one of clean + {args.kinds}")
        entry = {"name": s.name, "model": str(s.model), "hybrid_kv_cache_manager": s.hybrid, "policy": s.policy,
                 "fail_closed": s.fail_closed, "producer_tp": s.producer_tp, "consumer_tp": s.consumer_tp,
                 "startup_log": startup.get(s.name, {}), "phases": []}
        for ph in results[s.name]:
            reqs = ph.requests
            if ph.alerts is not None:
                failures += [f"{s.name}/{ph.phase}/alerts: {p}" for p in ph.alerts["problems"]]
            entry["phases"].append({
                "phase": ph.phase,
                "alerts": ph.alerts,
                "requests": len(reqs),
                "metrics": ph.metrics,
                "false_mismatches": sum(r.verdict == "mismatch" and r.expected != "mismatch" for r in reqs),
                "outputs_equal": sum(bool(r.output_equal) for r in reqs),
                "outputs": sum(r.output_equal is not None for r in reqs),
                "http_errors": sum(r.status != 200 for r in reqs),
                "injections": [{"request_id": r.request_id, "kind": (r.injection or {}).get("kind"),
                                "group": (r.injection or {}).get("group"),
                                "positions": (r.injection or {}).get("positions"),
                                "block_ids": (r.injection or {}).get("block_ids"),
                                "skipped": (r.injection or {}).get("skipped"),
                                "expected": r.expected, "verdict": r.verdict, "reason": r.reason,
                                "reported": {str(g): p for g, p in r.reported.items()}, "status": r.status,
                                "output_equal": r.output_equal, "ok": r.ok, "problem": r.problem,
                                "where": r.where, "producer_recheck": r.producer_recheck,
                                "output": r.output, "reference": r.reference,
                                "output_class": r.output_class, "output_evidence": r.output_evidence,
                                "timings_ms": {k: round(v, 1) for k, v in r.timings.items()}}
                               for r in reqs],
            })
            failures += [f"{s.name}/{ph.phase}/{r.request_id}: {r.problem}" for r in reqs if not r.ok]
        if s.name in hostile:
            entry["hostile_client"] = hostile[s.name]
            failures += [f"{s.name}/hostile/{h['payload']}: verdict {h['verdict']}, status {h['status']}, next "
                         f"{h['next_request_status']}" for h in hostile[s.name] if not h["ok"]]
        report["setups"].append(entry)
    report["ttft"] = ttft
    if ttft is not None and ttft.get("failed"):
        # A pair that cannot serve is a failed run, not a missing figure (the
        # checksums-off baseline once died on every request unnoticed).
        failures += [f"TTFT {label}: {n} of {ttft['requests_each'] + 1} requests failed ({ttft['errors'][label]})"
                     for label, n in ttft["failed"].items() if n]
    report["failures"] = failures
    report["ok"] = not failures
    return report


# The table's short names of incident.where's answers.
WHERE_SHORT = {incident.CHANGED_ON_PRODUCER: "changed on P", incident.RELEASED_BEFORE_READ: "released on P",
               incident.INTACT_ON_PRODUCER: "intact on P", incident.NOT_RECHECKED: "P not re-checked",
               incident.UNKNOWN_ATTEMPT: "unknown (attempts)", incident.UNKNOWN_RELEASED: "unknown (released)",
               incident.WRONG_REQUEST: "another request's KV"}


def where_column(injections: list[dict]) -> str:
    """Where the phase's mismatches happened: "2 intact on P", or "-"."""
    counts: dict[str, int] = {}
    for i in injections:
        if i.get("verdict") == "mismatch":
            name = WHERE_SHORT.get(i.get("where"), i.get("where") or "no line")
            counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{n} {name}" for name, n in sorted(counts.items())) or "-"


def positions_text(positions: dict) -> str:
    """Block positions by KV cache group, as the table writes them: "g0:[1, 3] g1:[2]" ("-": none)."""
    return " ".join(f"g{g}:{sorted(p)}" for g, p in sorted(positions.items(), key=lambda gp: int(gp[0]))) or "-"


# Under the table: what each column says.
TABLE_LEGEND = (
    "reqs: requests in the phase. verif / mism / unver: the consumer's loads verified, mismatched, unverified in "
    "the phase (its vllm:kv_checksum_loads_*_total counters).",
    "detected: faults reported at exactly the injected positions / faults that must be detected (-: none injected "
    "that must be; change_tail must verify, drop_checksums must be unverified).",
    "false: mismatches where none was expected (must be 0).",
    "out=ref: outputs equal to the producer's own single-engine output / outputs returned (a failed check under "
    "policy fail returns none: 0/0; fail-open returns the output of the bad KV). A verified load whose output "
    "differs gets a line under its setup with its class: kv_differs (the bytes the consumer used are not the bytes "
    "the producer sent; \"outside the rows checked\": a change_tail that reached the prompt's KV), or "
    "kv_same_output_differs: numerics (the same bytes, and the producer's own output for the prompt changes with the "
    "batch: this CPU's arithmetic, not the KV).",
    "where: where each mismatch happened, from both servers' incident lines: \"intact on P\" (the producer's "
    "re-check found its KV as sent: the fault was on the way or on the consumer), \"changed on P\" (the KV changed "
    "on the producer before its transfer completed), \"released on P\" (read after the producer released it), "
    "\"P not re-checked\", \"unknown (attempts)\" / \"unknown (released)\" (the producer's logs cannot tell), "
    "\"another request's KV\".",
    "positions: gG:[block positions] of KV cache group G, as the consumer reported them / as the fault connector "
    "injected them.",
)


def print_table(report: dict) -> None:
    log("")
    log(f"{'setup':<16} {'phase':<17} {'reqs':>4} {'verif':>5} {'mism':>5} {'unver':>5} {'detected':>8} "
        f"{'false':>5} {'out=ref':>7}  {'where (P: producer)':<20} positions reported / injected")
    for s in report["setups"]:
        for ph in s["phases"]:
            m = ph["metrics"]

            def total(name):
                return counter_total(m, name)
            inj = ph["injections"]
            detectable = [i for i in inj if i["expected"] == "mismatch"]
            detected = sum(i["ok"] for i in detectable)
            pos = "; ".join(f"{positions_text(i['reported'])} / {positions_text({i['group']: i['positions']})}"
                            for i in detectable[:2])
            if ph["phase"] == "change_tail":
                pos = "tail changed, must verify"
            elif ph["phase"] == "drop_checksums":
                pos = "checksums dropped, must be unverified"
            log(f"{s['name']:<16} {ph['phase']:<17} {ph['requests']:>4} {total('loads_verified'):>5} "
                f"{total('loads_mismatched'):>5} {total('loads_unverified'):>5} "
                f"{(f'{detected}/{len(detectable)}' if detectable else '-'):>8} {ph['false_mismatches']:>5} "
                f"{ph['outputs_equal']}/{ph['outputs']:<5}  {where_column(inj):<20} {pos}")
        for ph in s["phases"]:
            for i in ph["injections"]:
                if i.get("output_class"):
                    log(f"{s['name']:<16} {ph['phase']:<17} output differs from the reference: {i['output_class']} "
                        f"({i['output_evidence']['why']})")
        for h in s.get("hostile_client", []):
            log(f"{s['name']:<16} {'hostile:' + h['payload']:<24} HTTP {h['status']}, {h['verdict']} ({h['reason']}), "
                f"next request HTTP {h['next_request_status']}")
    log("")
    for line in TABLE_LEGEND:
        log(line)
    log_ending(report, "through the proxy: prefill on the producer, KV transfer, first token on the consumer")


# ----------------------------------------------------------------- main

def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="make demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=1, help="requests per phase and setup (default 1)")
    p.add_argument("--kinds", default=None,
                   help="fault kinds, one phase each (default: all: " + ",".join(FAULT_KINDS) + "; with --mode "
                   "store: " + ",".join(STORE_FAULTS) + ")")
    p.add_argument("--model", type=Path, help="another model directory (default: the tiny Llama and Gemma-2)")
    p.add_argument("--setups", help="comma-separated setup names to run (default: all)")
    p.add_argument("--producer-tp", type=int, default=1, help="tensor parallel size of the producers (CPU)")
    p.add_argument("--mode", choices=(*MODES, "store"), default="pull",
                   help="connector mode (pull: NixlConnector, the consumer READs the KV after the producer answered; "
                        "push: NixlPushConnector, the consumer registers its blocks and the producer WRITEs into "
                        "them, the proxy sending both legs at once; mooncake: MooncakeConnector over TCP, both legs "
                        "at once with one transfer id, needs mooncake-transfer-engine(-non-cuda); push and "
                        "mooncake run no hostile client; store: no P/D, a Mooncake store with checksummed values and faults "
                        "injected into it, see kvcs_demo/store.py)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=os.environ.get("VLLM_DEVICE") or "cpu")
    p.add_argument("--gpus", help="cuda: comma-separated GPUs the servers may use, as CUDA_VISIBLE_DEVICES names them "
                   "(default: CUDA_VISIBLE_DEVICES, else every GPU nvidia-smi lists); servers are handed them in "
                   "turn and share them when there are fewer than the servers need")
    p.add_argument("--ttft-requests", type=int, default=None, help="TTFT requests each with checksums on and off "
                   "(default 20, 5 with --mode store; 0: skip the baseline pair)")
    p.add_argument("--no-hostile", action="store_true", help="skip the hostile-client requests")
    p.add_argument("--out", type=Path, default=ROOT / "build" / "demo", help="report and logs directory")
    p.add_argument("--python", default=sys.executable, help="the Python that runs the servers")
    p.add_argument("--alerts", action="store_true",
                   help="also run a real Prometheus (the `prometheus` binary: make setup installs it) scraping every "
                        "checked server with deploy/prometheus/kvchecksum-rules.yml loaded, and check its alerts "
                        "after the clean phase (none), the first mismatch, drop_checksums and producer_flip_bit "
                        "(docs/alerts.md)")
    args = p.parse_args(argv)
    if args.device not in ("cpu", "cuda"):  # a default from VLLM_DEVICE is not checked by argparse
        p.error(f"VLLM_DEVICE / --device must be cpu or cuda, got {args.device!r}")
    known = STORE_FAULTS if args.mode == "store" else FAULT_KINDS
    args.kinds = list(known) if args.kinds is None else [k for k in args.kinds.split(",") if k]
    unknown = set(args.kinds) - set(known)
    if unknown:
        p.error(f"unknown fault kinds {sorted(unknown)}; known: {', '.join(known)}")
    if args.ttft_requests is None:
        args.ttft_requests = 5 if args.mode == "store" else 20
    if args.mode == "store" and args.device != "cpu":
        p.error("--mode store runs on the CPU backend only")
    if args.requests < 1:
        p.error("--requests must be at least 1")
    if args.device == "cuda" and args.model is None:
        p.error("--device cuda needs --model (a model directory or name the GPU host has)")
    if args.gpus is not None:
        if args.device != "cuda":
            p.error("--gpus is for --device cuda")
        args.gpus = [g.strip() for g in args.gpus.split(",") if g.strip()]
        if not args.gpus:
            p.error("--gpus names no GPU")
    return args


def fitting_setups(setups: list[Setup], gpus: list[str], wanted: bool) -> list[Setup]:
    """The setups whose servers' tensor parallel ranks each get a GPU of their
    own from `gpus`. The default set leaves the others out, saying so; setups
    named with --setups that do not fit end the demo before any server starts."""
    too_big = [s for s in setups if max(s.producer_tp, s.consumer_tp) > len(gpus)]
    if not too_big:
        return setups
    need = max(max(s.producer_tp, s.consumer_tp) for s in too_big)
    what = (f"{', '.join(s.name for s in too_big)}: tensor parallel {need} needs {need} GPUs, and "
            f"{len(gpus)} {'is' if len(gpus) == 1 else 'are'} visible ({','.join(gpus)})")
    if wanted:
        raise SystemExit(f"setups {what}; choose others with --setups, or give more GPUs (--gpus, CUDA_VISIBLE_DEVICES)")
    log(f"left out {what}")
    return [s for s in setups if s not in too_big]


def choose_setups(args) -> list[Setup]:
    if args.device == "cuda":
        setups = gpu_setups(args.model)
        if args.ttft_requests <= 0:
            setups = [s for s in setups if s.checksums]
    else:
        models = {} if args.model else make_models(ROOT / "build")
        setups = cpu_setups(models, args.model, args.producer_tp, ttft=args.ttft_requests > 0)
    if args.setups:
        wanted = {name for name in args.setups.split(",") if name}
        names = {s.name for s in setups}
        if wanted - names:
            raise SystemExit(f"unknown setups {sorted(wanted - names)}; known: {', '.join(sorted(names))}")
        keep = wanted | ({"baseline-off"} if args.ttft_requests > 0 else set())
        setups = [s for s in setups if s.name in keep]
    if args.device == "cuda" and args.gpus:
        setups = fitting_setups(setups, args.gpus, wanted=bool(args.setups))
    for s in setups:
        s.mode = args.mode
    return setups


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.mode == "store":  # no P/D: a Mooncake store between two servers (store.py)
        from kvcs_demo.store import run as run_store
        return run_store(args)
    t0 = time.monotonic()
    if args.device == "cuda" and args.gpus is None:
        args.gpus = visible_gpus()
        if not args.gpus:
            raise SystemExit("--device cuda: no GPU found (CUDA_VISIBLE_DEVICES is not set and `nvidia-smi -L` lists "
                             "none, or there is no nvidia-smi); run it on a host with an NVIDIA GPU and its driver, "
                             "or name the GPUs with --gpus")
    setups = choose_setups(args)
    work = args.out
    work.mkdir(parents=True, exist_ok=True)
    # Only the demo's own files of an earlier run: --out may name any directory.
    for pattern in ("report.json", "process_groups.json", "*.log", "*.faults.json", "*.faults.tmp",
                    "*.injections.jsonl", "prometheus.yml"):
        for old in work.glob(pattern):
            if old.is_file():
                old.unlink()
    checked = [s for s in setups if s.checksums]
    if not checked:
        raise SystemExit("no setup with checksums on was chosen (--setups); nothing to show")
    results: dict[str, list[PhaseResult]] = {}
    hostile: dict[str, list[dict]] = {}
    ttft = None
    errors: dict[str, str] = {}
    # --alerts: fail before any server starts when Prometheus is missing.
    prometheus_bin = alerts.prometheus_binary() if args.alerts else None
    specs = server_specs(setups, args.device, work, args.python, args.gpus)
    off = next((s for s in setups if not s.checksums), None)
    with ProcessGroup() as group:
        servers = {s.name: [group.start(spec) for spec in specs[s.name]] for s in checked}
        proxy_server = start_proxy(group, setups, work, args.python)
        proxy = proxy_server.url
        log(f"started {2 * len(checked)} vLLM servers (`vllm serve`) and the proxy (logs in {work}); each setup "
            f"runs once its pair answers /health, which takes minutes on a small CPU machine")
        for s in checked:
            log(f"[{s.name}] producer {s.urls['producer']} and consumer {s.urls['consumer']}: {s.model.name}, "
                f"policy {s.policy} (logs {s.logs['producer'].name}, {s.logs['consumer'].name})")
        extra = [proxy_server]
        prometheus = None
        if prometheus_bin is not None:
            targets = {alerts.job_name(s.name, side): s.urls[side].split("//", 1)[1]
                       for s in checked for side in ("producer", "consumer")}
            prom_server = group.start(alerts.server_spec(prometheus_bin, work, free_port_block(1), targets))
            prometheus = alerts.Prometheus(prom_server.url)
            extra.append(prom_server)
            log(f"prometheus {prom_server.url} scrapes them every {alerts.INTERVAL} with "
                f"{alerts.RULES.relative_to(ROOT)} (config {work / 'prometheus.yml'})")
        first_up = threading.Event()
        threads = [threading.Thread(
            target=run_setup, name=s.name, args=(s, proxy, args.kinds, args.requests, results, errors),
            kwargs={"ready": lambda s=s: wait_ready(group, [*servers[s.name], *extra], s, t0, first_up),
                    "prometheus": prometheus})
            for s in checked]
        for t in threads:
            t.start()
        if off is not None:
            # The TTFT baseline is needed last: started once a checked pair is
            # up, so it does not slow their start on a small machine.
            while not first_up.wait(1.0) and any(t.is_alive() for t in threads):
                pass
            servers[off.name] = [group.start(spec) for spec in specs[off.name]]
        for t in threads:
            t.join()
        # Every process group the demo started, for checks that none outlives it.
        (work / "process_groups.json").write_text(json.dumps(
            {m.name: m.pgid for ms in servers.values() for m in ms} | {m.name: m.pgid for m in extra}))
        if args.mode == "push" and not args.no_hostile:
            # It forges kv_checksums in kv_transfer_params, the pull carrier;
            # push mode carries them in the WRITE's notification instead.
            log("hostile client: not run in push mode (its forged kv_checksums ride kv_transfer_params, which "
                "push mode does not carry checksums in)")
        elif args.mode == "mooncake" and not args.no_hostile:
            # The same: Mooncake carries them in the transfer's response.
            log("hostile client: not run in mooncake mode (its forged kv_checksums ride kv_transfer_params, which "
                "mooncake mode does not carry checksums in)")
        elif not args.no_hostile:
            target = next((s for s in checked if s.fail_closed and s.name not in errors), None)
            if target is not None:
                try:
                    hostile[target.name] = run_hostile(target, proxy)
                except Exception as exc:
                    errors[f"{target.name}/hostile"] = f"{type(exc).__name__}: {exc}"
        if off is not None:
            # Checksums on vs off on the same model and layout, and nothing
            # else running: the other pairs are stopped first.
            on = next((s for s in checked if (s.model, s.hybrid, s.producer_tp, s.consumer_tp)
                       == (off.model, off.hybrid, off.producer_tp, off.consumer_tp)), None)
            for s in checked:
                if s is not on:
                    for m in servers[s.name]:
                        group.stop(m)
            wait_ready(group, servers[off.name], off, t0)
            if on is not None and on.name not in errors:
                ttft = measure_ttft(on, off, proxy, args.ttft_requests)
            else:
                log("TTFT: no chosen setup matches the baseline's model and layout; not measured")
        startup = {s.name: startup_lines(s) for s in setups}
    report = build_report(args, setups, results, hostile, ttft, startup, time.monotonic() - t0, errors)
    (work / "report.json").write_text(json.dumps(report, indent=2))
    print_table(report)
    log(f"report: {work / 'report.json'}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
