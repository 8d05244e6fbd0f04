"""What the scheduler asks the workers to checksum, and what they report back.

These types cross the scheduler/worker boundary (inside SchedulerOutput and
KVConnectorOutput), so they are plain, picklable data with no vLLM types.

A consumer load's blocks cross once, in the step its load starts; each
worker keeps them until its own connector reports the load finished or the
scheduler tells it to forget the request (KVChecksumScheduled.reqs_to_forget).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from vllm_kvchecksum.core.host_copy import PendingHostCopy

# (replicas, replica_index): the TP replication of the layers a partial sum
# covers. Layers held by one rank only are (1, 0).
PartialKey = tuple[int, int]


@dataclass(frozen=True)
class GroupBlocks:
    """The blocks of one KV cache group to checksum for one request.

    `block_ids[i]` holds the request's block at position `start + i`, that
    is tokens [(start + i) * block_size, (start + i + 1) * block_size).
    """

    start: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class KVChecksumBlocks:
    """One request's blocks to checksum, per KV cache group id.

    Token slots at or past `num_tokens` (in the last block) are left out, so
    KV written later (decode, drafts) does not change the values.
    """

    num_tokens: int
    groups: dict[int, GroupBlocks]
    # A load of offloaded KV: checked against the entries stored with its
    # blocks (offload.py), not against a producer's checksums.
    offloaded: bool = False


@dataclass
class KVChecksumScheduled:
    """The scheduler's checksum requests for one step (in SchedulerOutput).

    reqs_to_send: producer requests whose prompt KV the step finishes;
    checksummed after the step's forward (and drafter).
    reqs_to_recv: consumer requests whose async load starts in the step,
    sent in that step only; each worker keeps them and checksums one in the
    step its own connector reports the load finished.
    reqs_to_forget: requests whose pending loads the workers must drop (the
    request ended, its load failed or was compared). Workers apply it before
    reqs_to_recv: a request id in both had its old load dropped before the
    new one started.
    reqs_loaded: synchronous loads of offloaded KV that the connector performs
    in this step (before the forward uses them); checksummed after the
    step's forward, like a finished load.
    reqs_to_recheck: producer requests whose transfer completed (the
    connector reported them finished sending) and whose blocks the scheduler
    holds until their KV is checksummed again and compared with what was
    sent; checksummed like a send.
    step: the scheduler's number for this step, so the update of its output
    judges this step's synchronous loads and re-checks (with a batch queue
    or PP several steps are in flight, and one request can load in two of
    them).
    tainted_blocks: the block ids whose KV failed its check (fail-open) and
    must never leave the instance with a valid checksum entry, when the set
    changed since the last step (None: unchanged); each worker keeps the last
    one (engine/export_guard.py).
    """

    reqs_to_send: dict[str, KVChecksumBlocks] = field(default_factory=dict)
    reqs_to_recv: dict[str, KVChecksumBlocks] = field(default_factory=dict)
    reqs_to_forget: set[str] = field(default_factory=set)
    reqs_loaded: dict[str, KVChecksumBlocks] = field(default_factory=dict)
    reqs_to_recheck: dict[str, KVChecksumBlocks] = field(default_factory=dict)
    step: int = 0
    tainted_blocks: frozenset[int] | None = None

    def is_empty(self) -> bool:
        return not (self.reqs_to_send or self.reqs_to_recv or self.reqs_to_forget or self.reqs_loaded
                    or self.reqs_to_recheck or self.tainted_blocks is not None)


@dataclass
class GroupChecksums:
    """A worker's partial checksums of one group's blocks for one request.

    `partials[key][i]` is the sum over this worker's layers with that
    replication of block position `start + i`. A producer worker whose
    layers are all non-zero replicas reports the group with no partials.
    """

    start: int
    num_blocks: int
    block_size: int
    partials: dict[PartialKey, np.ndarray]


class RecordPurpose:
    """What a record's checksums are for (KVChecksumRecord.purpose).

    One request can be a producer's send, an async load and a synchronous
    load in the same step (a P/D producer whose prompt starts with KV loaded
    back from an offloading tier); the worker says which, so the scheduler
    never gives one purpose's checksums to another.
    """

    SEND = "send"
    LOAD = "load"
    SYNC_LOAD = "sync_load"
    # A producer's KV checksummed again when its transfer completed.
    RECHECK = "recheck"


@dataclass
class KVChecksumRecord:
    """One worker's report for a step.

    Every request the worker was asked for appears in `requests`, with no
    groups if none of its layers is on this worker, so the scheduler can
    count which workers reported. `fingerprints` identify the worker's layers
    per group (summed over PP stages they identify the whole model's);
    `skipped_groups` lists the groups this worker cannot checksum, with the
    reason, so a skipped group is not mistaken for a partial sum.
    `received` holds checksum payloads a connector delivered to this worker
    (connector-owned carriers), by request id. `tp_local_groups` are the
    groups whose checksums depend on the TP size (state whose TP split the
    layers do not describe): comparable only between equal TP sizes.
    `stored` holds, for loads of offloaded KV, the entries the connector
    wrote back with each loaded block (per request, per group, one uint64
    per block position, tags included); `offload_groups` are the groups the
    worker keeps such entries for (fixed at startup). `purpose`: what the
    checksums in `requests` are for (RecordPurpose): a producer's send, a
    finished async load, or the step's synchronous loads.
    `read_after_release`: producer requests whose KV a consumer read after
    this worker's connector released the blocks (a lease that expired
    before the read; KVConnectorTransferResults.kv_read_after_release).
    """

    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    fingerprints: dict[int, int]
    skipped_groups: dict[int, str]
    requests: dict[str, dict[int, GroupChecksums]] = field(default_factory=dict)
    num_tokens: dict[str, int] = field(default_factory=dict)
    received: dict[str, bytes] = field(default_factory=dict)
    tp_local_groups: frozenset[int] = frozenset()
    stored: dict[str, dict[int, np.ndarray]] = field(default_factory=dict)
    offload_groups: frozenset[int] = frozenset()
    purpose: str = RecordPurpose.LOAD
    read_after_release: frozenset[str] = frozenset()

    @property
    def worker(self) -> tuple[int, int]:
        return (self.pp_rank, self.tp_rank)


class KVChecksumOutput:
    """Checksum records on their way from the workers to the scheduler.

    A worker's values may still be in flight from the device: `finalize`
    waits for their copy to host memory (the copy's own event, never the
    main stream), from any thread, and fills the records in. Pickling
    finalizes first, so the scheduler always receives plain values.
    """

    def __init__(self, records: list[KVChecksumRecord] | None = None,
                 pending: list[PendingHostCopy] | None = None):
        self._records = list(records or [])
        self._pending = list(pending or [])

    def finalize(self) -> list[KVChecksumRecord]:
        for copy in self._pending:
            copy.complete()
        self._pending = []
        return self._records

    def add_received(self, received: dict[str, bytes]) -> None:
        """Add payloads a connector delivered to this worker to its (first) record."""
        if received:
            self._records[0].received.update(received)

    @property
    def records(self) -> list[KVChecksumRecord]:
        return self.finalize()

    def is_empty(self) -> bool:
        return not self._records

    def __bool__(self) -> bool:
        return not self.is_empty()

    @staticmethod
    def aggregate(outputs: list[KVChecksumOutput | None]) -> KVChecksumOutput | None:
        """Concatenate the records of several workers (TP and PP ranks), or of
        one worker's several calls in a step. Copies still in flight stay in
        flight: nothing here waits for the device."""
        present = [o for o in outputs if o is not None and not o.is_empty()]
        if not present:
            return None
        return KVChecksumOutput([r for o in present for r in o._records],
                                [c for o in present for c in o._pending])

    def __getstate__(self):
        return {"records": self.finalize()}

    def __setstate__(self, state):
        self._records = state["records"]
        self._pending = []

    def __repr__(self) -> str:
        return f"KVChecksumOutput({len(self._records)} records, {len(self._pending)} pending)"
