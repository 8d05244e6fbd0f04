"""vllm_kvchecksum.engine.recheck: the producer's sums at the transfer's completion against those it sent."""

import numpy as np

from vllm_kvchecksum.core.payload import KVChecksumPayload, PayloadGroup
from vllm_kvchecksum.engine.recheck import RecheckStatus, recheck


def payload(values: dict[int, list[int]], *, start: int = 0, num_tokens: int = 128, fingerprint: int = 7,
            block_size: int = 16) -> KVChecksumPayload:
    return KVChecksumPayload(num_tokens=num_tokens, producer_tp_size=1, groups={
        g: PayloadGroup(fingerprint=fingerprint, block_size=block_size, start=start,
                        values=np.array(v, dtype=np.uint64)) for g, v in values.items()})


SENT = {0: [1, 2, 3, 4, 5], 1: [9, 8, 7, 6, 5]}


def test_equal_sums_are_intact():
    result = recheck(payload(SENT), payload(SENT))
    assert (result.status, dict(result.changed), result.num_changed_blocks) == (RecheckStatus.INTACT, {}, 0)


def test_changed_blocks_are_named_by_position_in_each_group():
    again = {0: [1, 2, 0, 4, 0], 1: [9, 8, 7, 6, 4]}
    result = recheck(payload(SENT, start=3), payload(again, start=3))
    assert result.status is RecheckStatus.CHANGED
    assert dict(result.changed) == {0: (5, 7), 1: (7,)}
    assert result.num_changed_blocks == 3


def test_what_cannot_be_compared_is_never_reported_changed():
    sent = payload(SENT)
    cases = {
        "the re-check could not be summed": None,
        "re-checked 127 tokens, sent 128": payload(SENT, num_tokens=127),
        "group 1 was not re-checked": payload({0: SENT[0]}),
        "other layers": payload({0: [0] * 5, 1: SENT[1]}, fingerprint=8),
        "other blocks": payload({0: [0] * 5, 1: SENT[1]}, start=1),
        "other block size": payload({0: [0] * 4, 1: SENT[1][:4]}, block_size=32),
    }
    for why, again in cases.items():
        result = recheck(sent, again)
        assert result.status is RecheckStatus.NOT_RECHECKED and not result.changed, why
        assert why.split(":")[0] in result.reason or why in ("other layers", "other blocks", "other block size"), \
            (why, result.reason)
    assert recheck(sent, payload({0: SENT[0][:4], 1: SENT[1][:4]})).status is RecheckStatus.NOT_RECHECKED
    assert recheck(sent, None, "a worker's record is missing").reason == "a worker's record is missing"


def test_another_block_size_over_as_many_blocks_is_not_compared():
    # Equal counts of blocks, each over other tokens: the sums say nothing
    # about a change, so never "changed" (nor "intact").
    sent = payload(SENT, num_tokens=160)
    result = recheck(sent, payload({0: [0] * 5, 1: [0] * 5}, block_size=32, num_tokens=160))
    assert result.status is RecheckStatus.NOT_RECHECKED and not result.changed
    assert recheck(sent, payload(SENT, block_size=32, num_tokens=160)).status is RecheckStatus.NOT_RECHECKED
