"""Summing the producer's checksums and checking the consumer's against them.

Both run in a scheduler, the only place that sees every worker's record:

- `sum_producer` runs on the producer when a request finishes: it adds up
  the workers' partial sums into one value per (group, block position) of
  the whole model, the payload sent to the consumer.
- `compare_load` runs on the consumer when a request's KV load has
  finished on every worker: it adds up the consumer workers' partial sums
  the same way and compares them with the payload, group by group.

The functions are pure (records in, result out) and know nothing of vLLM;
the scheduler glue decides what a verdict leads to (a log line, a failed
load). All arithmetic is mod 2**64, in uint64 numpy arrays.

Partial sums come per key (R, i): a worker's layers replicated R times
over TP, whose copy i the worker holds (R = 1 for layers split over TP).
The producer sums copy 0 only, so its value covers each layer once. The
consumer forms max(R) checks: check k adds copy k % R of every layer
replicated R times, so each check also covers each layer once, every copy
is in some check, and every check must equal the producer's value.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from vllm_kvchecksum.core.binding import TokenContent, first_difference
from vllm_kvchecksum.core.payload import KVChecksumPayload, PayloadGroup
from vllm_kvchecksum.core.records import GroupChecksums, KVChecksumRecord
from vllm_kvchecksum.core.verdicts import CheckStatus, GroupVerdict, LoadVerdict, UnverifiedReason

_MOD = 2**64

Worker = tuple[int, int]  # (pp_rank, tp_rank)


class ConsumerGroupBlocks(NamedTuple):
    """The blocks of one group a consumer's load wrote, as scheduled.

    Block positions [start, start + num_blocks) of `block_size` tokens each.
    state: a Mamba state group: one state, at position 0, compared whatever
    the block sizes and token counts (a state is not per token).
    windowed: the connector transfers only a sliding window of the group.
    """

    start: int
    num_blocks: int
    block_size: int
    state: bool = False
    windowed: bool = False


def _worker_name(worker: Worker) -> str:
    return f"(pp {worker[0]}, tp {worker[1]})"


# -- what every worker reported ---------------------------------------------


class _Problem(NamedTuple):
    key: UnverifiedReason
    message: str


def _reports_by_worker(records: Sequence[KVChecksumRecord], req_id: str,
                       expected_workers: int) -> dict[Worker, KVChecksumRecord] | _Problem:
    """The record of each worker that reported `req_id`, if all of them did.

    Every one of the TP x PP workers must report the request exactly once;
    a worker with none of a group's layers still reports the request.
    """
    by_worker: dict[Worker, KVChecksumRecord] = {}
    for record in records:
        if req_id not in record.requests:
            continue
        if record.worker in by_worker:
            return _Problem(UnverifiedReason.MALFORMED_RECORD,
                            f"worker {_worker_name(record.worker)} reported the request twice")
        by_worker[record.worker] = record
    if not by_worker:
        return _Problem(UnverifiedReason.MISSING_WORKERS,
                        f"no worker reported the request (expected {expected_workers})")
    layouts = {(r.tp_size, r.pp_size) for r in by_worker.values()}
    if len(layouts) > 1:
        return _Problem(UnverifiedReason.MALFORMED_RECORD,
                        f"workers report different (tp_size, pp_size): {sorted(layouts)}")
    tp_size, pp_size = layouts.pop()
    if tp_size * pp_size != expected_workers:
        return _Problem(UnverifiedReason.MALFORMED_RECORD,
                        f"workers report tp_size {tp_size} x pp_size {pp_size}, "
                        f"but {expected_workers} workers are expected")
    expected = {(pp, tp) for pp in range(pp_size) for tp in range(tp_size)}
    unknown = sorted(set(by_worker) - expected)
    if unknown:
        # A rank past the engine's TP x PP layout is no worker that is late
        # (missing_workers, which a retry may outwait): the record is wrong.
        return _Problem(UnverifiedReason.MALFORMED_RECORD,
                        f"{', '.join(map(_worker_name, unknown))} reported the request, but the engine has "
                        f"{expected_workers} workers (tp_size {tp_size} x pp_size {pp_size})")
    missing = sorted(expected - set(by_worker))
    if missing:
        return _Problem(UnverifiedReason.MISSING_WORKERS,
                        f"{len(expected) - len(missing)} of {expected_workers} workers "
                        f"reported the request (missing {', '.join(map(_worker_name, missing))})")
    return by_worker


def _check_reported_blocks(by_worker: Mapping[Worker, KVChecksumRecord], req_id: str,
                           scheduled: Mapping[int, tuple], num_tokens: int,
                           check_block_size: bool) -> _Problem | None:
    """A problem if any worker checksummed other blocks or tokens than scheduled.

    scheduled[group] starts with (start, num_blocks), then block_size when
    `check_block_size`.
    """
    for worker, record in sorted(by_worker.items()):
        name = _worker_name(worker)
        reported_tokens = record.num_tokens.get(req_id, num_tokens)
        if reported_tokens != num_tokens:
            return _Problem(UnverifiedReason.UNSCHEDULED_BLOCKS,
                            f"worker {name} checksummed {reported_tokens} tokens, "
                            f"{num_tokens} were scheduled")
        for group_id, group in sorted(record.requests[req_id].items()):
            if group_id not in scheduled:
                return _Problem(UnverifiedReason.UNSCHEDULED_BLOCKS,
                                f"worker {name} checksummed group {group_id}, "
                                "which was not scheduled")
            start, num_blocks = scheduled[group_id][:2]
            if (group.start, group.num_blocks) != (start, num_blocks):
                return _Problem(
                    UnverifiedReason.UNSCHEDULED_BLOCKS,
                    f"worker {name} checksummed blocks [{group.start}, "
                    f"{group.start + group.num_blocks}) of group {group_id}, "
                    f"[{start}, {start + num_blocks}) were scheduled")
            if check_block_size and group.block_size != scheduled[group_id][2]:
                return _Problem(UnverifiedReason.UNSCHEDULED_BLOCKS,
                                f"worker {name} checksummed group {group_id} with block size "
                                f"{group.block_size}, {scheduled[group_id][2]} was scheduled")
            for key, values in group.partials.items():
                if not (isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], int)
                        and isinstance(key[1], int) and 0 <= key[1] < key[0]):
                    return _Problem(UnverifiedReason.MALFORMED_RECORD,
                                    f"worker {name} reported partial key {key!r} for group "
                                    f"{group_id}; expected (replicas, replica_index)")
                if np.shape(values) != (num_blocks,):
                    return _Problem(UnverifiedReason.UNSCHEDULED_BLOCKS,
                                    f"worker {name} reported values of shape "
                                    f"{np.shape(values)} for key {key} of group {group_id}, "
                                    f"for {num_blocks} scheduled blocks")
    return None


def _group_reports(by_worker: Mapping[Worker, KVChecksumRecord],
                   req_id: str) -> dict[int, list[GroupChecksums]]:
    """Each group's reports, from the workers holding some of its layers."""
    reports: dict[int, list[GroupChecksums]] = {}
    for _, record in sorted(by_worker.items()):
        for group_id, group in record.requests[req_id].items():
            reports.setdefault(group_id, []).append(group)
    return reports


def _skipped_groups(by_worker: Mapping[Worker, KVChecksumRecord]) -> dict[int, str]:
    """Groups some worker cannot checksum, with one worker's reason."""
    skipped: dict[int, str] = {}
    for _, record in sorted(by_worker.items()):
        for group_id, reason in record.skipped_groups.items():
            skipped.setdefault(group_id, reason)
    return skipped


def _tp_local_groups(by_worker: Mapping[Worker, KVChecksumRecord]) -> set[int]:
    """Groups whose checksums some worker says depend on the TP size."""
    return {g for record in by_worker.values() for g in record.tp_local_groups}


def _model_fingerprint(by_worker: Mapping[Worker, KVChecksumRecord], group_id: int) -> int:
    """The group's fingerprint for the whole model: one per PP stage, summed.

    TP ranks of a stage hold the same layers and report the same
    fingerprint, so TP rank 0 speaks for its stage.
    """
    return sum(record.fingerprints.get(group_id, 0)
               for (pp_rank, tp_rank), record in by_worker.items() if tp_rank == 0) % _MOD


def _as_uint64(values) -> np.ndarray:
    return np.asarray(values).astype(np.uint64, copy=False)


# -- the producer -----------------------------------------------------------


class ProducerSum(NamedTuple):
    """The result of `sum_producer`: a payload, or None and why not."""

    payload: KVChecksumPayload | None
    reason: str | None = None


def sum_producer(records: Sequence[KVChecksumRecord], req_id: str, expected_workers: int,
                 scheduled: Mapping[int, tuple[int, int]], num_tokens: int,
                 tp_size: int) -> ProducerSum:
    """Sum a producer's worker records of one request into the payload to send.

    Runs in the producer's scheduler when the request finishes, over the
    records of the step that checksummed its prompt. scheduled[group] is
    the (start, num_blocks) the workers were asked for. Each group's value
    is the sum over every worker of its replica-0 partials; its fingerprint
    the sum over PP stages of TP rank 0's. Groups some worker skipped are
    left out. `tp_size` is the producer's TP size, carried in the payload.
    Returns no payload, with the reason, when not every one of the
    `expected_workers` (TP x PP) reported the request, a worker checksummed
    other blocks than scheduled, or the records contradict themselves.
    """
    by_worker = _reports_by_worker(records, req_id, expected_workers)
    if isinstance(by_worker, _Problem):
        return ProducerSum(None, by_worker.message)
    record_tp_size = next(iter(by_worker.values())).tp_size
    if record_tp_size != tp_size:
        return ProducerSum(None, f"workers report tp_size {record_tp_size}, "
                                 f"the scheduler's is {tp_size}")
    problem = _check_reported_blocks(by_worker, req_id, scheduled, num_tokens,
                                     check_block_size=False)
    if problem is not None:
        return ProducerSum(None, problem.message)
    skipped = _skipped_groups(by_worker)
    reports = _group_reports(by_worker, req_id)
    groups: dict[int, PayloadGroup] = {}
    for group_id in sorted(scheduled):
        if group_id in skipped:
            continue
        group_reports = reports.get(group_id)
        if not group_reports:
            return ProducerSum(None, f"no worker checksummed scheduled group {group_id}")
        block_sizes = sorted({g.block_size for g in group_reports})
        if len(block_sizes) > 1:
            return ProducerSum(None, f"workers report block sizes {block_sizes} "
                                     f"for group {group_id}")
        start, num_blocks = scheduled[group_id][:2]
        total = np.zeros(num_blocks, dtype=np.uint64)
        found_replica_0 = False
        for group in group_reports:
            for (_, replica_index), values in group.partials.items():
                if replica_index == 0:
                    np.add(total, _as_uint64(values), out=total)
                    found_replica_0 = True
        if not found_replica_0:
            return ProducerSum(None, f"no worker reported replica 0 of group {group_id}")
        groups[group_id] = PayloadGroup(fingerprint=_model_fingerprint(by_worker, group_id),
                                        block_size=block_sizes[0], start=start, values=total)
    try:
        payload = KVChecksumPayload(num_tokens=num_tokens, producer_tp_size=tp_size, groups=groups,
                                    tp_local_groups=_tp_local_groups(by_worker) & set(groups))
    except ValueError as exc:
        return ProducerSum(None, f"cannot build the payload: {exc}")
    return ProducerSum(payload)


# -- the consumer -----------------------------------------------------------


def compare_load(expected: KVChecksumPayload | None, records: Sequence[KVChecksumRecord],
                 req_id: str, expected_workers: int,
                 scheduled: Mapping[int, ConsumerGroupBlocks | tuple[int, int, int]],
                 num_tokens: int, *,
                 missing_reason: str = "the producer sent no KV checksums",
                 producer_tp_size: Any = None, own: TokenContent | None = None,
                 missing_key: UnverifiedReason = UnverifiedReason.NO_PRODUCER_CHECKSUMS) -> LoadVerdict:
    """Compare a consumer's checksums of one finished KV load with the producer's.

    Runs in the consumer's scheduler once every worker has finished loading
    the request and before the request runs again. `records` are the
    consumer workers' reports (others' requests are ignored), scheduled[g]
    the (start, num_blocks, block_size) of group g the load wrote, and
    num_tokens the tokens the consumer's blocks hold. `expected` is the
    decoded payload, or None with `missing_reason` saying why there is none
    (not sent, or invalid). `producer_tp_size`: the producer's TP size as
    the connector set the transfer up (None: it does not say); a payload
    that says otherwise is unverified, since its TP size decides which
    groups are left out. `missing_key`: the reason counted when there is
    no payload.

    `own`: this request's content (binding.py). With it, the payload's
    binding is checked over every token up to the load's end: where the
    producer's tokens differ from ours, the loaded blocks from there on hold
    another request's KV (a mismatch, GroupVerdict.foreign_blocks) whatever
    their values say, and a payload bound to nothing never verifies.
    Without it (tests of the values alone) bindings are not looked at.
    """
    if expected is None:
        return _load_unverified(req_id, missing_key, missing_reason)
    verdict = _compare_values(expected, records, req_id, expected_workers, scheduled, num_tokens,
                              producer_tp_size)
    if own is None:
        return verdict
    return _apply_binding(verdict, expected, own, scheduled, num_tokens)


def _compare_values(expected: KVChecksumPayload, records: Sequence[KVChecksumRecord], req_id: str,
                    expected_workers: int, scheduled: Mapping[int, ConsumerGroupBlocks | tuple],
                    num_tokens: int, producer_tp_size: Any) -> LoadVerdict:
    """compare_load's comparison of the checksum values (bindings aside)."""
    if producer_tp_size is not None and (type(producer_tp_size) is not int
                                         or producer_tp_size != expected.producer_tp_size):
        return _load_unverified(
            req_id, UnverifiedReason.PRODUCER_TP_SIZE_DIFFERS,
            f"the checksums say producer TP size {expected.producer_tp_size}, the connector transfers from "
            f"TP size {str(producer_tp_size)[:20]}")
    by_worker = _reports_by_worker(records, req_id, expected_workers)
    if isinstance(by_worker, _Problem):
        return _load_unverified(req_id, *by_worker)
    scheduled = {g: ConsumerGroupBlocks(*blocks) for g, blocks in scheduled.items()}
    problem = _check_reported_blocks(by_worker, req_id, scheduled, num_tokens,
                                     check_block_size=True)
    if problem is not None:
        return _load_unverified(req_id, *problem)

    skipped = _skipped_groups(by_worker)
    reports = _group_reports(by_worker, req_id)
    verdicts: dict[int, GroupVerdict] = {}
    consumer_tp_size = next(iter(by_worker.values())).tp_size
    left_out_tp = []
    if expected.producer_tp_size != consumer_tp_size:
        # Their slices follow each rank's shard, so sums at different TP
        # sizes differ for the same state: leave them out, like a group
        # neither side checksums (a hybrid model's other groups still
        # verify), but only when both sides say so; a group only one side
        # computes TP-locally goes on to its fingerprint (unverified).
        left_out_tp = sorted((_tp_local_groups(by_worker) & expected.tp_local_groups & set(scheduled))
                             - set(skipped))
    for group_id in sorted(set(expected.groups) | set(reports) | set(scheduled) | set(skipped)):
        produced = expected.groups.get(group_id)
        if group_id in left_out_tp:
            continue
        if group_id in skipped:
            if produced is not None:
                verdicts[group_id] = _group_unverified(
                    group_id, UnverifiedReason.SKIPPED_BY_CONSUMER,
                    f"skipped by the consumer ({skipped[group_id]}) but not by the producer")
            # Skipped on both sides: not part of the verdict.
        elif group_id not in reports:
            verdicts[group_id] = _group_unverified(
                group_id, UnverifiedReason.NOT_CHECKSUMMED_BY_CONSUMER,
                "no consumer worker checksummed it")
        elif produced is None:
            verdicts[group_id] = _group_unverified(
                group_id, UnverifiedReason.NOT_CHECKSUMMED_BY_PRODUCER,
                "not checksummed by the producer")
        else:
            verdicts[group_id] = _compare_group(
                group_id, produced, expected.num_tokens, reports[group_id],
                _model_fingerprint(by_worker, group_id), scheduled[group_id], num_tokens)
    if not verdicts:
        if left_out_tp:
            return LoadVerdict(req_id=req_id, status=CheckStatus.UNVERIFIED,
                               reason_key=UnverifiedReason.TP_SIZES_DIFFER, left_out_tp=tuple(left_out_tp),
                               reason=f"groups {left_out_tp} hold state without a known TP split, comparable only "
                                      f"at equal TP sizes (producer {expected.producer_tp_size}, consumer "
                                      f"{consumer_tp_size}), and no other group was compared")
        return _load_unverified(req_id, UnverifiedReason.NO_GROUPS,
                                "every group is skipped on both sides, nothing was compared")
    statuses = {v.status for v in verdicts.values()}
    status = next(s for s in (CheckStatus.MISMATCH, CheckStatus.UNVERIFIED, CheckStatus.VERIFIED)
                  if s in statuses)
    return LoadVerdict(req_id=req_id, status=status, groups=verdicts, left_out_tp=tuple(left_out_tp))


# -- whose KV it is ------------------------------------------------------------


def _apply_binding(verdict: LoadVerdict, expected: KVChecksumPayload, own: TokenContent,
                   scheduled: Mapping[int, ConsumerGroupBlocks | tuple], num_tokens: int) -> LoadVerdict:
    """The verdict once the payload's binding is checked against this request's content.

    Tokens [0, num_tokens) are this load's request up to its end: the local
    prefix-cache hit and the loaded blocks. If the producer's bound tokens
    differ from ours anywhere there, every loaded block from the first
    differing token on holds KV computed for another request (KV attends to
    every earlier token), so each scheduled group's blocks from there on are
    foreign and mismatched, whatever was or could be compared of their
    values. Otherwise, a payload bound to nothing leaves each group that
    would have verified unverified.
    """
    binding = expected.binding
    if binding is None:
        if verdict.status is not CheckStatus.VERIFIED:
            return verdict
        groups = {g: (v if v.status is not CheckStatus.VERIFIED else _group_unverified(
            g, UnverifiedReason.NOT_BOUND, "the producer's checksums name no request content (binding)"))
            for g, v in verdict.groups.items()}
        return LoadVerdict(req_id=verdict.req_id, status=CheckStatus.UNVERIFIED, groups=groups,
                           left_out_tp=verdict.left_out_tp, source=verdict.source)
    first = first_difference(own, binding.block_size, binding.values, expected.num_tokens, num_tokens)
    if first is None:
        return verdict
    run_end = min(first + binding.block_size, expected.num_tokens)
    groups = dict(verdict.groups)
    for group_id, blocks in sorted(scheduled.items()):
        blocks = ConsumerGroupBlocks(*blocks)
        if blocks.num_blocks <= 0:
            continue
        if blocks.state:
            foreign = tuple(range(blocks.start, blocks.start + blocks.num_blocks))
        else:
            low = max(blocks.start, first // blocks.block_size)
            foreign = tuple(range(low, blocks.start + blocks.num_blocks))
        if not foreign:
            continue
        before = groups.get(group_id)
        corrupt = before.mismatched_blocks if before is not None else ()
        groups[group_id] = GroupVerdict(
            group_id=group_id, status=CheckStatus.MISMATCH,
            mismatched_blocks=tuple(sorted(set(corrupt) | set(foreign))),
            compared_blocks=max(before.compared_blocks if before is not None else 0, len(foreign)),
            foreign_blocks=foreign, foreign_from_token=first, foreign_to_token=run_end)
    if not any(v.status is CheckStatus.MISMATCH for v in groups.values()):
        return verdict  # no loaded block at or past the first differing token
    return LoadVerdict(req_id=verdict.req_id, status=CheckStatus.MISMATCH, groups=groups,
                       left_out_tp=verdict.left_out_tp, source=verdict.source)


def _load_unverified(req_id: str, key: UnverifiedReason, message: str) -> LoadVerdict:
    return LoadVerdict(req_id=req_id, status=CheckStatus.UNVERIFIED, reason_key=key,
                       reason=message)


def _group_unverified(group_id: int, key: UnverifiedReason, message: str) -> GroupVerdict:
    return GroupVerdict(group_id=group_id, status=CheckStatus.UNVERIFIED, reason_key=key,
                        reason=message)


def _replica_checks(reports: Sequence[GroupChecksums],
                    num_blocks: int) -> np.ndarray | _Problem:
    """The consumer's checks of one group, shape (max replicas, num_blocks).

    Sums each partial key over the workers; check k adds, for each
    replication R, copy k % R. Every copy 0..R-1 of each R must be present.
    """
    sums: dict[tuple[int, int], np.ndarray] = {}
    for group in reports:
        for key, values in group.partials.items():
            total = sums.get(key)
            if total is None:
                sums[key] = _as_uint64(values).copy()
            else:
                np.add(total, _as_uint64(values), out=total)
    if not sums:
        return _Problem(UnverifiedReason.NOT_CHECKSUMMED_BY_CONSUMER,
                        "the consumer workers reported no values for it")
    copies: dict[int, set[int]] = {}
    for replicas, index in sums:
        copies.setdefault(replicas, set()).add(index)
    for replicas, indices in sorted(copies.items()):
        missing = sorted(set(range(replicas)) - indices)
        if missing:
            return _Problem(UnverifiedReason.MISSING_REPLICA,
                            f"copies {missing} of its layers replicated {replicas} times "
                            "are missing")
    if len(sums) == 1:
        # No layer is replicated (the usual case): the one sum is the check.
        return next(iter(sums.values()))[None, :]
    checks = np.zeros((max(copies), num_blocks), dtype=np.uint64)
    for k in range(checks.shape[0]):
        for replicas in copies:
            np.add(checks[k], sums[(replicas, k % replicas)], out=checks[k])
    return checks


def _compare_group(group_id: int, produced: PayloadGroup, producer_tokens: int,
                   reports: Sequence[GroupChecksums], consumer_fingerprint: int,
                   blocks: ConsumerGroupBlocks, consumer_tokens: int) -> GroupVerdict:
    """Compare one group both sides checksummed."""
    if consumer_fingerprint != produced.fingerprint:
        return _group_unverified(
            group_id, UnverifiedReason.FINGERPRINT_DIFFERS,
            f"fingerprint differs (producer {produced.fingerprint:#x}, consumer "
            f"{consumer_fingerprint:#x}): other layers or dtypes")
    checks = _replica_checks(reports, blocks.num_blocks)
    if isinstance(checks, _Problem):
        return _group_unverified(group_id, *checks)
    if blocks.state:
        result = _compare_state(produced, checks)
    else:
        result = _compare_chunks(
            _BlockValues(produced.start, produced.values[None, :], produced.block_size, producer_tokens),
            _BlockValues(blocks.start, checks, blocks.block_size, consumer_tokens))
    if isinstance(result, _Problem):
        return _group_unverified(group_id, *result)
    mismatched, compared = result
    if mismatched:
        return GroupVerdict(group_id=group_id, status=CheckStatus.MISMATCH,
                            mismatched_blocks=mismatched, compared_blocks=compared)
    if compared < _blocks_to_compare(produced, blocks):
        # Every loaded block must be compared: the payload may come from a
        # client, and one that drops values (or shifts start or num_tokens)
        # must not shrink what "verified" covers.
        return _group_unverified(
            group_id, UnverifiedReason.NOT_COVERED_BY_PRODUCER,
            f"the producer's checksums cover {compared} of the {blocks.num_blocks} loaded blocks")
    return GroupVerdict(group_id=group_id, status=CheckStatus.VERIFIED,
                        compared_blocks=compared)


def _blocks_to_compare(produced: PayloadGroup, blocks: ConsumerGroupBlocks) -> int:
    """How many of the loaded blocks a verified group must have compared: all.

    One exception, bounded by the consumer's own numbers: a sliding-window
    group whose block sizes differ may leave the window's first chunk (one
    block of the larger size) out, since each side clips the window at its
    own block boundary, so that chunk is never whole on both sides.
    """
    if blocks.windowed and produced.block_size != blocks.block_size:
        chunk = max(produced.block_size, blocks.block_size) // blocks.block_size
        return max(0, blocks.num_blocks - chunk)
    return blocks.num_blocks


def _compare_state(produced: PayloadGroup, checks: np.ndarray) -> tuple[tuple[int, ...], int] | _Problem:
    """Compare a Mamba state group: one state each side, at position 0.

    The block sizes and token counts do not enter: without prefix caching a
    state block spans the whole sequence, so the two sides may differ in
    them for the same state.
    """
    if checks.shape[1] != 1:
        return _Problem(UnverifiedReason.UNSCHEDULED_BLOCKS,
                        f"the consumer checksummed {checks.shape[1]} state blocks, not 1")
    if produced.start != 0 or produced.values.shape[0] != 1:
        return _Problem(UnverifiedReason.NO_COMMON_BLOCKS,
                        f"the producer sent {produced.values.shape[0]} values from position {produced.start} "
                        "for a state group, not one state at position 0")
    differs = bool((checks[:, 0] != produced.values[0]).any())
    return ((0,) if differs else ()), 1


# -- lining up block positions ----------------------------------------------


class _BlockValues(NamedTuple):
    """One side's values of one group.

    values[k, i] is check k of block position start + i, blocks of
    block_size tokens, of a request holding num_tokens tokens.
    """

    start: int
    values: np.ndarray
    block_size: int
    num_tokens: int


class _Chunks(NamedTuple):
    """One side's values summed per chunk, over a range of chunk indices."""

    sums: np.ndarray  # (checks, chunks) uint64
    covered: np.ndarray  # bool per chunk: every block holding tokens is present
    tokens: np.ndarray  # tokens of the request in each chunk


# The payload may come from a client, so the producer's block size, first
# position and token count can be anything the decoder lets through (up to
# 2**40). So the chunks both sides hold blocks of are worked out first, with
# Python ints, and only they are looked at: each holds a consumer block, so
# there are no more of them than consumer blocks, and no more producer blocks
# inside them than the consumer's blocks have tokens. Every array below has
# one entry per such chunk or block; none is sized by a payload value. numpy
# sees no product of two payload values either, so nothing can wrap.


def _chunk_range(side: _BlockValues, per_chunk: int) -> tuple[int, int]:
    """The chunks [first, end) holding a side's blocks, `per_chunk` blocks to a chunk."""
    return side.start // per_chunk, -(-(side.start + side.values.shape[1]) // per_chunk)


def _covered_chunk_range(side: _BlockValues, per_chunk: int) -> tuple[int, int]:
    """The chunks [first, end) the side holds whole.

    A chunk is held whole when every one of its blocks holding tokens is
    present (blocks past the request's last token count as zero) and it
    holds some token. The blocks present are one range, so these chunks are
    one range too.
    """
    blocks_end = side.start + side.values.shape[1]
    blocks_with_tokens = -(-side.num_tokens // side.block_size)
    if blocks_with_tokens <= blocks_end:
        end = -(-blocks_with_tokens // per_chunk)
    else:
        end = blocks_end // per_chunk
    return -(-side.start // per_chunk), end


def _chunks(side: _BlockValues, chunk_tokens: int, first: int, end: int) -> _Chunks:
    """Sum a side's blocks into chunks [first, end) of `chunk_tokens` tokens.

    `chunk_tokens` is a multiple of the side's block size, and each of the
    chunks must hold at least one of its blocks. Allocates per chunk and per
    block of the side inside the chunks, nothing more.
    """
    per_chunk = chunk_tokens // side.block_size
    low = max(first * per_chunk, side.start)
    high = min(end * per_chunk, side.start + side.values.shape[1])
    values = side.values[:, low - side.start:high - side.start]
    if per_chunk == 1:
        # A chunk is one block (the side's block size is the larger one):
        # the values are the sums, no reduction needed.
        sums = values
    else:
        # The chunk of each block; a new chunk begins where it changes.
        chunk_of_block = (low + np.arange(high - low, dtype=np.int64)) // per_chunk
        begins = np.flatnonzero(np.diff(chunk_of_block, prepend=first - 1))
        sums = np.add.reduceat(values, begins, axis=1, dtype=np.uint64)
    index = np.arange(first, end, dtype=np.int64)
    covered_first, covered_end = _covered_chunk_range(side, per_chunk)
    covered = (index >= covered_first) & (index < covered_end)
    # Chunks before full_chunks hold chunk_tokens tokens, the next one the rest.
    full_chunks, rest = divmod(side.num_tokens, chunk_tokens)
    tokens = np.where(index < full_chunks, chunk_tokens, np.where(index == full_chunks, rest, 0))
    return _Chunks(sums, covered, tokens)


def _consumer_positions(in_chunk: np.ndarray, first: int, per_chunk: int, start: int,
                        num_blocks: int) -> np.ndarray:
    """The consumer's block positions in the chunks flagged by `in_chunk`.

    in_chunk[i] flags chunk first + i. One entry per consumer block.
    """
    positions = start + np.arange(num_blocks, dtype=np.int64)
    chunk = positions // per_chunk - first
    inside = (chunk >= 0) & (chunk < in_chunk.size)
    inside[inside] = in_chunk[chunk[inside]]
    return positions[inside]


# What both ways of lining blocks up (_compare_lined_up, _compare_equal_blocks)
# say when nothing can be compared.
_NOTHING_ON_BOTH_SIDES = _Problem(UnverifiedReason.NO_COMMON_BLOCKS,
                                  "no block position is checksummed on both sides")
_NOTHING_WHOLE_ON_BOTH_SIDES = _Problem(UnverifiedReason.NO_COMMON_BLOCKS,
                                        "no block position is checksummed whole on both sides "
                                        "with the same number of tokens")


def _compare_chunks(producer: _BlockValues,
                    consumer: _BlockValues) -> tuple[tuple[int, ...], int] | _Problem:
    """Compare the positions both sides hold, in chunks of the larger block size.

    producer.values has one row; consumer.values one row per check, each
    compared with it. A chunk is compared where both sides cover it whole
    and hold the same number of tokens in it (with equal block sizes a
    chunk is a block, so the last block counts only with equal token
    counts). Returns (mismatched consumer block positions, number of
    consumer blocks compared), or the problem that prevents comparing.
    """
    if producer.block_size == consumer.block_size:
        return _compare_equal_blocks(producer, consumer)
    return _compare_lined_up(producer, consumer)


def _compare_lined_up(producer: _BlockValues,
                      consumer: _BlockValues) -> tuple[tuple[int, ...], int] | _Problem:
    """_compare_chunks for any block sizes: both sides summed into chunks."""
    small, large = sorted((producer.block_size, consumer.block_size))
    if large % small:
        return _Problem(UnverifiedReason.BLOCK_SIZES_NOT_MULTIPLES,
                        f"block sizes {producer.block_size} (producer) and "
                        f"{consumer.block_size} (consumer) are not multiples of each other")
    consumer_per_chunk = large // consumer.block_size
    if consumer.start % consumer_per_chunk:
        return _Problem(
            UnverifiedReason.UNALIGNED_FIRST_BLOCK,
            f"the consumer's first loaded block {consumer.start} (of {consumer.block_size} "
            f"tokens) starts inside producer block "
            f"{consumer.start // consumer_per_chunk} (of {producer.block_size} tokens)")
    # The chunks both sides hold blocks of, from the index ranges alone.
    ours_first, ours_end = _chunk_range(consumer, consumer_per_chunk)
    theirs_first, theirs_end = _chunk_range(producer, large // producer.block_size)
    first, end = max(ours_first, theirs_first), min(ours_end, theirs_end)
    if end <= first:
        return _NOTHING_ON_BOTH_SIDES
    ours, theirs = _chunks(consumer, large, first, end), _chunks(producer, large, first, end)
    compared = ours.covered & theirs.covered & (ours.tokens == theirs.tokens)
    if not compared.any():
        return _NOTHING_WHOLE_ON_BOTH_SIDES
    differs = compared & (ours.sums != theirs.sums).any(axis=0)
    num_blocks = consumer.values.shape[1]
    count = _consumer_positions(compared, first, consumer_per_chunk, consumer.start,
                                num_blocks).size
    mismatched = _consumer_positions(differs, first, consumer_per_chunk, consumer.start,
                                     num_blocks)
    return tuple(int(p) for p in mismatched), int(count)


def _compare_equal_blocks(producer: _BlockValues,
                          consumer: _BlockValues) -> tuple[tuple[int, ...], int] | _Problem:
    """_compare_chunks when both sides have one block size (the usual P/D case).

    A chunk is then a block, and the blocks compared are one range worked
    out with Python ints: those both sides hold, whole (every block before
    the last holding tokens), with the same tokens. Gives exactly what
    _compare_lined_up gives (tests/unit/test_compare.py runs both on random
    sides), with a handful of numpy calls instead of a few dozen: this runs
    on the consumer's scheduler thread once per group of every load.
    """
    block_size = consumer.block_size
    first = max(consumer.start, producer.start)
    end = min(consumer.start + consumer.values.shape[1], producer.start + producer.values.shape[1])
    if end <= first:
        return _NOTHING_ON_BOTH_SIDES
    # Blocks before `full` hold block_size tokens on both sides. Past it one
    # side holds fewer, then none: only the block at `full` may still count,
    # when both sides hold the same tokens in it, and some.
    full = max(first, min(end, consumer.num_tokens // block_size, producer.num_tokens // block_size))
    stop = full
    if full < end and 0 < _tokens_in(consumer, full) == _tokens_in(producer, full):
        stop = full + 1
    if stop <= first:
        return _NOTHING_WHOLE_ON_BOTH_SIDES
    ours = consumer.values[:, first - consumer.start:stop - consumer.start]
    theirs = producer.values[:, first - producer.start:stop - producer.start]
    mismatched = np.flatnonzero((ours != theirs).any(axis=0)) + first
    return tuple(mismatched.tolist()), stop - first


def _tokens_in(side: _BlockValues, position: int) -> int:
    """Tokens of the request in the side's block at `position`."""
    return max(0, min(side.block_size, side.num_tokens - position * side.block_size))
