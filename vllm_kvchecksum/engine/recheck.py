"""The producer's re-check: did its KV change before the transfer completed?

A producer sends the checksums of a request's prompt KV when the request
finishes; the connector then transfers the KV (the consumer reads it, or the
producer writes it out) while the producer holds the blocks. When the
connector reports the transfer complete, the scheduler has the same blocks
checksummed again, before it frees them, and `recheck` compares the two
sums. A block whose value changed was written while the transfer ran (a
kernel writing past its own blocks, a block freed and reused too early): the
consumer's check of that transfer fails, and the failure is the producer's.
Equal values say the producer's KV was intact when the transfer completed:
a mismatch on the consumer then happened in flight or on the consumer.

Imports no vLLM.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from vllm_kvchecksum.core.payload import KVChecksumPayload


class RecheckStatus(str, enum.Enum):
    INTACT = "intact"
    CHANGED = "changed"
    # Could not be compared (the reason says why); tells nothing.
    NOT_RECHECKED = "not_rechecked"


@dataclass(frozen=True)
class RecheckResult:
    status: RecheckStatus
    # CHANGED: the block positions whose values differ, per group.
    changed: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    reason: str = ""

    @property
    def num_changed_blocks(self) -> int:
        return sum(len(p) for p in self.changed.values())


def recheck(sent: KVChecksumPayload, again: KVChecksumPayload | None, why_not: str | None = None) -> RecheckResult:
    """Compare what was sent with the sums of the same blocks at the transfer's completion.

    `again`: sum_producer over the re-check's records, with the blocks and
    token count of the send (None: it could not be summed, `why_not` says
    why). Every group sent is compared; one the re-check lacks, or whose
    layers (fingerprint), block size or first block differ, makes the
    re-check not comparable rather than a change.
    """
    if again is None:
        return RecheckResult(RecheckStatus.NOT_RECHECKED, reason=why_not or "the re-check could not be summed")
    if again.num_tokens != sent.num_tokens:
        return RecheckResult(RecheckStatus.NOT_RECHECKED,
                             reason=f"re-checked {again.num_tokens} tokens, sent {sent.num_tokens}")
    changed: dict[int, tuple[int, ...]] = {}
    for group_id, before in sorted(sent.groups.items()):
        after = again.groups.get(group_id)
        if after is None:
            return RecheckResult(RecheckStatus.NOT_RECHECKED, reason=f"group {group_id} was not re-checked")
        if (after.fingerprint, after.block_size, after.start, after.num_blocks) != \
                (before.fingerprint, before.block_size, before.start, before.num_blocks):
            return RecheckResult(RecheckStatus.NOT_RECHECKED,
                                 reason=f"group {group_id} was re-checked over other layers or blocks")
        differ = np.flatnonzero(before.values != after.values)
        if differ.size:
            changed[group_id] = tuple(int(before.start + i) for i in differ)
    if changed:
        return RecheckResult(RecheckStatus.CHANGED, changed)
    return RecheckResult(RecheckStatus.INTACT)
