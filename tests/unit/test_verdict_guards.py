"""Guards of the comparisons that only malformed or unusual records reach.

- offload.py: a worker's stored entries must be one per loaded block; any
  other shape (one that numpy would broadcast, or a longer one) makes the
  group unverified (malformed_record), never compared;
- compare.py: between different TP sizes a TP-local group is left out only
  when the consumer loaded it; a group it did not load keeps its own
  verdict (not checksummed by the consumer), so a payload claiming another
  TP size cannot drop it from the verdict.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_offload_compare import FP, HASHES, _compare, _record

from vllm_kvchecksum.core.compare import compare_load

from vllm_kvchecksum.core.verdicts import CheckStatus, UnverifiedReason
from vllm_kvchecksum.engine.offload import block_checksum_tags
from vllm_kvchecksum.core.payload import KVChecksumPayload, PayloadGroup
from vllm_kvchecksum.core.records import GroupChecksums, KVChecksumRecord

# -- offload.py: stored entries of another shape --------------------------------


@pytest.mark.parametrize("count", [1, 2, 4])
def test_stored_entries_not_one_per_block_are_malformed(count):
    values = np.array([11, 22, 33], dtype=np.uint64)
    right = values ^ block_checksum_tags(HASHES, FP)
    stored = np.resize(right, count)  # the right entries, as far as there are any
    verdict = _compare([_record(stored=stored)])
    assert verdict.status is CheckStatus.UNVERIFIED
    assert verdict.groups[0].reason_key is UnverifiedReason.MALFORMED_RECORD
    assert "reported no stored checksums for 3 blocks" in verdict.describe()
    assert _compare([_record(stored=right)]).status is CheckStatus.VERIFIED


def test_stored_entries_of_another_rank_count_too():
    values = np.array([11, 22, 33], dtype=np.uint64)
    good = _record(tp_rank=0, tp_size=2)
    short = _record(tp_rank=1, tp_size=2, stored=(values ^ block_checksum_tags(HASHES, FP))[:1])
    verdict = _compare([good, short])
    assert verdict.status is CheckStatus.UNVERIFIED
    assert verdict.groups[0].reason_key is UnverifiedReason.MALFORMED_RECORD


# -- compare.py: TP-local groups left out only where loaded -------------------

REQ = "r"
FPS = {0: 0x1111, 1: 0x2222}
ATTENTION = np.array([5, 6], dtype=np.uint64)
STATE = np.array([7], dtype=np.uint64)


def consumer_record(loaded_state: bool) -> KVChecksumRecord:
    """TP 1 consumer: group 0 attention (2 blocks), group 1 a state without a TP split (TP-local)."""
    record = KVChecksumRecord(0, 1, 0, 1, dict(FPS), {}, tp_local_groups=frozenset({1}))
    record.requests[REQ] = {0: GroupChecksums(0, 2, 16, {(1, 0): ATTENTION.copy()})}
    if loaded_state:
        record.requests[REQ][1] = GroupChecksums(0, 1, 16, {(1, 0): STATE.copy()})
    record.num_tokens[REQ] = 32
    return record


def producer_payload(tp_size: int) -> KVChecksumPayload:
    return KVChecksumPayload(num_tokens=32, producer_tp_size=tp_size,
                             groups={0: PayloadGroup(FPS[0], 16, 0, ATTENTION.copy()),
                                     1: PayloadGroup(FPS[1], 16, 0, STATE.copy())},
                             tp_local_groups=frozenset({1}))


def judge(loaded_state: bool, producer_tp: int):
    scheduled = {0: (0, 2, 16, False)}
    if loaded_state:
        scheduled[1] = (0, 1, 16, True)
    return compare_load(producer_payload(producer_tp), [consumer_record(loaded_state)], REQ, 1, scheduled, 32)


def test_tp_local_group_the_consumer_did_not_load_keeps_its_verdict_across_tp_sizes():
    for producer_tp in (1, 2):
        verdict = judge(loaded_state=False, producer_tp=producer_tp)
        assert verdict.status is CheckStatus.UNVERIFIED, (producer_tp, verdict.describe())
        assert verdict.left_out_tp == ()
        assert verdict.groups[0].status is CheckStatus.VERIFIED
        assert verdict.groups[1].reason_key is UnverifiedReason.NOT_CHECKSUMMED_BY_CONSUMER


def test_tp_local_group_the_consumer_loaded_is_left_out_across_tp_sizes_only():
    same = judge(loaded_state=True, producer_tp=1)
    assert same.status is CheckStatus.VERIFIED and set(same.groups) == {0, 1} and same.left_out_tp == ()
    other = judge(loaded_state=True, producer_tp=2)
    assert other.status is CheckStatus.VERIFIED and set(other.groups) == {0} and other.left_out_tp == (1,)
