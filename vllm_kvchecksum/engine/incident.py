"""Incident lines: one structured log line per KV checksum mismatch, and where it happened.

A consumer's scheduler writes one JSON line per mismatched load at the
logger INCIDENT_LOGGER ("vllm.kv_checksum.incident"), after the prefix
INCIDENT_MARK, so it can be found in any server log whatever vLLM's log
format: the request, the producer's request and engine as the load named
them, the connector and carrier, both sides' TP size and block sizes, the
groups and block positions that differed.

`python -m vllm_kvchecksum.engine.where` (where_main) joins a consumer's incident
lines with its producers' logs and says, per mismatched load, where the KV
went bad, from the evidence of the producer request the load names, on the
engine it names (ProducerEvidence, where):
- "changed on the producer: released before the read": the producer
  released the request's blocks while its transfer was still waiting, so the
  consumer read blocks that may hold another request's KV: the producer's
  own "read_after_release" line (NIXL pull), or, for NIXL push, vLLM NIXL's
  "Releasing expired KV blocks for request ..." (the producer's WRITE reads
  its blocks).
  NIXL's "Potentially invalid KV blocks for unrecognized request ... were
  retrieved" alone is no evidence: a consumer whose load failed its check
  sends one more notification for the request, after the producer freed it
  on the first.
- "changed on the producer before the transfer completed": the producer
  (kv_checksum_producer_recheck) checksummed the request's blocks again
  when the connector reported the transfer complete, before freeing them,
  and they differed from what it sent.
- "intact on the producer: in flight or on the consumer": that re-check
  found the KV as sent.
- "unknown: its blocks were released ...": a NIXL pull lease expiry with no
  read after the release logged (the read may have completed first), or an
  expiry in a log that does not say which engine wrote it.
- "unknown: the producer logs hold more than one attempt ...": a NIXL push
  load names its producer request by X-Request-Id alone, and the logs hold
  two attempts of it on that engine (a retry); or two re-checks of one id
  disagree. Another attempt's release or re-check is never taken.
- "producer not re-checked": no producer log says anything of it (none
  given, the re-check is off, or it could not compare).
- "offloaded": KV loaded back from an offloading tier (no producer).

A producer writes one line per re-check (producer_record, "side":
"producer"), at the same logger: ERROR when the KV changed, INFO otherwise;
and one ERROR line ("read_after_release") when its connector reports a
consumer's read of a request whose blocks it had already released. Both
name the producer's engine; NIXL's lease-expiry line does not, so it is
taken as the engine's whose "Initializing NIXL" line comes last before it
in its log (or the one engine the log's incident lines name).

Values from outside (the producer's ids come with kv_transfer_params from
the client) are cut to MAX_ID_CHARS and kept only as strings. Imports no
vLLM.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

INCIDENT_LOGGER = "vllm.kv_checksum.incident"
INCIDENT_MARK = "KV checksum incident: "
MAX_ID_CHARS = 200
# Block positions written per group; the error log line and the counters have the total.
MAX_POSITIONS = 256

# Both "changed on the producer" places start alike, so one grep finds them.
RELEASED_BEFORE_READ = "changed on the producer: released before the read"
CHANGED_ON_PRODUCER = "changed on the producer before the transfer completed"
INTACT_ON_PRODUCER = "intact on the producer: in flight or on the consumer"
NOT_RECHECKED = "producer not re-checked"
# The logs cannot tell: both start alike, so one grep finds them.
UNKNOWN_ATTEMPT = "unknown: the producer logs hold more than one attempt of this request"
UNKNOWN_RELEASED = "unknown: its blocks were released when the lease expired, and no log shows the read came after"
OFFLOADED = "offloaded"
# The producer's tokens differ from the consumer's request: the transfer paired
# it with another request (a shared request id, a misrouted load), whatever
# the producer's own logs say.
WRONG_REQUEST = "another request's KV: the producer's tokens differ"
# A producer line's verdict when a consumer read a request's KV after the
# connector released its blocks (not a re-check: the scheduler's
# _count_read_after_release).
READ_AFTER_RELEASE = "read_after_release"

logger = logging.getLogger(INCIDENT_LOGGER)

# vLLM NIXL's producer line when a request's lease runs out before every
# consumer worker reported its read done: the blocks are freed.
_RELEASED = re.compile(r"Releasing expired KV blocks for request (\S+) which were retrieved")


def outside_id(value: Any) -> str | None:
    """An id from outside (kv_transfer_params), as a bounded string, or None."""
    if not isinstance(value, str) or not value:
        return None
    return value[:MAX_ID_CHARS]


def remote_ids(kv_transfer_params: Mapping[str, Any] | None) -> tuple[str | None, str | None]:
    """(the producer's request id, its engine id) as a load's kv_transfer_params name them."""
    params = kv_transfer_params if isinstance(kv_transfer_params, Mapping) else {}
    request = outside_id(params.get("remote_request_id")) or outside_id(params.get("transfer_id"))
    return request, outside_id(params.get("remote_engine_id"))


def incident_record(*, request_id: str, verdict: str, source: str, cause: str | None = None,
                    groups: Mapping[int, Iterable[int]],
                    remote_request_id: str | None, remote_engine_id: str | None, engine_id: str | None,
                    connector: str, carrier: str | None, tp_size: int, pp_size: int,
                    block_sizes: Mapping[int, int], producer_tp_size: int | None,
                    producer_block_sizes: Mapping[int, int] | None, now: float) -> dict[str, Any]:
    """One consumer incident: a JSON-able dict with a stable set of keys."""
    return {
        "side": "consumer", "time": now, "request_id": request_id, "verdict": verdict, "source": source,
        "cause": cause,
        "remote_request_id": remote_request_id, "remote_engine_id": remote_engine_id, "engine_id": engine_id,
        "connector": connector, "carrier": carrier, "tp_size": tp_size, "pp_size": pp_size,
        "block_sizes": {str(g): int(b) for g, b in sorted(block_sizes.items())},
        "producer_tp_size": producer_tp_size,
        "producer_block_sizes": (None if producer_block_sizes is None
                                 else {str(g): int(b) for g, b in sorted(producer_block_sizes.items())}),
        "groups": {str(g): sorted(int(p) for p in positions)[:MAX_POSITIONS] for g, positions in sorted(groups.items())},
    }


def producer_record(*, request_id: str, transfer_id: str | None, result: str, groups: Mapping[int, Iterable[int]], engine_id: str | None,
                    connector: str, carrier: str | None, tp_size: int, pp_size: int,
                    block_sizes: Mapping[int, int], reason: str, now: float) -> dict[str, Any]:
    """One producer re-check at a transfer's completion (recheck.py): "intact", "changed" or "not_rechecked".

    transfer_id: the router's id of the transfer, when the request's
    kv_transfer_params carry one (Mooncake): its consumer names it so.
    """
    return {
        "side": "producer", "time": now, "request_id": request_id, "transfer_id": transfer_id,
        "verdict": result, "engine_id": engine_id,
        "connector": connector, "carrier": carrier, "tp_size": tp_size, "pp_size": pp_size,
        "block_sizes": {str(g): int(b) for g, b in sorted(block_sizes.items())}, "reason": reason,
        "groups": {str(g): sorted(int(p) for p in positions)[:MAX_POSITIONS] for g, positions in sorted(groups.items())},
    }


def emit(record: Mapping[str, Any]) -> None:
    """Log one incident line (never raises: a line lost is better than an engine stopped).

    ERROR for a mismatch or a changed producer KV, INFO for the others.
    """
    try:
        level = logging.ERROR if record.get("verdict") in ("mismatch", "changed", READ_AFTER_RELEASE) else logging.INFO
        logger.log(level, "%s%s", INCIDENT_MARK, json.dumps(record, sort_keys=True, separators=(",", ":")))
    except Exception:
        logger.exception("KV checksums: writing the incident line of request %r failed.",
                         record.get("request_id"))


def read_incidents(text: str) -> list[dict[str, Any]]:
    """The incident lines in a log's text (other lines, and lines that do not parse, are skipped)."""
    out = []
    for line in text.splitlines():
        at = line.find(INCIDENT_MARK)
        if at < 0:
            continue
        try:
            record = json.loads(line[at + len(INCIDENT_MARK):])
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


# vLLM ends each request id with "-" and 8 random hex digits
# (input_processor.assign_request_id); NIXL push pairs a producer's request
# with its consumer's by the id without them (nixl/utils.get_base_request_id),
# so a push consumer names no producer id a producer logs, only that pairing.
_RANDOM_SUFFIX = re.compile(r"-[0-9a-f]{8}$", re.IGNORECASE)

# vLLM NIXL's first line of an engine's connector, naming the engine id
# (kv_transfer_config engine_id): the lines after it, until the next one,
# are that engine's (a restarted producer appending to the same log).
_ENGINE_STARTS = re.compile(r"Initializing NIXL (?:worker|Scheduler) (\S+)")


def base_request_id(request_id: str) -> str:
    """A vLLM request id without its random suffix, as NIXL push pairs the two sides."""
    return _RANDOM_SUFFIX.sub("", request_id)


# Two re-checks under one key that disagree (a request id a client reused, a
# retry sent to the same producer): the join cannot tell which it was.
AMBIGUOUS = "ambiguous"


def _merge(out: dict[tuple[str, str | None], str], key: tuple[str, str | None], verdict: str) -> None:
    if out.get(key, verdict) != verdict:
        verdict = AMBIGUOUS
    out[key] = verdict


class ProducerEvidence:
    """What the producers' logs say of each of their requests, by (request id, engine id).

    rechecked: (id, engine) -> "intact" / "changed" / "not_rechecked" /
      AMBIGUOUS, under the request id and the transfer id of each re-check.
    read_after_release: (request id, engine) of the producer's
      "read_after_release" lines (its engine's own line of a read of
      released blocks).
    expired: (request id, engine) of vLLM NIXL's lease-expiry lines; engine
      None where the log does not say which engine wrote the line (no
      "Initializing NIXL" line before it and not exactly one engine named
      by the log's incident lines, or the log interleaves two engines).
    attempts: base id -> engine -> the producer request ids of that base
      the logs name: more than one is a retry under the same X-Request-Id,
      which NIXL push pairs with a consumer by the base alone.
    Indexed by id, so a join costs one lookup per mismatch, not a pass over
    the logs.
    """

    def __init__(self) -> None:
        self.rechecked: dict[tuple[str, str | None], str] = {}
        self.read_after_release: set[tuple[str, str | None]] = set()
        self.expired: set[tuple[str, str | None]] = set()
        self.attempts: dict[str, dict[str | None, set[str]]] = {}
        # Every id (request or transfer) a line names -> the engines of those lines.
        self._engines: dict[str, set[str | None]] = {}

    def add_log(self, text: str) -> None:
        """Take in one producer server's log."""
        current: str | None = None  # the engine whose "Initializing NIXL" line came last
        interleaved = False
        named: set[str | None] = set()
        expiries: list[tuple[str, str | None]] = []
        for line in text.splitlines():
            start = _ENGINE_STARTS.search(line)
            if start:
                current = start.group(1)[:MAX_ID_CHARS]
                continue
            expiry = _RELEASED.search(line)
            if expiry:
                expiries.append((expiry.group(1), current))
                continue
            for record in read_incidents(line):
                if record.get("side") != "producer" or not isinstance(record.get("request_id"), str):
                    continue
                engine = record.get("engine_id") if isinstance(record.get("engine_id"), str) else None
                named.add(engine)
                if current is not None and engine is not None and engine != current:
                    interleaved = True  # two engines' lines in one log: their order says nothing
                self._attempt(record["request_id"], engine)
                if record.get("verdict") == READ_AFTER_RELEASE:
                    self.read_after_release.add((record["request_id"], engine))
                    continue
                verdict = str(record.get("verdict"))
                for key in ("request_id", "transfer_id"):
                    if isinstance(record.get(key), str):
                        _merge(self.rechecked, (record[key], engine), verdict)
                        self._engines.setdefault(record[key], set()).add(engine)
        only = next(iter(named)) if len(named) == 1 else None
        for rid, engine in expiries:
            engine = None if interleaved else (engine if engine is not None else only)
            self.expired.add((rid, engine))
            self._attempt(rid, engine)

    def _attempt(self, rid: str, engine: str | None) -> None:
        self._engines.setdefault(rid, set()).add(engine)
        self.attempts.setdefault(base_request_id(rid), {}).setdefault(engine, set()).add(rid)

    def _engines_of(self, rid: str, engine: str | None) -> set[str | None]:
        """The engines of the lines naming `rid` that may be the named
        engine's: that engine (any, where the load names none), or none known."""
        return {e for e in self._engines.get(rid, ()) if e is None or _engine_is(e, engine)}

    def names(self, rid: str, engine: str | None) -> bool:
        """Whether some line names producer request (or transfer) `rid` of that
        engine, or of no known engine."""
        return bool(self._engines_of(rid, engine))

    def attempts_of(self, base: str, engine: str | None) -> set[str]:
        """The producer requests of that base id the logs name, of that engine
        (of any, where the load names none); a line of no known engine counts."""
        return {rid for e, rids in self.attempts.get(base, {}).items()
                if e is None or _engine_is(e, engine) for rid in rids}

    def recheck(self, rid: str, engine: str | None) -> str | None:
        """The re-check of `rid` by the named engine; where the load names no
        engine, the one re-check under that id of any engine."""
        if engine is not None:
            return self.rechecked.get((rid, engine))
        found = {self.rechecked[(rid, e)] for e in self._engines.get(rid, ()) if (rid, e) in self.rechecked}
        return found.pop() if len(found) == 1 else (AMBIGUOUS if found else None)

    def read_after(self, rid: str, engine: str | None) -> bool:
        return any((rid, e) in self.read_after_release for e in self._engines.get(rid, ()) if _engine_is(e, engine))

    def expiry(self, rid: str, engine: str | None) -> str | None:
        """"known": the named engine (any, where the load names none) let the
        lease of `rid` expire; "maybe": a line of no known engine did; None."""
        engines = {e for e in self._engines.get(rid, ()) if (rid, e) in self.expired}
        if any(e is not None and _engine_is(e, engine) for e in engines) or (engine is None and engines):
            return "known"
        return "maybe" if None in engines else None


def _engine_is(line_engine: str | None, load_engine: str | None) -> bool:
    """A line of `line_engine` is of the engine a load names (any, where it names none)."""
    return load_engine is None or line_engine == load_engine


def producer_evidence(producer_logs: Iterable[str]) -> ProducerEvidence:
    evidence = ProducerEvidence()
    for text in producer_logs:
        evidence.add_log(text)
    return evidence


def where(incident: Mapping[str, Any], evidence: ProducerEvidence | None = None) -> str:
    """Where one mismatched load's KV went bad, from the evidence of the
    producer request it names (its engine and attempt), as far as the logs tell.

    The load names its producer request by id (NIXL pull, a Mooncake
    transfer id) or, for NIXL push, by X-Request-Id only (the base id): then
    the logs must hold exactly one attempt of that base on that engine,
    else which one was this load's is unknown. Then, of that request:
    - a read after the release (the producer's own line) comes first: its
      re-check at the lease expiry ran before the read and found the KV
      intact, yet the consumer read blocks already given to another request;
    - NIXL's lease-expiry line: for push (the producer's WRITE read the
      blocks), released before the read; for pull, no read after the
      release is logged, so the read may have completed first: unknown,
      unless the re-check found the KV changed;
    - else the re-check's result, or "producer not re-checked".
    """
    if incident.get("source") != "producer":
        return OFFLOADED
    if incident.get("cause") == "wrong_request":
        return WRONG_REQUEST
    remote = incident.get("remote_request_id")
    if not isinstance(remote, str):
        return NOT_RECHECKED
    evidence = evidence or ProducerEvidence()
    # The consumer names the producer's engine when its connector does.
    engine = incident.get("remote_engine_id") if isinstance(incident.get("remote_engine_id"), str) else None
    own = incident.get("request_id")
    rid, by_base = remote, False
    if not evidence.names(remote, engine):
        # A connector-owned carrier (NIXL push) may pair the two sides by the
        # requests' base id; pull names the producer's own id.
        if incident.get("carrier") != "connector" or not isinstance(own, str):
            return NOT_RECHECKED
        attempts = evidence.attempts_of(base_request_id(own), engine)
        if len(attempts) > 1:
            return UNKNOWN_ATTEMPT
        if not attempts:
            return NOT_RECHECKED
        [rid], by_base = attempts, True
    if evidence.read_after(rid, engine):
        return RELEASED_BEFORE_READ
    result = evidence.recheck(rid, engine)
    expiry = evidence.expiry(rid, engine)
    if expiry == "known" and by_base:
        return RELEASED_BEFORE_READ
    if result == "changed":
        return CHANGED_ON_PRODUCER
    if expiry is not None:
        return UNKNOWN_RELEASED
    if result == "intact":
        return INTACT_ON_PRODUCER
    if result == AMBIGUOUS:
        return UNKNOWN_ATTEMPT
    return NOT_RECHECKED


def attribute(consumer_logs: Iterable[str], producer_logs: Iterable[str]) -> list[tuple[dict[str, Any], str]]:
    """Every mismatch incident of the consumers' logs, with where it happened."""
    evidence = producer_evidence(producer_logs)
    return [(incident, where(incident, evidence)) for text in consumer_logs
            for incident in read_incidents(text)
            if incident.get("side", "consumer") == "consumer" and incident.get("verdict") == "mismatch"]


def where_main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_kvchecksum.engine.where",
                                description="Where each KV checksum mismatch happened, from the servers' logs.")
    p.add_argument("--consumer", type=Path, action="append", required=True, help="a consumer server's log")
    p.add_argument("--producer", type=Path, action="append", default=[], help="a producer server's log")
    p.add_argument("--json", action="store_true", help="one JSON object per mismatch instead of the table")
    args = p.parse_args(argv)
    rows = attribute((f.read_text(errors="replace") for f in args.consumer),
                     (f.read_text(errors="replace") for f in args.producer))
    for incident, place in rows:
        if args.json:
            print(json.dumps({"where": place, **incident}, sort_keys=True))
        else:
            groups = "; ".join(f"group {g} blocks {p}" for g, p in incident.get("groups", {}).items())
            print(f"{incident.get('request_id')}  {place}  (producer request {incident.get('remote_request_id')}, "
                  f"{groups})")
    if not args.json:
        counts: dict[str, int] = {}
        for _, place in rows:
            counts[place] = counts.get(place, 0) + 1
        print(f"{len(rows)} mismatches: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    return 0


if __name__ == "__main__":
    sys.exit(where_main())
