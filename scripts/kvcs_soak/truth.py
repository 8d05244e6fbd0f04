"""What the soak concludes: ground truth against verdicts, and counters that must reconcile.

Pure functions over what the run left behind (the drill connectors' witness
lines, the consumer's log, /metrics deltas), so each rule is unit-tested
(tests/demo/test_soak_truth.py). The ground truth is kv_witness's: a load is
a victim when the bytes it received differ from what its producer sent at
some block position both digested; clean when every position agrees;
unknown when its producer's digests are missing (e.g. the producer was
killed before it wrote them) or do not cover every block (and KV head) it
loaded. Each TP rank digests its own KV heads by global head number, so the
two sides' TP sizes may differ; a Mamba state shard is compared only
between equal TP sizes.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvcs_demo.demo import LOAD_COUNTERS as LOAD_VERDICTS
from kvcs_demo.demo import counter_total

from vllm_kvchecksum.drills.kv_witness import differing_positions

_MISMATCH_LINE = re.compile(r"KV checksum mismatch for request '([^']*)'")
_CLIENT_INDEX = re.compile(r"soak-(\d+)(?:-|$)")


def read_lines(path: Path) -> list[dict]:
    """JSON lines of a witness file; a torn last line (a killed process) is skipped."""
    out = []
    if not path.exists():
        return out
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def client_index(request_id: str) -> int | None:
    """The soak client a server's request id comes from (X-Request-Id soak-N,
    which vLLM wraps as cmpl-soak-N-...), or None."""
    m = _CLIENT_INDEX.search(request_id)
    return int(m.group(1)) if m else None


def mismatched_requests(log_text: str) -> set[str]:
    """The consumer requests its scheduler logged a KV checksum mismatch for."""
    return set(_MISMATCH_LINE.findall(log_text))


@dataclass
class LoadTruth:
    request_id: str
    truth: str  # "victim", "clean", "unknown" or "load_failed"
    positions: dict[str, list[int]] = field(default_factory=dict)  # group -> differing block positions
    verdict: str = "verified_or_other"  # "mismatch" when the consumer logged one
    remote_request_id: str | None = None  # the producer's request, where the load was paired with it
    # Its request ended before the connector reported the load finished, so
    # the checksum scheduler never judged it (the drill's "request_ended"
    # line with load_finished false): the load's own evidence, the only one
    # that excuses a victim no mismatch was reported for.
    ended_unjudged: bool = False


def _merged(lines: Iterable[dict], side: str) -> dict[tuple[str, int], dict]:
    """One producer send or consumer load per (request id, occurrence), merged over the TP ranks that
    digested it (each writes its own line, of its own heads): group -> key -> [digests], in the order
    the witness file lists them. The k-th line of a request on each rank is its k-th occurrence."""
    seen: Counter = Counter()
    out: dict[tuple[str, int], dict] = {}
    for line in lines:
        if line.get("side") != side:
            continue
        rid = line["request_id"]
        k = seen[(rid, line.get("tp_rank", 0))]
        seen[(rid, line.get("tp_rank", 0))] += 1
        merged = out.setdefault((rid, k), {**line, "digests": {}})
        for group, digests in (line.get("digests") or {}).items():
            for key, digest in digests.items():
                merged["digests"].setdefault(group, {}).setdefault(str(key), []).append(digest)
    return out


def _state_shard(key: str) -> str | None:
    """The TP size of a Mamba state key ("position:tpSIZE.RANK"), else None."""
    part = key.split(":", 1)[1] if ":" in key else ""
    return part.split(".", 1)[0] if part.startswith("tp") else None


def judge_loads(sends: Iterable[dict], loads: Iterable[dict], mismatched: set[str]) -> list[LoadTruth]:
    """Each consumer load (a "load" or "load_failed" witness line) with its truth and verdict."""
    sent = {}
    for (rid, _), s in _merged(sends, "send").items():
        # A request sent twice (recomputed after a preemption): the last prompt digests count.
        sent[rid] = {**s, "digests": {g: {k: v[-1] for k, v in d.items()} for g, d in s["digests"].items()}}
    # Push and Mooncake loads do not name the producer's request id: their
    # kv_transfer_params come from the proxy. Both legs carry the client's
    # X-Request-Id (soak-N), so the client pairs them.
    by_client = {client_index(rid): s for rid, s in sent.items() if client_index(rid) is not None}
    loads = list(loads)
    # A load the connector reported failed (a "load_failed" line, also after
    # its digests when the connector named its bad blocks) was never used.
    failed = {load["request_id"] for load in loads if load.get("side") == "load_failed"}
    # A request that ended with its load still in flight; one whose load was
    # reported finished first was judged (verified, mismatched or unverified).
    ended_unjudged = {line.get("request_id") for line in loads if line.get("side") == "scheduler"
                      and line.get("event") == "request_ended" and line.get("load_finished") is False}
    out = []
    for (rid, _), line in _merged(loads, "load_failed").items():
        out.append(LoadTruth(rid, "load_failed", verdict="mismatch" if rid in mismatched else "verified_or_other"))
    for (rid, _), load in _merged(loads, "load").items():
        verdict = "mismatch" if rid in mismatched else "verified_or_other"
        if rid in failed:
            continue
        producer = sent.get(load.get("remote_request_id")) or by_client.get(client_index(rid))
        if producer is None:
            out.append(LoadTruth(rid, "unknown", verdict=verdict))
            continue
        positions, sent_digests = {}, producer.get("digests", {})
        judged = {}
        for group, digests in load["digests"].items():
            theirs = sent_digests.get(group, {})
            shards = {_state_shard(k) for k in theirs}
            # A Mamba state shard of another TP size holds other bytes: not comparable, not judged.
            judged[group] = {k: v for k, v in digests.items() if _state_shard(k) is None or _state_shard(k) in shards}
        if any(k not in sent_digests.get(group, {}) for group, digests in judged.items() for k in digests):
            # A block (or head) the producer did not digest: the load is not
            # judged on a part of what it received.
            out.append(LoadTruth(rid, "unknown", verdict=verdict))
            continue
        for group, digests in judged.items():
            differ = differing_positions(sent_digests.get(group, {}), digests)
            if differ:
                positions[group] = differ
        out.append(LoadTruth(rid, "victim" if positions else "clean", positions, verdict, producer.get("request_id"),
                             ended_unjudged=rid in ended_unjudged))
    return out


def detection(truths: list[LoadTruth], hung_up: set[int] | None = frozenset()) -> dict:
    """The soak's headline: victims caught, false alarms among clean loads.

    A victim that is no mismatch is missed, unless its own line says its
    request ended before its load was judged (LoadTruth.ended_unjudged):
    nobody used that KV (vLLM caches a loaded block only for a request still
    there). A victim the consumer judged (verified it, or left it
    unverified) is missed whenever its client hung up: no count of other
    loads excuses it. hung_up: the clients that hung up; a victim is excused
    only if its client is among them. None: the loads name no client
    (vLLM's toy proxy), so only the load's own line counts.
    """
    counts = Counter(t.truth for t in truths)
    victims = [t for t in truths if t.truth == "victim"]
    unjudged = [t for t in victims if t.verdict != "mismatch"]
    excused = [t.request_id for t in unjudged
               if t.ended_unjudged and (hung_up is None or client_index(t.request_id) in hung_up)]
    missed = [t.request_id for t in unjudged if t.request_id not in excused]
    false_alarms = [t.request_id for t in truths if t.truth == "clean" and t.verdict == "mismatch"]
    return {"loads": len(truths), **{k: counts.get(k, 0) for k in ("victim", "clean", "unknown", "load_failed")},
            "victims_caught": len(victims) - len(unjudged), "victims_ended_unjudged": excused,
            "victims_missed": missed, "false_alarms": false_alarms}


def reconcile_consumer(delta: Mapping[str, int], loads_started: int) -> dict:
    """loads started (the drill's scheduler lines) = verified + mismatched + unverified + not compared."""
    judged = {name: counter_total(delta, name) for name in LOAD_VERDICTS}
    return {"loads_started": loads_started, **judged, "difference": loads_started - sum(judged.values())}


def reconcile_producer(delta: Mapping[str, int], finished: int) -> dict:
    """finished producer requests (vLLM's request_success_total) = sent + not sent."""
    sent = delta.get("sent", 0)
    not_sent = counter_total(delta, "not_sent")
    return {"finished": finished, "sent": sent, "not_sent": not_sent, "difference": finished - sent - not_sent}
