"""Incident lines: one structured log line per KV checksum mismatch, and where it happened.

A consumer's scheduler writes one JSON line per mismatched load at the
logger INCIDENT_LOGGER ("vllm.kv_checksum.incident"), after the prefix
INCIDENT_MARK, so it can be found in any server log whatever vLLM's log
format: the request, the producer's request and engine as the load named
them, the connector and carrier, both sides' TP size and block sizes, the
groups and block positions that differed.

`python -m vllm_kvchecksum.where` (where_main) joins a consumer's incident
lines with its producers' logs and says, per mismatched load, where the KV
went bad:
- "released before the read": the producer logged that a decode worker
  read KV of a request it had already released (vLLM NIXL's "Potentially
  invalid KV blocks for unrecognized request ... were retrieved", after a
  lease expiry). The producer's KV changed before the transfer completed.
- "producer not re-checked": nothing on the producer's side says it
  changed; the KV went bad on the producer after the checksums, on the
  wire or on the consumer (a re-check of the producer's blocks at transfer
  completion, to tell those apart, is not built yet).
- "offloaded": KV loaded back from an offloading tier (no producer).

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

RELEASED_BEFORE_READ = "released before the read"
NOT_RECHECKED = "producer not re-checked"
OFFLOADED = "offloaded"

logger = logging.getLogger(INCIDENT_LOGGER)

# vLLM NIXL's producer line for a read notification of a request it no longer holds.
_RELEASED = re.compile(r"Potentially invalid KV blocks for unrecognized request (\S+) were retrieved")


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


def incident_record(*, request_id: str, verdict: str, source: str, groups: Mapping[int, Iterable[int]],
                    remote_request_id: str | None, remote_engine_id: str | None, engine_id: str | None,
                    connector: str, carrier: str | None, tp_size: int, pp_size: int,
                    block_sizes: Mapping[int, int], producer_tp_size: int | None,
                    producer_block_sizes: Mapping[int, int] | None, now: float) -> dict[str, Any]:
    """One consumer incident: a JSON-able dict with a stable set of keys."""
    return {
        "side": "consumer", "time": now, "request_id": request_id, "verdict": verdict, "source": source,
        "remote_request_id": remote_request_id, "remote_engine_id": remote_engine_id, "engine_id": engine_id,
        "connector": connector, "carrier": carrier, "tp_size": tp_size, "pp_size": pp_size,
        "block_sizes": {str(g): int(b) for g, b in sorted(block_sizes.items())},
        "producer_tp_size": producer_tp_size,
        "producer_block_sizes": (None if producer_block_sizes is None
                                 else {str(g): int(b) for g, b in sorted(producer_block_sizes.items())}),
        "groups": {str(g): sorted(int(p) for p in positions)[:MAX_POSITIONS] for g, positions in sorted(groups.items())},
    }


def emit(record: Mapping[str, Any]) -> None:
    """Log one incident line (never raises: a line lost is better than an engine stopped)."""
    try:
        logger.error("%s%s", INCIDENT_MARK, json.dumps(record, sort_keys=True, separators=(",", ":")))
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
    """Request ids a producer's log says were read after it had released them."""
    return set(_RELEASED.findall(text))


def where(incident: Mapping[str, Any], released: set[str]) -> str:
    """Where one mismatched load's KV went bad, as far as the logs tell."""
    if incident.get("source") != "producer":
        return OFFLOADED
    remote = incident.get("remote_request_id")
    if isinstance(remote, str) and remote in released:
        return RELEASED_BEFORE_READ
    return NOT_RECHECKED


def attribute(consumer_logs: Iterable[str], producer_logs: Iterable[str]) -> list[tuple[dict[str, Any], str]]:
    """Every mismatch incident of the consumers' logs, with where it happened."""
    released: set[str] = set()
    for text in producer_logs:
        released |= released_requests(text)
    return [(incident, where(incident, released)) for text in consumer_logs for incident in read_incidents(text)
            if incident.get("verdict") == "mismatch"]


def where_main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_kvchecksum.where",
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
