"""Checksums of offloaded KV: stored with each block, checked when it is loaded back.

A connector that offloads KV (to host memory, a store, disk) and loads it
back keeps one 64-bit entry per block next to the block's KV. The entry is
this worker's checksum of the block (the same definition as P/D, summed over
the worker's own layers and heads: one rank checks its own KV) XORed with a
tag that binds it to what was stored:

    tag = little-endian uint64 of block_hash[:8]  XOR  group fingerprint

The block hash covers the prefix tokens (and LoRA, multimodal inputs, cache
salt), the fingerprint the group's layer names, types and dtypes. Without
the tag an intact value stored for the same position of another prefix would
match its own checksum; with it such a value fails like corrupted KV, and so
does one stored by another model. The rank is left out of the tag, so TP
replicas store equal entries. A value loaded at another position or into
another shard already checksums differently (the definition weighs pieces by
token position, head and layer).

At load, each worker reports its checksums of the loaded blocks and the
entries the connector wrote back; `compare_offloaded` (on the scheduler)
removes the tags it expects, computed from the request's own block hashes,
never from the store, and compares per worker and block position.

This module imports no vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from vllm_kvchecksum.core.compare import (_as_uint64, _check_reported_blocks, _load_unverified, _reports_by_worker,
                                          _worker_name)
from vllm_kvchecksum.core.records import KVChecksumRecord
from vllm_kvchecksum.core.verdicts import CheckStatus, GroupVerdict, LoadVerdict, UnverifiedReason

# Where an offloaded load's reference comes from, in verdicts and logs.
OFFLOADED_SOURCE = "offloaded"


@dataclass(frozen=True)
class BlockChecksumRun:
    """Consecutive full blocks of one group whose entries a connector saves.

    block_ids[i] holds the request's block at position start + i;
    block_hashes[i] is that block's hash (the request's block_hashes entry,
    at a hash block size equal to the group's block size).
    """

    group_id: int
    start: int
    block_ids: Sequence[int]
    block_hashes: Sequence[bytes]

    def __post_init__(self):
        if len(self.block_ids) != len(self.block_hashes):
            raise ValueError(f"a block checksum run of group {self.group_id} has {len(self.block_ids)} blocks "
                             f"and {len(self.block_hashes)} block hashes")


def block_hash_words(block_hashes: Sequence[bytes]) -> np.ndarray:
    """The little-endian uint64 of each hash's first 8 bytes (zero-padded if shorter).

    One numpy call for vLLM's block hashes (bytes): numpy's 8-byte strings
    keep exactly the first 8 bytes of each, zero-padded. bytearray and
    memoryview hashes take a loop. numpy would turn other objects (None,
    ints, str) into their text, so a list that does not start with a
    bytes-like hash raises TypeError (vLLM's hashes are always bytes).
    """
    n = len(block_hashes)
    if n and not isinstance(block_hashes[0], (bytes, bytearray, memoryview)):
        raise TypeError(f"block hashes must be bytes, got {type(block_hashes[0]).__name__}")
    try:
        words = np.fromiter(block_hashes, dtype="S8", count=n)
    except (TypeError, ValueError):  # bytearray or memoryview hashes
        raw = b"".join(bytes(h[:8]).ljust(8, b"\0") for h in block_hashes)
        return np.frombuffer(raw, dtype="<u8").astype(np.uint64)
    return words.view("<u8").astype(np.uint64)


def tags_of(hash_words: np.ndarray, fingerprint: int) -> np.ndarray:
    """The tags of blocks whose block_hash_words are these, in a group with this fingerprint."""
    return hash_words ^ np.uint64(fingerprint & (2**64 - 1))


def block_checksum_tags(block_hashes: Sequence[bytes], fingerprint: int) -> np.ndarray:
    """The tags of blocks with these hashes in a group with this fingerprint (uint64)."""
    return tags_of(block_hash_words(block_hashes), fingerprint)


def _worker_block_values(partials: Mapping) -> np.ndarray:
    """A worker's checksum of each block: the sum of its partials (every replica it holds).

    Read only: with one partial (no replicated layers) it is that array itself.
    """
    total = None
    for values in partials.values():
        v = _as_uint64(values)
        total = v if total is None else total + v
    return total


def compare_offloaded(records: Sequence[KVChecksumRecord], req_id: str, expected_workers: int,
                      scheduled: Mapping[int, tuple[int, int]], num_tokens: int,
                      block_hashes: Mapping[int, Sequence[bytes]]) -> LoadVerdict:
    """Check an offloaded load's blocks against the entries stored with them.

    scheduled[group] = (start, num_blocks): the full blocks the load wrote.
    block_hashes[group]: the request's hashes of those blocks, in order (the
    tags are derived from them, never from what the store returned).
    A group is compared where every worker holding it stores its entries
    (KVChecksumRecord.offload_groups); one no worker stores is left out (the
    connector offloads no checksums for it, fixed at startup); one some
    workers store and others do not is unverified.
    """
    by_worker = _reports_by_worker(records, req_id, expected_workers)
    if not isinstance(by_worker, dict):
        return _offloaded(_load_unverified(req_id, by_worker.key, by_worker.message))
    problem = _check_reported_blocks(by_worker, req_id, scheduled, num_tokens, check_block_size=False)
    if problem is not None:
        return _offloaded(_load_unverified(req_id, problem.key, problem.message))
    verdicts: dict[int, GroupVerdict] = {}
    # Groups loaded over the same blocks share one list of hashes (the
    # scheduler passes the same object): their words are computed once. The
    # list is kept with its words, so its id is not reused during the call.
    words_memo: dict[int, tuple[Sequence[bytes], np.ndarray]] = {}

    def words_of(hashes: Sequence[bytes]) -> np.ndarray:
        if id(hashes) not in words_memo:
            words_memo[id(hashes)] = (hashes, block_hash_words(hashes))
        return words_memo[id(hashes)][1]

    for group_id, (start, num_blocks) in sorted(scheduled.items()):
        storing = [w for w, r in by_worker.items() if group_id in r.offload_groups]
        if not storing:
            continue
        if len(storing) != len(by_worker):
            missing = sorted(set(by_worker) - set(storing))
            verdicts[group_id] = GroupVerdict(
                group_id, CheckStatus.UNVERIFIED, reason_key=UnverifiedReason.NOT_STORED,
                reason=f"workers {', '.join(map(_worker_name, missing))} store no checksums of this group")
            continue
        verdicts[group_id] = _compare_group(by_worker, req_id, group_id, start, num_blocks,
                                            block_hashes.get(group_id, ()), words_of)
    if not verdicts:
        return _offloaded(_load_unverified(req_id, UnverifiedReason.NO_GROUPS,
                                           "no worker stores checksums of the loaded groups"))
    statuses = {v.status for v in verdicts.values()}
    status = (CheckStatus.MISMATCH if CheckStatus.MISMATCH in statuses
              else CheckStatus.UNVERIFIED if CheckStatus.UNVERIFIED in statuses else CheckStatus.VERIFIED)
    return LoadVerdict(req_id=req_id, status=status, groups=verdicts, source=OFFLOADED_SOURCE)


def _offloaded(verdict: LoadVerdict) -> LoadVerdict:
    return replace(verdict, source=OFFLOADED_SOURCE)


def _compare_group(by_worker: Mapping, req_id: str, group_id: int, start: int, num_blocks: int,
                   hashes: Sequence[bytes], words_of) -> GroupVerdict:
    if len(hashes) != num_blocks:
        return GroupVerdict(group_id, CheckStatus.UNVERIFIED, reason_key=UnverifiedReason.NO_BLOCK_HASHES,
                            reason=f"the request has {len(hashes)} block hashes for {num_blocks} loaded blocks")
    bad = np.zeros(num_blocks, dtype=bool)
    diff = np.empty(num_blocks, dtype=np.uint64)  # reused for each worker
    compared = 0
    words = words_of(hashes)
    tags: dict[int, np.ndarray] = {}  # per fingerprint: the TP ranks of a PP stage share one
    for worker, record in sorted(by_worker.items()):
        group = record.requests[req_id].get(group_id)
        stored = record.stored.get(req_id, {}).get(group_id)
        if group is None or not group.partials:
            # A worker holding none of the group's layers (a PP stage).
            continue
        compared += 1
        if stored is None or np.shape(stored) != (num_blocks,):
            return GroupVerdict(group_id, CheckStatus.UNVERIFIED, reason_key=UnverifiedReason.MALFORMED_RECORD,
                                reason=f"worker {_worker_name(worker)} reported no stored checksums "
                                       f"for {num_blocks} blocks")
        fingerprint = record.fingerprints.get(group_id, 0)
        if fingerprint not in tags:
            tags[fingerprint] = tags_of(words, fingerprint)
        np.bitwise_xor(_worker_block_values(group.partials), _as_uint64(stored), out=diff)
        bad |= diff != tags[fingerprint]
    if not compared:
        return GroupVerdict(group_id, CheckStatus.UNVERIFIED, reason_key=UnverifiedReason.MALFORMED_RECORD,
                            reason="no worker reported values of the group")
    positions = tuple(start + int(i) for i in np.flatnonzero(bad))
    if positions:
        return GroupVerdict(group_id, CheckStatus.MISMATCH, mismatched_blocks=positions, compared_blocks=num_blocks)
    return GroupVerdict(group_id, CheckStatus.VERIFIED, compared_blocks=num_blocks)
