"""Second holders for the guards of compare.py that mutation testing found thin.

Each test here uses other inputs than the test in test_compare.py that
already holds the same guard, and fails when that guard is removed or
inverted:

- block sizes that are not multiples of each other leave a group
  unverified (block_sizes_not_multiples), even when the values line up;
- a worker reporting a request twice makes the load unverified
  (malformed_record) and the producer send nothing;
- a mismatched group makes the load a mismatch whatever other groups are
  unverified, and whatever their ids;
- the producer sums replica 0 only, while the consumer checks every copy;
- a group only one side checksummed is unverified, naming that side;
- after a local prefix hit only the loaded positions are compared, and a
  corrupted one is reported at its consumer position.

Records and payloads come from the explicit KV model of test_compare.py.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from test_compare import (MODEL, REQ, Corruption, Side, assert_unverified, block_sums, consume, produce,
                          side_records, transfer)

from vllm_kvchecksum.core.compare import sum_producer

from vllm_kvchecksum.core.verdicts import CheckStatus, UnverifiedReason
from vllm_kvchecksum.core.payload import KVChecksumPayload, PayloadGroup


def consumer_group_values(records, group: int) -> np.ndarray:
    """One check of a group summed over the consumer's records (copy 0 of every key)."""
    total = None
    for record in records:
        checksums = record.requests[REQ].get(group)
        if checksums is None:
            continue
        for (_, copy), values in checksums.partials.items():
            if copy == 0:
                total = values.copy() if total is None else total + values
    return total


def with_group(payload: KVChecksumPayload, group: int, **changes) -> KVChecksumPayload:
    """The payload with one group's fields changed (or the group dropped with drop=True)."""
    groups = dict(payload.groups)
    if changes.pop("drop", False):
        del groups[group]
    else:
        groups[group] = replace(groups[group], **changes)
    return KVChecksumPayload(num_tokens=payload.num_tokens,
                             producer_tp_size=payload.producer_tp_size, groups=groups)


# -- (a) block sizes that are not multiples ------------------------------------


@pytest.mark.parametrize("producer_bs, consumer_bs", [(24, 16), (48, 32), (32, 48)])
def test_block_sizes_not_multiples_leave_every_group_unverified(producer_bs, consumer_bs):
    verdict = transfer(Side(block_size=producer_bs), Side(block_size=consumer_bs))
    for group in (0, 1):
        assert_unverified(verdict, UnverifiedReason.BLOCK_SIZES_NOT_MULTIPLES, group=group)
        assert verdict.groups[group].compared_blocks == 0
    assert verdict.mismatched_blocks == {}
    assert f"block sizes {producer_bs} (producer) and {consumer_bs} (consumer)" in verdict.describe()


def test_block_sizes_not_multiples_are_unverified_even_with_equal_values():
    # 96 tokens: 2 producer blocks of 48, 3 consumer blocks of 32. The payload
    # carries the consumer's own values at positions 0 and 1, so comparing the
    # positions one by one (ignoring the block sizes) would find them equal.
    consumer = Side(block_size=32, num_tokens=96)
    records = side_records(consumer, producer=False)
    real = produce(Side(block_size=48, num_tokens=96))
    groups = {g: PayloadGroup(fingerprint=real.groups[g].fingerprint, block_size=48, start=0,
                              values=consumer_group_values(records, g)[:2].copy())
              for g in (0, 1)}
    payload = KVChecksumPayload(num_tokens=96, producer_tp_size=1, groups=groups)
    verdict = consume(consumer, payload, records)
    assert verdict.status is CheckStatus.UNVERIFIED, verdict.describe()
    for group in (0, 1):
        assert_unverified(verdict, UnverifiedReason.BLOCK_SIZES_NOT_MULTIPLES, group=group)


# -- (b) a worker reporting a request twice ------------------------------------


@pytest.mark.parametrize("duplicate_first", [False, True])
def test_pp_stage_reporting_twice_makes_the_load_malformed(duplicate_first):
    side = Side(pp=2)
    records = side_records(side, producer=False)
    # Worker (pp 1, tp 0) sends an identical second record of the request.
    again = replace(records[1], requests=dict(records[1].requests),
                    num_tokens=dict(records[1].num_tokens))
    listed = [again] + records if duplicate_first else records + [again]
    verdict = consume(side, produce(Side()), listed)
    assert_unverified(verdict, UnverifiedReason.MALFORMED_RECORD)
    assert "(pp 1, tp 0) reported the request twice" in verdict.describe()


def test_producer_worker_reporting_twice_sends_no_payload():
    side = Side(tp=2, pp=2)
    records = side_records(side, producer=True)
    result = sum_producer(records + [records[2]], REQ, side.workers, side.producer_scheduled(),
                          side.num_tokens, side.tp)
    assert result.payload is None
    assert "(pp 1, tp 0) reported the request twice" in result.reason
    # The same records without the duplicate do make a payload.
    assert sum_producer(records, REQ, side.workers, side.producer_scheduled(), side.num_tokens,
                        side.tp).payload is not None


# -- (c) a mismatch wins over unverified groups --------------------------------


def test_mismatch_in_the_higher_group_wins_over_an_unverified_lower_group():
    # Group 0's layers differ by fingerprint (unverified); group 1 holds a
    # corrupted token 80 (block 5).
    other = replace(MODEL, layer_fingerprints=(5,) + MODEL.layer_fingerprints[1:])
    side = Side()
    records = side_records(side, producer=False, model=other,
                           corruptions=(Corruption(3, 0, 80),))
    verdict = consume(side, produce(side), records)
    assert verdict.status is CheckStatus.MISMATCH, verdict.describe()
    assert verdict.mismatched_blocks == {1: (5,)}
    assert verdict.groups[0].reason_key is UnverifiedReason.FINGERPRINT_DIFFERS
    message = verdict.describe()
    assert message.startswith(f"KV checksum mismatch for request {REQ!r}")
    assert message.index("group 1 differs at block positions 5") < message.index(
        "group 0 unverified")


def test_mismatch_wins_over_a_group_missing_from_the_payload():
    side = Side(tp=2)
    payload = with_group(produce(side), 1, drop=True)
    verdict = consume(side, payload, corruptions=(Corruption(1, 2, 17), Corruption(2, 1, 70)))
    assert verdict.status is CheckStatus.MISMATCH, verdict.describe()
    assert verdict.mismatched_blocks == {0: (1, 4)}
    assert verdict.reason_keys == (UnverifiedReason.NOT_CHECKSUMMED_BY_PRODUCER,)


def test_mismatch_in_the_higher_group_wins_over_a_lower_group_missing_from_the_payload():
    side = Side(tp=2, pp=2)
    payload = with_group(produce(Side()), 0, drop=True)
    verdict = consume(side, payload, corruptions=(Corruption(3, 0, 99),))  # last block, 4 tokens
    assert verdict.status is CheckStatus.MISMATCH, verdict.describe()
    assert verdict.mismatched_blocks == {1: (6,)}
    assert verdict.reason_keys == (UnverifiedReason.NOT_CHECKSUMMED_BY_PRODUCER,)
    message = verdict.describe()
    assert message.index("group 1 differs at block positions 6") < message.index(
        "group 0 unverified: not checksummed by the producer")


# -- (d) the producer sums replica 0 only --------------------------------------


def replicated_producer_records(side: Side):
    """Producer records that list every copy, copy 1 of the replicated layer garbled.

    At TP2, layer 3 (group 1, one KV head) is replicated: rank 0 holds copy
    (2, 0), rank 1 copy (2, 1).
    """
    records = side_records(side, producer=False)
    garbage = np.arange(1, side.num_blocks(1) + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    assert set(records[1].requests[REQ][1].partials) == {(2, 1)}
    records[1].requests[REQ][1].partials[(2, 1)] = garbage
    return records


def test_producer_value_is_the_sum_of_replica_0_partials_only():
    side = Side(tp=2)
    records = replicated_producer_records(side)
    assert set(records[0].requests[REQ][1].partials) == {(2, 0)}
    result = sum_producer(records, REQ, side.workers, side.producer_scheduled(), side.num_tokens,
                          side.tp)
    assert result.payload is not None, result.reason
    for group in (0, 1):
        replica_0 = sum(values for r in records
                        for (_, copy), values in r.requests[REQ][group].partials.items()
                        if copy == 0)
        assert np.array_equal(result.payload.groups[group].values, replica_0)
    # Layer 3's one head, once: the model's value of group 1.
    whole = block_sums(MODEL.token_values[3, 0, :side.num_tokens], 16, 0, side.num_blocks(1))
    assert np.array_equal(result.payload.groups[1].values, whole)


@pytest.mark.parametrize("copy", [0, 1])
def test_consumer_copy_corruption_is_a_mismatch_against_a_replica_0_payload(copy):
    side = Side(tp=2)
    payload = produce(side, replicated_producer_records(side))
    assert consume(side, payload).status is CheckStatus.VERIFIED
    verdict = consume(side, payload, corruptions=(Corruption(3, 0, 60, copy=copy),))
    assert verdict.status is CheckStatus.MISMATCH, verdict.describe()
    assert verdict.mismatched_blocks == {1: (3,)}
    assert verdict.groups[0].status is CheckStatus.VERIFIED


# -- (e) groups only one side checksummed --------------------------------------


def test_group_no_consumer_worker_reported_is_not_checksummed_by_consumer():
    # PP2: group 1 (layer 3) lives on stage 1, which reports the request
    # without that group and without skipping it.
    side = Side(pp=2)
    records = side_records(side, producer=False)
    del records[1].requests[REQ][1]
    verdict = consume(side, produce(Side()), records)
    assert_unverified(verdict, UnverifiedReason.NOT_CHECKSUMMED_BY_CONSUMER, group=1)
    assert verdict.groups[0].status is CheckStatus.VERIFIED
    assert "group 1 unverified: no consumer worker checksummed it" in verdict.describe()


def test_group_missing_from_the_payload_is_not_checksummed_by_producer():
    side = Side(tp=2, pp=2)
    payload = with_group(produce(side), 0, drop=True)
    verdict = consume(side, payload)
    assert_unverified(verdict, UnverifiedReason.NOT_CHECKSUMMED_BY_PRODUCER, group=0)
    assert verdict.groups[1].status is CheckStatus.VERIFIED
    assert "group 0 unverified: not checksummed by the producer" in verdict.describe()


# -- (f) after a local prefix hit ----------------------------------------------


def prefix_hit_case():
    """Producer blocks [0, 5), consumer blocks [2, 5), of 16 tokens (77 tokens)."""
    producer = Side(num_tokens=77)
    consumer = Side(num_tokens=77, starts={0: 2, 1: 2})
    assert consumer.num_blocks(0) == 3
    payload = produce(producer)
    # Producer positions 0 and 1 equal nothing the consumer holds.
    for group in (0, 1):
        values = payload.groups[group].values.copy()
        values[:2] = np.array([0xDEAD, 0xBEEF], dtype=np.uint64)
        payload = with_group(payload, group, values=values)
    return consumer, payload


def test_prefix_hit_compares_only_the_loaded_positions():
    consumer, payload = prefix_hit_case()
    verdict = consume(consumer, payload)
    assert verdict.status is CheckStatus.VERIFIED, verdict.describe()
    assert [verdict.groups[g].compared_blocks for g in (0, 1)] == [3, 3]


def test_prefix_hit_reports_a_corrupted_block_at_its_consumer_position():
    consumer, payload = prefix_hit_case()
    verdict = consume(consumer, payload, corruptions=(Corruption(2, 1, 50),))  # block 3
    assert verdict.status is CheckStatus.MISMATCH, verdict.describe()
    assert verdict.mismatched_blocks == {0: (3,)}
    assert verdict.groups[0].compared_blocks == 3
    assert verdict.groups[1].status is CheckStatus.VERIFIED
    assert "block positions 3 (1 of 3 compared)" in verdict.describe()

