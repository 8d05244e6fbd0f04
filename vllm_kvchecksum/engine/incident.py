"""Incident lines: one structured log line per KV checksum mismatch, and where it happened.

A consumer's scheduler writes one JSON line per mismatched load at the
logger INCIDENT_LOGGER ("vllm.kv_checksum.incident"), after the prefix
INCIDENT_MARK, so it can be found in any server log whatever vLLM's log
format: the request, the producer's request and engine as the load named
them, the connector and carrier, both sides' TP size and block sizes, the
groups and block positions that differed.

`python -m vllm_kvchecksum.engine.where` (where_main) joins a consumer's incident
lines with its producers' logs and says, per mismatched load, where the KV
went bad:
- "changed on the producer: released before the read": the producer
  released the request's blocks while its transfer was still waiting
  (vLLM NIXL's "Releasing expired KV blocks for request ...": its lease ran
  out, or the producer's "read_after_release" line), so the consumer read
  blocks that may hold another request's KV.
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
- "producer not re-checked": no producer log says either (none given, the
  re-check is off, or it could not compare).
- "offloaded": KV loaded back from an offloading tier (no producer).

A producer writes one line per re-check (producer_record, "side":
"producer"), at the same logger: ERROR when the KV changed, INFO otherwise;
and one ERROR line ("read_after_release") when its connector reports a
consumer's read of a request whose blocks it had already released, which
the join takes as it takes NIXL's lease-expiry line.

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


def released_requests(text: str) -> set[str]:
    """Request ids whose blocks a producer's log says it released before their transfer completed:
    NIXL's lease-expiry line, or this package's line for a read after the release."""
    return set(_RELEASED.findall(text)) | {
        record["request_id"] for record in read_incidents(text)
        if record.get("side") == "producer" and record.get("verdict") == READ_AFTER_RELEASE
        and isinstance(record.get("request_id"), str)}


# vLLM ends each request id with "-" and 8 random hex digits
# (input_processor.assign_request_id); NIXL push pairs a producer's request
# with its consumer's by the id without them (nixl/utils.get_base_request_id),
# so a push consumer names no producer id a producer logs, only that pairing.
_RANDOM_SUFFIX = re.compile(r"-[0-9a-f]{8}$", re.IGNORECASE)
# Marks a base id among the keys of `rechecks` (never part of a request id).
_BASE = "\x00base:"


def base_request_id(request_id: str) -> str:
    """A vLLM request id without its random suffix, as NIXL push pairs the two sides."""
    return _RANDOM_SUFFIX.sub("", request_id)


def rechecks(text: str) -> dict[tuple[str, str | None], str]:
    """A producer log's re-checks: (id, engine id) -> "intact" / "changed" / "not_rechecked".

    Each is keyed by its request id, its transfer id, and its request id's
    base (NIXL push's pairing, marked so it never equals an id).
    """
    out = {}
    for record in read_incidents(text):
        if record.get("side") != "producer" or record.get("verdict") == READ_AFTER_RELEASE:
            continue
        verdict, engine = str(record.get("verdict")), record.get("engine_id")
        for key in ("request_id", "transfer_id"):
            if isinstance(record.get(key), str):
                _merge(out, (record[key], engine), verdict)
        if isinstance(record.get("request_id"), str):
            _merge(out, (_BASE + base_request_id(record["request_id"]), engine), verdict)
    return out


# Two re-checks under one key that disagree (a request id a client reused, a
# retry sent to the same producer): the join cannot tell which it was.
AMBIGUOUS = "ambiguous"


def _merge(out: dict[tuple[str, str | None], str], key: tuple[str, str | None], verdict: str) -> None:
    if out.get(key, verdict) != verdict:
        verdict = AMBIGUOUS
    out[key] = verdict


def _recheck_of(rechecked: Mapping[tuple[str, str | None], str], key: str, engine: Any) -> str | None:
    """The re-check logged under `key`: the named engine's; only where the load
    names no engine, the one re-check under that key of any engine."""
    if engine is not None:
        return rechecked.get((key, engine))
    matches = {v for (rid, _), v in rechecked.items() if rid == key}
    return matches.pop() if len(matches) == 1 else None


def where(incident: Mapping[str, Any], released: set[str],
          rechecked: Mapping[tuple[str, str | None], str] | None = None) -> str:
    """Where one mismatched load's KV went bad, as far as the logs tell.

    A read after the release comes first: the producer's re-check at a lease
    expiry ran before the read and finds the KV intact, yet the consumer read
    blocks already given to another request.
    """
    if incident.get("source") != "producer":
        return OFFLOADED
    if incident.get("cause") == "wrong_request":
        return WRONG_REQUEST
    remote = incident.get("remote_request_id")
    if not isinstance(remote, str):
        return NOT_RECHECKED
    own = incident.get("request_id")
    # A connector-owned carrier (NIXL push, Mooncake) may pair the two sides
    # by the requests' base id (NIXL push does); pull names the producer's id.
    paired_by_base = incident.get("carrier") == "connector" and isinstance(own, str)
    if remote in released or (paired_by_base and base_request_id(own) in {base_request_id(r) for r in released}):
        return RELEASED_BEFORE_READ
    rechecked = rechecked or {}
    # The consumer names the producer's engine when its connector does.
    engine = incident.get("remote_engine_id")
    result = _recheck_of(rechecked, remote, engine)
    if result is None and paired_by_base:
        result = _recheck_of(rechecked, _BASE + base_request_id(own), engine)
    if result == "changed":
        return CHANGED_ON_PRODUCER
    if result == "intact":
        return INTACT_ON_PRODUCER
    return NOT_RECHECKED


def attribute(consumer_logs: Iterable[str], producer_logs: Iterable[str]) -> list[tuple[dict[str, Any], str]]:
    """Every mismatch incident of the consumers' logs, with where it happened."""
    released: set[str] = set()
    rechecked: dict[tuple[str, str | None], str] = {}
    for text in producer_logs:
        released |= released_requests(text)
        for key, verdict in rechecks(text).items():
            _merge(rechecked, key, verdict)
    return [(incident, where(incident, released, rechecked)) for text in consumer_logs
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
