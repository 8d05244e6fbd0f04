"""What a KV checksum drill writes down: one JSON record per injection (or skipped one), the
verdict the checksums must give its load, and the operator's log line.

The records are the drill's ground truth for make demo; one whole line per write, so the
scheduler's and the workers' lines never interleave. Imports no vLLM.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import Any

from vllm_kvchecksum.drills import faults
from vllm_kvchecksum.drills.fault_settings import DROP_CHECKSUMS, LOGGER_NAME
from vllm_kvchecksum.engine.carrier import KV_TRANSFER_PARAMS_KEY

logger = logging.getLogger(LOGGER_NAME)

# Every JSON record has these keys (null where they do not apply).
_INJECTION_FIELDS = ("layer", "token", "head", "byte", "bit", "other_layer", "other_token", "other_head",
                     "source_block_id")
RECORD_FIELDS = ("time", "pid", "side", "request_id", "kind", "group", "positions", "block_ids", "expect",
                 "skipped", "tp_rank", "pp_rank", *_INJECTION_FIELDS)


# ----------------------------------------------------------------- records

def expect_of(kind: str, injection: faults.Injection | None, skipped: str | None) -> str:
    """The verdict the checksums must give the load.

    drop_checksums: "unverified" (no expected values). A detectable fault:
    "mismatch". change_tail (bytes past the prompt, no value's part) and
    anything undetectable or skipped (no fault): "verified".
    """
    if kind == DROP_CHECKSUMS:
        return "unverified"
    if skipped is None and injection is not None and injection.detectable:
        return "mismatch"
    return "verified"


def injection_record(*, request_id: str, kind: str, side: str, group: int | None = None,
                     injection: faults.Injection | None = None, skipped: str | None = None,
                     tp_rank: int | None = None, pp_rank: int | None = None, now: float = 0.0,
                     pid: int = 0) -> dict[str, Any]:
    """One JSON record of an injection (or of a skipped one): RECORD_FIELDS.

    Pure: the caller passes the time and pid.
    """
    record: dict[str, Any] = {
        "time": now, "pid": pid, "side": side, "request_id": request_id, "kind": kind, "group": group,
        "positions": list(injection.positions) if injection else [],
        "block_ids": list(injection.block_ids) if injection else [],
        "expect": expect_of(kind, injection, skipped), "skipped": skipped,
        "tp_rank": tp_rank, "pp_rank": pp_rank}
    for name in _INJECTION_FIELDS:
        record[name] = getattr(injection, name, None) if injection is not None else None
    return record


def describe_record(record: Mapping[str, Any]) -> str:
    """The operator's log line for a record."""
    rid, kind = record["request_id"], record["kind"]
    if record["skipped"] is not None:
        return f"KV checksum drill: skipped {kind} for request {rid}: {record['skipped']}"
    if kind == DROP_CHECKSUMS and record["side"] == "worker":
        return (f"KV checksum drill: injected {kind} into request {rid}: the workers dropped the KV checksums "
                f"their connector delivered with the load; expect {record['expect']}")
    if kind == DROP_CHECKSUMS:
        return (f"KV checksum drill: injected {kind} into request {rid}: removed {KV_TRANSFER_PARAMS_KEY!r} from "
                f"its kv_transfer_params; expect {record['expect']}")
    details = ", ".join(f"{name.replace('_', ' ')} {record[name]}" for name in _INJECTION_FIELDS
                        if record[name] is not None)
    return (f"KV checksum drill: injected {kind} into request {rid}: group {record['group']} block positions "
            f"{record['positions']}" + (f" ({details})" if details else "") + f"; expect {record['expect']}")


class _RecordLog:
    """Appends records to log_path, one JSON line each.

    One os.write of a whole line on an O_APPEND descriptor, so the lines of
    the scheduler and of every worker process do not interleave.
    """

    def __init__(self, path: str | None):
        self.path = path
        self._warned = False

    def write(self, record: Mapping[str, Any]) -> None:
        if self.path is None:
            return
        line = (json.dumps(record, sort_keys=True) + "\n").encode()
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
        except OSError as exc:
            if not self._warned:
                self._warned = True
                logger.warning("KV checksum drill: cannot append to log_path %s (%s); injections are only logged.",
                               self.path, exc)
