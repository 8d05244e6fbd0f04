"""What comparing a load concludes, and how it reads: the verdict of each KV cache group and of
the whole load, the reasons a comparison could not be made, and the operator's line.

The comparison (compare.py, offload's) builds these; the scheduler glue turns them into log lines,
failed loads, client errors and the counters (metrics.py labels by UnverifiedReason).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field


class CheckStatus(str, enum.Enum):
    """The outcome of comparing one group, or a whole load."""

    VERIFIED = "verified"
    MISMATCH = "mismatch"
    UNVERIFIED = "unverified"


class UnverifiedReason(str, enum.Enum):
    """Why a group or a load could not be compared.

    The values are short and stable, so the glue can log a warning once per
    reason and count them.
    """

    # The whole load.
    NO_PRODUCER_CHECKSUMS = "no_producer_checksums"  # none sent, or invalid
    PAYLOAD_VERSION = "payload_version"  # sent by a producer of another payload version
    DUPLICATE_REQUEST_ID = "duplicate_request_id"  # NIXL push: another live load shares its X-Request-Id
    MISSING_WORKERS = "missing_workers"  # not every TP x PP worker reported
    UNSCHEDULED_BLOCKS = "unscheduled_blocks"  # a worker checksummed other blocks
    MALFORMED_RECORD = "malformed_record"  # a record contradicts itself or others
    NO_GROUPS = "no_groups"  # every group skipped on both sides
    TP_SIZES_DIFFER = "tp_sizes_differ"  # only TP-dependent groups, and the TP sizes differ
    PRODUCER_TP_SIZE_DIFFERS = "producer_tp_size_differs"  # the payload's, from the connector's
    COMPARISON_ERROR = "comparison_error"  # comparing raised (a bug); set by the scheduler glue
    # One group.
    NOT_CHECKSUMMED_BY_PRODUCER = "not_checksummed_by_producer"
    NOT_CHECKSUMMED_BY_CONSUMER = "not_checksummed_by_consumer"
    SKIPPED_BY_CONSUMER = "skipped_by_consumer"
    FINGERPRINT_DIFFERS = "fingerprint_differs"
    MISSING_REPLICA = "missing_replica"
    BLOCK_SIZES_NOT_MULTIPLES = "block_sizes_not_multiples"
    UNALIGNED_FIRST_BLOCK = "unaligned_first_block"
    NO_COMMON_BLOCKS = "no_common_blocks"
    NOT_COVERED_BY_PRODUCER = "not_covered_by_producer"  # some loaded blocks have no producer value
    NOT_BOUND = "not_bound"  # the payload names no request content (binding.py)
    # One group of an offloaded load (offload.py).
    NOT_STORED = "not_stored"  # some workers store no checksums of the group
    NO_BLOCK_HASHES = "no_block_hashes"  # the request lacks hashes of loaded blocks


@dataclass(frozen=True)
class GroupVerdict:
    """The comparison of one KV cache group.

    mismatched_blocks: consumer block positions whose values differ (all
      consumer blocks of a differing chunk when the block sizes differ).
    compared_blocks: how many consumer blocks were compared.
    reason_key / reason: why an unverified group could not be compared.
    foreign_blocks: of mismatched_blocks, those holding another request's
      KV: the producer's tokens differ from this request's from
      foreign_from_token on (the first differing run of its binding ends at
      foreign_to_token). The rest of mismatched_blocks are corrupt.
    """

    group_id: int
    status: CheckStatus
    mismatched_blocks: tuple[int, ...] = ()
    compared_blocks: int = 0
    reason_key: UnverifiedReason | None = None
    reason: str = ""
    foreign_blocks: tuple[int, ...] = ()
    foreign_from_token: int | None = None
    foreign_to_token: int | None = None


@dataclass(frozen=True)
class LoadVerdict:
    """The comparison of one request's KV load.

    status: MISMATCH if any group differs, even when others are unverified;
      otherwise UNVERIFIED if the load or any group could not be compared;
      otherwise VERIFIED.
    groups: per group id; groups skipped on both sides are absent.
    reason_key / reason: set when the load as a whole could not be compared
      (then `groups` is empty).
    left_out_tp: groups left out because their checksums depend on the TP
      size (state without a known TP split) and the sizes differ.
    source: where the reference came from: "producer" (P/D) or "offloaded"
      (the checksums stored with offloaded KV).
    """

    req_id: str
    status: CheckStatus
    groups: dict[int, GroupVerdict] = field(default_factory=dict)
    reason_key: UnverifiedReason | None = None
    reason: str = ""
    left_out_tp: tuple[int, ...] = ()
    source: str = "producer"

    @property
    def reason_keys(self) -> tuple[UnverifiedReason, ...]:
        """Every distinct reason this load or its groups are unverified."""
        keys = [self.reason_key] + [g.reason_key for g in self.groups.values()]
        return tuple(dict.fromkeys(k for k in keys if k is not None))

    @property
    def wrong_request(self) -> bool:
        """Whether the load holds another request's KV (its producer's tokens differ)."""
        return any(g.foreign_blocks for g in self.groups.values())

    @property
    def cause(self) -> str | None:
        """A mismatch's cause: "wrong_request" (another request's KV, whatever else is
        wrong) or "corrupt" (this request's KV, changed); None when no mismatch."""
        if self.status is not CheckStatus.MISMATCH:
            return None
        return "wrong_request" if self.wrong_request else "corrupt"

    @property
    def mismatched_blocks(self) -> dict[int, tuple[int, ...]]:
        """Consumer block positions that differ, per mismatching group."""
        return {g.group_id: g.mismatched_blocks for g in self.groups.values()
                if g.status is CheckStatus.MISMATCH}

    def describe(self) -> str:
        """An operator-facing line naming the request, groups and block positions."""
        headline = {
            CheckStatus.VERIFIED: f"KV checksums of request {self.req_id!r} verified",
            CheckStatus.MISMATCH: (f"KV checksum mismatch for request {self.req_id!r}: another request's KV"
                                   if self.wrong_request else f"KV checksum mismatch for request {self.req_id!r}"),
            CheckStatus.UNVERIFIED: f"KV checksums of request {self.req_id!r} unverified",
        }[self.status]
        if self.source != "producer":
            # An operator must tell a store's bad value from a P/D transfer's.
            headline += f" ({self.source} KV loaded back)"
        if self.reason_key is not None:
            return f"{headline}: {self.reason}"
        ordered = sorted(self.groups.values(),
                         key=lambda g: (g.status is not CheckStatus.MISMATCH, g.group_id))
        return f"{headline}: " + "; ".join(_describe_group(g) for g in ordered)


def _describe_group(verdict: GroupVerdict) -> str:
    name = f"group {verdict.group_id}"
    if verdict.status is CheckStatus.VERIFIED:
        return f"{name} verified ({verdict.compared_blocks} blocks compared)"
    if verdict.foreign_blocks:
        corrupt = sorted(set(verdict.mismatched_blocks) - set(verdict.foreign_blocks))
        text = (f"{name} holds another request's KV at block positions "
                f"{format_positions(verdict.foreign_blocks)} (the producer's tokens differ from this "
                f"request's in tokens [{verdict.foreign_from_token}, {verdict.foreign_to_token}))")
        if corrupt:
            text += f", and differs at block positions {format_positions(corrupt)}"
        return text
    if verdict.status is CheckStatus.MISMATCH:
        return (f"{name} differs at block positions "
                f"{format_positions(verdict.mismatched_blocks)} "
                f"({len(verdict.mismatched_blocks)} of {verdict.compared_blocks} compared)")
    return f"{name} unverified: {verdict.reason}"


def format_positions(positions: Sequence[int], max_ranges: int = 16) -> str:
    """Sorted positions as ranges, "3, 10-12", cut after `max_ranges`."""
    ranges: list[list[int]] = []
    for p in positions:
        if ranges and p == ranges[-1][1] + 1:
            ranges[-1][1] = p
        else:
            ranges.append([p, p])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges[:max_ranges])
    return text + (", ..." if len(ranges) > max_ranges else "")
