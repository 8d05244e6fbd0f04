"""offload.py on hand-made worker records: the tag, and the per-worker, per-block comparison."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_kvchecksum.core.verdicts import CheckStatus, UnverifiedReason
from vllm_kvchecksum.engine.offload import block_checksum_tags, block_hash_words, compare_offloaded
from vllm_kvchecksum.core.records import GroupChecksums, KVChecksumRecord

REQ = "r"
HASHES = [bytes([i]) * 32 for i in range(1, 4)]
FP = 0xDEADBEEF12345678


def _record(tp_rank=0, tp_size=1, values=(11, 22, 33), stored=None, partials=True, offload_groups=(0,),
            pp_rank=0, pp_size=1, fingerprint=FP):
    """A worker's record of group 0; unless given, entries stored with the worker's own tags."""
    values = np.array(values, dtype=np.uint64)
    record = KVChecksumRecord(tp_rank, tp_size, pp_rank, pp_size, {0: fingerprint}, {},
                              offload_groups=frozenset(offload_groups))
    record.requests[REQ] = {0: GroupChecksums(1, 3, 16, {(1, 0): values} if partials else {})}
    record.num_tokens[REQ] = 64
    if stored is None:
        stored = values ^ block_checksum_tags(HASHES, fingerprint)
    record.stored[REQ] = {0: np.asarray(stored, dtype=np.uint64)}
    return record


def _compare(records, hashes=HASHES):
    return compare_offloaded(records, REQ, len(records), {0: (1, 3)}, 64, {0: hashes})


def test_the_tag_is_the_hashs_first_8_bytes_little_endian_xor_the_fingerprint():
    h = bytes(range(32))
    assert int(block_checksum_tags([h], FP)[0]) == int.from_bytes(h[:8], "little") ^ FP


def test_hash_words_are_each_hashs_first_8_bytes_zero_padded_whatever_the_type():
    hashes = [bytes(range(i, i + 32)) for i in range(5)] + [b"\x00\x00ab\x00", b"", b"x" * 8]
    expected = [int.from_bytes(h[:8].ljust(8, b"\0"), "little") for h in hashes]
    assert block_hash_words(hashes).tolist() == expected
    assert block_hash_words([bytearray(h) for h in hashes]).tolist() == expected
    assert block_hash_words([memoryview(h) for h in hashes]).tolist() == expected
    assert block_hash_words([]).tolist() == []
    for not_hashes in ([None] * 3, [1, 2], ["abcdefghij"]):
        with pytest.raises(TypeError, match="block hashes must be bytes"):
            block_hash_words(not_hashes)


def test_entries_matching_the_tagged_checksums_verify():
    verdict = _compare([_record()])
    assert verdict.status is CheckStatus.VERIFIED and verdict.source == "offloaded"
    assert verdict.groups[0].compared_blocks == 3


def test_a_differing_entry_is_a_mismatch_at_its_position():
    stored = np.array([11, 22, 33], dtype=np.uint64) ^ block_checksum_tags(HASHES, FP)
    stored[1] ^= np.uint64(1)
    assert _compare([_record(stored=stored)]).mismatched_blocks == {0: (2,)}


def test_entries_of_another_prefix_mismatch():
    other = [bytes([9]) * 32] * 3
    stored = np.array([11, 22, 33], dtype=np.uint64) ^ block_checksum_tags(other, FP)
    assert _compare([_record(stored=stored)]).mismatched_blocks == {0: (1, 2, 3)}


def test_each_worker_is_compared_on_its_own():
    good, bad = _record(0, 2), _record(1, 2, values=(5, 6, 7), stored=[5, 6, 7])
    assert _compare([good, bad]).mismatched_blocks == {0: (1, 2, 3)}


def test_a_group_stored_by_some_workers_only_is_unverified():
    verdict = _compare([_record(0, 2), _record(1, 2, offload_groups=())])
    assert verdict.status is CheckStatus.UNVERIFIED
    assert verdict.groups[0].reason_key is UnverifiedReason.NOT_STORED


def test_a_group_no_worker_stores_is_left_out():
    verdict = _compare([_record(offload_groups=())])
    assert verdict.reason_key is UnverifiedReason.NO_GROUPS


def test_nothing_compared_is_not_verified():
    verdict = _compare([_record(partials=False)])
    assert verdict.status is CheckStatus.UNVERIFIED


def test_missing_hashes_are_unverified():
    verdict = _compare([_record()], hashes=HASHES[:2])
    assert verdict.groups[0].reason_key is UnverifiedReason.NO_BLOCK_HASHES


def test_each_pp_stage_is_checked_with_its_own_fingerprint():
    # The stages' layers differ, so do their fingerprints and their tags.
    stage_0 = _record(pp_rank=0, pp_size=2)
    stage_1 = _record(pp_rank=1, pp_size=2, fingerprint=FP + 2, values=(4, 5, 6))
    assert _compare([stage_0, stage_1]).status is CheckStatus.VERIFIED
    # Stage 1's entries tagged with stage 0's fingerprint: another stage's values.
    wrong = _record(pp_rank=1, pp_size=2, fingerprint=FP + 2, values=(4, 5, 6),
                    stored=np.array([4, 5, 6], dtype=np.uint64) ^ block_checksum_tags(HASHES, FP))
    assert _compare([stage_0, wrong]).mismatched_blocks == {0: (1, 2, 3)}


def test_groups_over_other_blocks_are_tagged_with_their_own_hashes():
    other = [bytes([i]) * 32 for i in range(7, 10)]
    record = _record()
    g1 = np.array([4, 5, 6], dtype=np.uint64)
    record.requests[REQ][1] = GroupChecksums(1, 3, 16, {(1, 0): g1})
    record.fingerprints[1] = FP
    record.offload_groups = frozenset({0, 1})
    record.stored[REQ][1] = g1 ^ block_checksum_tags(other, FP)
    scheduled = {0: (1, 3), 1: (1, 3)}
    verdict = compare_offloaded([record], REQ, 1, scheduled, 64, {0: HASHES, 1: other})
    assert verdict.status is CheckStatus.VERIFIED, verdict.describe()
    # The same list object for both groups (the scheduler shares one per block range).
    record.stored[REQ][1] = g1 ^ block_checksum_tags(HASHES, FP)
    assert compare_offloaded([record], REQ, 1, scheduled, 64, {0: HASHES, 1: HASHES}).status is CheckStatus.VERIFIED
    assert compare_offloaded([record], REQ, 1, scheduled, 64,
                             {0: HASHES, 1: other}).mismatched_blocks == {1: (1, 2, 3)}
