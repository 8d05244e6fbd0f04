"""Summing the producer's records and comparing the consumer's against them.

Records are built by hand from an explicit model of the KV: a value per
(layer, KV head, token), a block's value being the sum over its tokens
(the definition's checksums add up over consecutive blocks like this).
Each side splits the layers over PP stages and the heads over TP ranks as
vLLM does: a layer with fewer KV heads than TP ranks has each head
replicated, and a rank holding copy i of a head replicated R times reports
its sum under the key (R, i). Producer ranks compute copy 0 only.
"""

from __future__ import annotations

import tracemalloc
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_kvchecksum.core import compare as compare_module
from vllm_kvchecksum.core.compare import ConsumerGroupBlocks, compare_load, sum_producer
from vllm_kvchecksum.core.verdicts import CheckStatus, LoadVerdict, UnverifiedReason
from vllm_kvchecksum.core.payload import KVChecksumPayload, PayloadGroup
from vllm_kvchecksum.core.records import GroupChecksums, KVChecksumRecord

MOD = 2**64
REQ = "req-1"
MAX_TOKENS = 256

# Layers 0-2 form group 0 (full attention), layer 3 group 1 (say, a sliding
# window). Head counts differ so a TP4 side mixes keys (1, 0), (2, i), (4, i).
GROUP_OF_LAYER = (0, 0, 0, 1)
HEADS_OF_LAYER = (2, 4, 2, 1)
GROUPS = (0, 1)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Model:
    """The KV of one request: token_values[layer, head, token]."""

    token_values: np.ndarray
    layer_fingerprints: tuple[int, ...]


def make_model(seed: int = 0) -> Model:
    rng = np.random.default_rng(seed)
    values = rng.integers(0, MOD, size=(len(GROUP_OF_LAYER), max(HEADS_OF_LAYER), MAX_TOKENS),
                          dtype=np.uint64, endpoint=False)
    fingerprints = tuple(int(f) for f in rng.integers(0, MOD, size=len(GROUP_OF_LAYER),
                                                      dtype=np.uint64, endpoint=False))
    return Model(values, fingerprints)


MODEL = make_model()


class Corruption(NamedTuple):
    """Change the value of one token of one layer's head, in one replica copy."""

    layer: int
    head: int
    token: int
    copy: int = 0
    delta: int = 1


@dataclass
class Side:
    """One side's layout and the blocks it checksums."""

    tp: int = 1
    pp: int = 1
    block_size: int = 16
    num_tokens: int = 100
    starts: dict[int, int] = field(default_factory=dict)  # first block position per group
    skipped: frozenset[int] = frozenset()

    @property
    def workers(self) -> int:
        return self.tp * self.pp

    def start(self, group: int) -> int:
        return self.starts.get(group, 0)

    def num_blocks(self, group: int) -> int:
        return cdiv(self.num_tokens, self.block_size) - self.start(group)

    def producer_scheduled(self) -> dict[int, tuple[int, int]]:
        return {g: (self.start(g), self.num_blocks(g)) for g in GROUPS}

    def consumer_scheduled(self) -> dict[int, ConsumerGroupBlocks]:
        return {g: ConsumerGroupBlocks(self.start(g), self.num_blocks(g), self.block_size)
                for g in GROUPS}


def heads_held(layer: int, tp: int, tp_rank: int) -> list[tuple[int, int, int]]:
    """(head, replicas, copy) of each of the layer's KV heads on a TP rank."""
    heads = HEADS_OF_LAYER[layer]
    if heads >= tp:
        per_rank = heads // tp
        return [(h, 1, 0) for h in range(tp_rank * per_rank, (tp_rank + 1) * per_rank)]
    replicas = tp // heads
    return [(tp_rank // replicas, replicas, tp_rank % replicas)]


def block_sums(tokens: np.ndarray, block_size: int, start: int, num_blocks: int) -> np.ndarray:
    padded = np.zeros(cdiv(len(tokens), block_size) * block_size, dtype=np.uint64)
    padded[:len(tokens)] = tokens
    return padded.reshape(-1, block_size).sum(axis=1, dtype=np.uint64)[start:start + num_blocks]


def side_records(side: Side, *, producer: bool, model: Model = MODEL,
                 corruptions: tuple[Corruption, ...] = ()) -> list[KVChecksumRecord]:
    """Every worker's record of the request, as the workers would report it."""
    records = []
    stages = np.array_split(np.arange(len(GROUP_OF_LAYER)), side.pp)
    for pp_rank, stage_layers in enumerate(stages):
        for tp_rank in range(side.tp):
            groups, fingerprints, skipped = {}, {}, {}
            for group in GROUPS:
                layers = [int(l) for l in stage_layers if GROUP_OF_LAYER[l] == group]
                if not layers:
                    continue
                if group in side.skipped:
                    skipped[group] = "not checksummable (test)"
                    continue
                fingerprints[group] = sum(model.layer_fingerprints[l] for l in layers) % MOD
                partials: dict[tuple[int, int], np.ndarray] = {}
                for layer in layers:
                    for head, replicas, copy in heads_held(layer, side.tp, tp_rank):
                        if producer and copy != 0:
                            continue
                        tokens = model.token_values[layer, head, :side.num_tokens].copy()
                        for c in corruptions:
                            if (c.layer, c.head, c.copy) == (layer, head, copy):
                                tokens[c.token:c.token + 1] += np.uint64(c.delta)
                        values = block_sums(tokens, side.block_size, side.start(group),
                                            side.num_blocks(group))
                        key = (replicas, copy)
                        partials[key] = partials.get(key, np.zeros_like(values)) + values
                groups[group] = GroupChecksums(side.start(group), side.num_blocks(group),
                                               side.block_size, partials)
            records.append(KVChecksumRecord(
                tp_rank=tp_rank, tp_size=side.tp, pp_rank=pp_rank, pp_size=side.pp,
                fingerprints=fingerprints, skipped_groups=skipped,
                requests={REQ: groups}, num_tokens={REQ: side.num_tokens}))
    return records


def produce(side: Side, records: list[KVChecksumRecord] | None = None) -> KVChecksumPayload:
    """The payload the producer sends, through its wire format."""
    if records is None:
        records = side_records(side, producer=True)
    result = sum_producer(records, REQ, side.workers, side.producer_scheduled(),
                          side.num_tokens, side.tp)
    assert result.payload is not None, result.reason
    return KVChecksumPayload.decode(result.payload.encode())


def consume(side: Side, payload: KVChecksumPayload | None,
            records: list[KVChecksumRecord] | None = None,
            corruptions: tuple[Corruption, ...] = ()) -> LoadVerdict:
    if records is None:
        records = side_records(side, producer=False, corruptions=corruptions)
    return compare_load(payload, records, REQ, side.workers, side.consumer_scheduled(),
                        side.num_tokens)


def transfer(producer: Side, consumer: Side,
             corruptions: tuple[Corruption, ...] = ()) -> LoadVerdict:
    return consume(consumer, produce(producer), corruptions=corruptions)


def assert_verified(verdict: LoadVerdict, groups=GROUPS):
    assert verdict.status is CheckStatus.VERIFIED, verdict.describe()
    assert sorted(verdict.groups) == sorted(groups)
    assert verdict.reason_keys == ()


def assert_unverified(verdict: LoadVerdict, key: UnverifiedReason, group: int | None = None):
    assert verdict.status is CheckStatus.UNVERIFIED, verdict.describe()
    if group is None:
        assert verdict.reason_key is key and not verdict.groups, verdict.describe()
    else:
        assert verdict.groups[group].reason_key is key, verdict.describe()
    assert key in verdict.reason_keys


# -- layouts ------------------------------------------------------------------

LAYOUTS = [((1, 1), (1, 1)), ((2, 1), (1, 1)), ((1, 1), (2, 1)), ((1, 1), (4, 1)),
           ((1, 2), (1, 1)), ((1, 1), (2, 2)), ((4, 1), (1, 1)), ((2, 2), (4, 2)),
           ((4, 2), (2, 1))]
LAYOUT_IDS = [f"P-tp{p[0]}pp{p[1]}-D-tp{c[0]}pp{c[1]}" for p, c in LAYOUTS]


@pytest.mark.parametrize("producer, consumer", LAYOUTS, ids=LAYOUT_IDS)
def test_correct_load_verifies_across_layouts(producer, consumer):
    verdict = transfer(Side(*producer), Side(*consumer))
    assert_verified(verdict)
    assert verdict.groups[0].compared_blocks == cdiv(100, 16)
    assert "verified" in verdict.describe()


def test_tp4_consumer_reports_replica_keys():
    keys = {g: set() for g in GROUPS}
    for record in side_records(Side(tp=4), producer=False):
        for group, checksums in record.requests[REQ].items():
            keys[group] |= set(checksums.partials)
    assert keys[0] == {(1, 0), (2, 0), (2, 1)}
    assert keys[1] == {(4, 0), (4, 1), (4, 2), (4, 3)}


@pytest.mark.parametrize("producer, consumer", LAYOUTS, ids=LAYOUT_IDS)
def test_one_corrupted_value_is_a_mismatch_at_its_block(producer, consumer):
    consumer = Side(*consumer)
    corruption = Corruption(layer=1, head=3, token=37)  # block 2
    verdict = transfer(Side(*producer), consumer, corruptions=(corruption,))
    assert verdict.status is CheckStatus.MISMATCH
    assert verdict.mismatched_blocks == {0: (2,)}
    assert verdict.groups[1].status is CheckStatus.VERIFIED
    message = verdict.describe()
    assert REQ in message and "group 0" in message and "block positions 2" in message


def test_producer_fingerprint_sums_pp_stages_once_per_stage():
    payload = produce(Side(tp=2, pp=2))
    for group in GROUPS:
        layers = [l for l, g in enumerate(GROUP_OF_LAYER) if g == group]
        assert payload.groups[group].fingerprint == \
            sum(MODEL.layer_fingerprints[l] for l in layers) % MOD
    assert payload.producer_tp_size == 2 and payload.num_tokens == 100


def test_producer_value_is_the_whole_models_block_sums():
    payload = produce(Side(tp=4, pp=2))
    whole = np.zeros(cdiv(100, 16), dtype=np.uint64)
    for layer in (0, 1, 2):
        for head in range(HEADS_OF_LAYER[layer]):
            whole += block_sums(MODEL.token_values[layer, head, :100], 16, 0, len(whole))
    assert np.array_equal(payload.groups[0].values, whole)


def test_producer_ignores_copies_other_than_replica_0():
    side = Side(tp=4)
    records = side_records(side, producer=True)
    extra = side_records(side, producer=False)  # every copy present
    assert produce(side, extra) == produce(side, records)


# -- which positions ----------------------------------------------------------


def test_local_prefix_hit_compares_only_loaded_blocks():
    consumer = Side(starts={0: 3, 1: 3})
    # A corrupted token inside the local prefix is not part of the load.
    verdict = transfer(Side(), consumer, corruptions=(Corruption(0, 0, 20),))
    assert_verified(verdict)
    assert verdict.groups[0].compared_blocks == cdiv(100, 16) - 3
    verdict = transfer(Side(), consumer, corruptions=(Corruption(0, 0, 50),))
    assert verdict.mismatched_blocks == {0: (3,)}


def test_producer_covering_fewer_loaded_blocks_is_unverified():
    # A producer (or a client editing its payload) whose values start later
    # than the consumer's loaded blocks: the blocks both hold are compared,
    # but "verified" must cover every loaded block.
    verdict = transfer(Side(starts={1: 4}), Side())
    assert_unverified(verdict, UnverifiedReason.NOT_COVERED_BY_PRODUCER, group=1)
    assert verdict.groups[0].status is CheckStatus.VERIFIED
    # A mismatch in what is compared is still a mismatch.
    verdict = transfer(Side(starts={1: 4}), Side(), corruptions=(Corruption(3, 0, 85),))
    assert verdict.mismatched_blocks == {1: (5,)}


def test_last_block_compared_only_with_equal_token_counts():
    # The consumer's last block holds 3 tokens, the producer's 4: not
    # comparable, so the load is not verified whole.
    verdict = transfer(Side(num_tokens=100), Side(num_tokens=99))
    assert_unverified(verdict, UnverifiedReason.NOT_COVERED_BY_PRODUCER, group=0)
    # The last block with equal counts is compared, and a change there caught.
    verdict = transfer(Side(num_tokens=100), Side(num_tokens=100),
                       corruptions=(Corruption(0, 1, 99),))
    assert verdict.mismatched_blocks == {0: (6,)}


def test_consumer_with_full_last_block_compares_it():
    verdict = transfer(Side(num_tokens=97), Side(num_tokens=96))
    assert_verified(verdict)
    assert verdict.groups[0].compared_blocks == 6


def test_nothing_in_common_is_unverified():
    verdict = transfer(Side(num_tokens=100), Side(num_tokens=99, starts={0: 6, 1: 6}))
    assert_unverified(verdict, UnverifiedReason.NO_COMMON_BLOCKS, group=0)
    verdict = transfer(Side(starts={1: 6}), Side(num_tokens=96, starts={1: 2}))
    assert_unverified(verdict, UnverifiedReason.NO_COMMON_BLOCKS, group=1)


# -- block sizes --------------------------------------------------------------


@pytest.mark.parametrize("producer_bs, consumer_bs", [(16, 32), (32, 16), (16, 64), (64, 16)])
@pytest.mark.parametrize("num_tokens", [100, 128, 97])
def test_different_block_sizes_verify(producer_bs, consumer_bs, num_tokens):
    verdict = transfer(Side(block_size=producer_bs, num_tokens=num_tokens),
                       Side(block_size=consumer_bs, num_tokens=num_tokens))
    assert_verified(verdict)
    assert verdict.groups[0].compared_blocks == cdiv(num_tokens, consumer_bs)


@pytest.mark.parametrize("producer_bs, consumer_bs, token, expected", [
    (16, 32, 37, (1,)),  # consumer block 1 holds tokens 32-63
    (32, 16, 37, (2, 3)),  # both 16-token blocks of producer block 1
    (16, 32, 99, (3,)),  # the partial last block
    (32, 16, 99, (6,)),  # the last chunk: consumer blocks 6 (and 7, past the last token)
    (16, 64, 70, (1,)),
    (64, 16, 70, (4, 5, 6)),  # chunk 1 holds consumer blocks 4-7; block 7 is past token 99
])
def test_different_block_sizes_catch_a_corrupted_value(producer_bs, consumer_bs, token,
                                                       expected):
    verdict = transfer(Side(block_size=producer_bs), Side(block_size=consumer_bs),
                       corruptions=(Corruption(2, 0, token),))
    assert verdict.status is CheckStatus.MISMATCH
    assert verdict.mismatched_blocks == {0: expected}


def test_smaller_consumer_blocks_after_an_aligned_prefix_hit_verify():
    verdict = transfer(Side(block_size=32), Side(block_size=16, starts={0: 2, 1: 2}))
    assert_verified(verdict)
    assert verdict.groups[0].compared_blocks == cdiv(100, 16) - 2


def test_larger_consumer_blocks_after_a_prefix_hit_verify():
    verdict = transfer(Side(block_size=16), Side(block_size=32, starts={0: 1, 1: 1}))
    assert_verified(verdict)


def test_consumer_block_starting_inside_a_producer_block_is_unverified():
    verdict = transfer(Side(block_size=32), Side(block_size=16, starts={0: 1, 1: 1}))
    assert_unverified(verdict, UnverifiedReason.UNALIGNED_FIRST_BLOCK, group=0)
    assert "starts inside producer block 0" in verdict.describe()


def test_block_sizes_not_multiples_are_unverified():
    verdict = transfer(Side(block_size=16), Side(block_size=24))
    assert_unverified(verdict, UnverifiedReason.BLOCK_SIZES_NOT_MULTIPLES, group=0)


# -- replicas -----------------------------------------------------------------


def test_corrupted_replica_copy_fails():
    # Layer 0 has 2 KV heads; on TP4 rank 1 holds copy 1 of head 0.
    verdict = transfer(Side(), Side(tp=4), corruptions=(Corruption(0, 0, 5, copy=1),))
    assert verdict.mismatched_blocks == {0: (0,)}
    # Layer 3's single head is replicated 4 times; corrupt copy 3.
    verdict = transfer(Side(), Side(tp=4), corruptions=(Corruption(3, 0, 80, copy=3),))
    assert verdict.mismatched_blocks == {1: (5,)}


def drop_partial(records, key, ranks):
    for record in records:
        if record.tp_rank in ranks:
            record.requests[REQ][0].partials.pop(key, None)
    return records


def test_missing_replica_is_unverified():
    side = Side(tp=4)
    records = drop_partial(side_records(side, producer=False), (2, 1), ranks={1, 3})
    verdict = consume(side, produce(Side()), records)
    assert_unverified(verdict, UnverifiedReason.MISSING_REPLICA, group=0)
    assert verdict.groups[1].status is CheckStatus.VERIFIED


def test_replica_missing_on_one_rank_is_not_verified():
    side = Side(tp=4)
    records = drop_partial(side_records(side, producer=False), (2, 1), ranks={1})
    verdict = consume(side, produce(Side()), records)
    assert verdict.status is CheckStatus.MISMATCH


# -- fingerprints -------------------------------------------------------------


def test_other_layers_are_unverified_by_fingerprint():
    other = replace(MODEL, layer_fingerprints=(1,) + MODEL.layer_fingerprints[1:])
    side = Side()
    verdict = consume(side, produce(side), side_records(side, producer=False, model=other))
    assert_unverified(verdict, UnverifiedReason.FINGERPRINT_DIFFERS, group=0)
    assert "other layers or dtypes" in verdict.describe()


# -- skipped groups -----------------------------------------------------------


def test_group_skipped_on_both_sides_is_left_out():
    verdict = transfer(Side(tp=2, skipped=frozenset({1})), Side(pp=2, skipped=frozenset({1})))
    assert_verified(verdict, groups=(0,))


def test_group_skipped_by_the_producer_only_is_unverified():
    producer = Side(skipped=frozenset({1}))
    assert 1 not in produce(producer).groups
    verdict = transfer(producer, Side())
    assert_unverified(verdict, UnverifiedReason.NOT_CHECKSUMMED_BY_PRODUCER, group=1)
    assert verdict.groups[0].status is CheckStatus.VERIFIED


def test_group_skipped_by_the_consumer_only_is_unverified():
    verdict = transfer(Side(), Side(skipped=frozenset({1})))
    assert_unverified(verdict, UnverifiedReason.SKIPPED_BY_CONSUMER, group=1)


def test_group_skipped_by_one_producer_worker_is_left_out_of_the_payload():
    side = Side(tp=2)
    records = side_records(side, producer=True)
    records[1].skipped_groups[1] = "cannot (test)"
    del records[1].requests[REQ][1]
    result = sum_producer(records, REQ, 2, side.producer_scheduled(), 100, 2)
    assert sorted(result.payload.groups) == [0]


def test_every_group_skipped_is_unverified():
    everything = frozenset(GROUPS)
    verdict = transfer(Side(skipped=everything), Side(skipped=everything))
    assert_unverified(verdict, UnverifiedReason.NO_GROUPS)


def test_group_in_the_payload_the_consumer_did_not_checksum_is_unverified():
    payload = produce(Side())
    groups = dict(payload.groups)
    groups[5] = PayloadGroup(fingerprint=1, block_size=16, start=0,
                             values=np.zeros(2, dtype=np.uint64))
    payload = KVChecksumPayload(num_tokens=100, producer_tp_size=1, groups=groups)
    verdict = consume(Side(), payload)
    assert_unverified(verdict, UnverifiedReason.NOT_CHECKSUMMED_BY_CONSUMER, group=5)


# -- the whole load -----------------------------------------------------------


def test_missing_worker_is_unverified():
    side = Side(tp=2, pp=2)
    records = side_records(side, producer=False)
    verdict = consume(side, produce(Side()), records[:2] + records[3:])
    assert_unverified(verdict, UnverifiedReason.MISSING_WORKERS)
    assert "3 of 4 workers" in verdict.describe() and "(pp 1, tp 0)" in verdict.describe()


def test_no_worker_reporting_is_unverified():
    verdict = consume(Side(), produce(Side()), [])
    assert_unverified(verdict, UnverifiedReason.MISSING_WORKERS)


def test_worker_reporting_twice_is_unverified():
    side = Side(tp=2)
    records = side_records(side, producer=False)
    verdict = consume(side, produce(Side()), records + records[:1])
    assert_unverified(verdict, UnverifiedReason.MALFORMED_RECORD)


def test_a_worker_the_engine_does_not_have_is_a_malformed_record():
    """A record from a TP rank past the engine's TP size is no late worker a
    retry would wait for (missing_workers, retried): it is malformed, whether
    every real worker reported too or one of them is missing."""
    side = Side(tp=2)
    records = side_records(side, producer=False)
    stranger = replace(records[1], tp_rank=2)
    for reported in (records + [stranger], records[:1] + [stranger]):
        verdict = consume(side, produce(Side()), reported)
        assert_unverified(verdict, UnverifiedReason.MALFORMED_RECORD)
        assert "(pp 0, tp 2)" in verdict.describe() and "2 workers" in verdict.describe()
    # Only missing ones are missing workers.
    assert_unverified(consume(side, produce(Side()), records[:1]), UnverifiedReason.MISSING_WORKERS)


@pytest.mark.parametrize("key", [(1, 1), (2, 2), (1, -1), (0, 0)])
def test_a_partial_key_that_names_no_copy_is_a_malformed_record(key):
    """A copy index must be one of its R copies (0 <= i < R): a key (R, R)
    is no copy, and must not be summed into nothing and left out of every
    check while the rest verifies."""
    side = Side()
    records = side_records(side, producer=False)
    group = records[0].requests[REQ][0]
    values = next(iter(group.partials.values()))
    records[0].requests[REQ][0] = replace(group, partials={**group.partials, key: values + np.uint64(1)})
    verdict = consume(side, produce(side), records)
    assert_unverified(verdict, UnverifiedReason.MALFORMED_RECORD)
    assert "partial key" in verdict.describe()


@pytest.mark.parametrize("claimed", [True, False, 1.0, np.int64(1)])
def test_a_connector_tp_size_that_is_no_int_is_never_taken_for_one(claimed):
    """bool is an int subclass: True must not pass for TP size 1."""
    side = Side()
    verdict = compare_load(produce(side), side_records(side, producer=False), REQ, side.workers,
                           side.consumer_scheduled(), side.num_tokens, producer_tp_size=claimed)
    assert_unverified(verdict, UnverifiedReason.PRODUCER_TP_SIZE_DIFFERS)
    assert_verified(compare_load(produce(side), side_records(side, producer=False), REQ, side.workers,
                                 side.consumer_scheduled(), side.num_tokens, producer_tp_size=1))


def test_records_of_other_requests_are_ignored():
    side = Side(tp=2)
    records = side_records(side, producer=False)
    stray = replace(records[0], requests={"other": {}}, num_tokens={})
    assert_verified(consume(side, produce(Side()), records + [stray]))


def test_other_blocks_than_scheduled_are_unverified():
    side = Side(tp=2)
    records = side_records(side, producer=False)
    records[1].requests[REQ][0] = replace(records[1].requests[REQ][0], start=1,
                                          num_blocks=cdiv(100, 16) - 1)
    verdict = consume(side, produce(Side()), records)
    assert_unverified(verdict, UnverifiedReason.UNSCHEDULED_BLOCKS)
    assert "(pp 0, tp 1)" in verdict.describe()


def test_other_tokens_than_scheduled_are_unverified():
    side = Side()
    records = side_records(side, producer=False)
    records[0].num_tokens[REQ] = 99
    assert_unverified(consume(side, produce(side), records), UnverifiedReason.UNSCHEDULED_BLOCKS)


def test_other_block_size_than_scheduled_is_unverified():
    side = Side()
    records = side_records(side, producer=False)
    records[0].requests[REQ][1] = replace(records[0].requests[REQ][1], block_size=32)
    assert_unverified(consume(side, produce(side), records), UnverifiedReason.UNSCHEDULED_BLOCKS)


def test_missing_checksums_are_unverified_with_the_given_reason():
    verdict = compare_load(None, side_records(Side(), producer=False), REQ, 1,
                           Side().consumer_scheduled(), 100,
                           missing_reason="invalid kv_checksums: bad base64")
    assert_unverified(verdict, UnverifiedReason.NO_PRODUCER_CHECKSUMS)
    assert "bad base64" in verdict.describe() and REQ in verdict.describe()


def test_mismatch_wins_over_unverified_groups():
    verdict = transfer(Side(), Side(skipped=frozenset({1})),
                       corruptions=(Corruption(0, 0, 40), Corruption(0, 0, 41)))
    assert verdict.status is CheckStatus.MISMATCH
    assert verdict.groups[1].status is CheckStatus.UNVERIFIED
    assert verdict.reason_keys == (UnverifiedReason.SKIPPED_BY_CONSUMER,)
    message = verdict.describe()
    assert message.index("group 0 differs at block positions 2") < message.index(
        "group 1 unverified")


def test_describe_lists_positions_as_ranges():
    corruptions = tuple(Corruption(0, 0, t) for t in (5, 40, 60, 70))
    verdict = transfer(Side(), Side(), corruptions=corruptions)
    assert verdict.mismatched_blocks == {0: (0, 2, 3, 4)}
    assert "block positions 0, 2-4 (4 of 7 compared)" in verdict.describe()


# -- the producer refusing to send --------------------------------------------


def test_producer_with_a_missing_worker_sends_nothing():
    side = Side(pp=2)
    records = side_records(side, producer=True)[:1]
    result = sum_producer(records, REQ, 2, side.producer_scheduled(), 100, 1)
    assert result.payload is None and "missing (pp 1, tp 0)" in result.reason


def test_producer_with_other_blocks_than_scheduled_sends_nothing():
    side = Side(tp=2)
    scheduled = side.producer_scheduled()
    scheduled[0] = (0, 6)
    result = sum_producer(side_records(side, producer=True), REQ, 2, scheduled, 100, 2)
    assert result.payload is None and "blocks [0, 7) of group 0" in result.reason


def test_producer_with_other_tp_size_sends_nothing():
    side = Side(tp=2)
    result = sum_producer(side_records(side, producer=True), REQ, 2,
                          side.producer_scheduled(), 100, 1)
    assert result.payload is None and "tp_size" in result.reason


# -- properties ---------------------------------------------------------------

BLOCK_SIZE_PAIRS = [(16, 16), (16, 32), (32, 16), (16, 64), (64, 16), (32, 32), (32, 64)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(LAYOUTS), st.sampled_from(BLOCK_SIZE_PAIRS), st.integers(1, MAX_TOKENS),
       st.data())
def test_random_loads_verify_and_corruptions_are_located(layouts, block_sizes, num_tokens,
                                                         data):
    (p_tp, p_pp), (c_tp, c_pp) = layouts
    p_bs, c_bs = block_sizes
    chunk = max(p_bs, c_bs)
    # A local prefix hit aligned to the larger block size, loading at least one token.
    prefix_chunks = data.draw(st.integers(0, (num_tokens - 1) // chunk))
    start = prefix_chunks * chunk // c_bs
    producer = Side(p_tp, p_pp, p_bs, num_tokens)
    consumer = Side(c_tp, c_pp, c_bs, num_tokens, starts={0: start, 1: start})
    payload = produce(producer)
    assert_verified(consume(consumer, payload))

    layer = data.draw(st.integers(0, len(GROUP_OF_LAYER) - 1))
    head = data.draw(st.integers(0, HEADS_OF_LAYER[layer] - 1))
    copies = max(1, c_tp // HEADS_OF_LAYER[layer])
    token = data.draw(st.integers(start * c_bs, num_tokens - 1))
    corruption = Corruption(layer, head, token, copy=data.draw(st.integers(0, copies - 1)),
                            delta=data.draw(st.integers(1, MOD - 1)))
    verdict = consume(consumer, payload, corruptions=(corruption,))
    group = GROUP_OF_LAYER[layer]
    chunk_index = token // chunk
    expected = tuple(b for b in range(chunk_index * chunk // c_bs,
                                      (chunk_index + 1) * chunk // c_bs)
                     if start <= b < cdiv(num_tokens, c_bs))
    assert verdict.mismatched_blocks == {group: expected}, verdict.describe()


# -- size ---------------------------------------------------------------------


def test_long_prompt_compares_quickly():
    """A 128K-token prompt: 8192 blocks per group, 4 groups, TP4 consumer replicas."""
    num_tokens, block_size, groups = 131072, 16, (0, 1, 2, 3)
    blocks = num_tokens // block_size
    rng = np.random.default_rng(1)
    copy_values = {g: rng.integers(0, MOD, size=blocks, dtype=np.uint64, endpoint=False)
                   for g in groups}
    records = []
    for tp_rank in range(4):
        requests = {g: GroupChecksums(0, blocks, block_size,
                                      {(4, tp_rank): copy_values[g].copy()}) for g in groups}
        records.append(KVChecksumRecord(tp_rank, 4, 0, 1, {g: 7 for g in groups}, {},
                                        {REQ: requests}, {REQ: num_tokens}))
    payload = KVChecksumPayload(num_tokens, 1, {
        g: PayloadGroup(7, 2 * block_size, 0, copy_values[g].reshape(-1, 2).sum(
            axis=1, dtype=np.uint64)) for g in groups})
    scheduled = {g: (0, blocks, block_size) for g in groups}
    # Its speed is measured by scripts/bench_scheduler.py, not asserted here.
    verdict = compare_load(payload, records, REQ, 4, scheduled, num_tokens)
    assert_verified(verdict, groups=groups)
    assert verdict.groups[0].compared_blocks == blocks


# -- hostile payloads -----------------------------------------------------------
# A client can send any payload the decoder accepts: the comparison's
# memory must follow the consumer's blocks, never a payload value.

# Far more than comparing a consumer's 7 blocks needs (a few KiB), far less
# than anything sized by a payload value.
MAX_COMPARE_BYTES = 2**20


def compare_peak_bytes(payload: KVChecksumPayload, side: Side,
                       corruptions: tuple[Corruption, ...] = ()) -> tuple[LoadVerdict, int]:
    """consume(), and the peak bytes compare_load allocated (numpy reports to tracemalloc)."""
    records = side_records(side, producer=False, corruptions=corruptions)
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    tracemalloc.reset_peak()
    baseline = tracemalloc.get_traced_memory()[0]
    try:
        verdict = consume(side, payload, records)
        return verdict, tracemalloc.get_traced_memory()[1] - baseline
    finally:
        if not was_tracing:
            tracemalloc.stop()


def with_groups(payload: KVChecksumPayload, num_tokens: int | None = None,
                **group_fields) -> KVChecksumPayload:
    """`payload` with every group's fields replaced as given."""
    groups = {g: PayloadGroup(**{**dict(fingerprint=group.fingerprint,
                                        block_size=group.block_size, start=group.start,
                                        values=group.values), **group_fields})
              for g, group in payload.groups.items()}
    return KVChecksumPayload(payload.num_tokens if num_tokens is None else num_tokens,
                             payload.producer_tp_size, groups)


@pytest.mark.parametrize("block_size", [2**36, 2**39])
def test_producer_block_far_larger_than_the_consumers_is_compared_in_bounded_memory(
        block_size):
    # One producer block holding the whole request has the same value
    # whatever its size: the sum over the request's tokens.
    whole = produce(Side(block_size=MAX_TOKENS))
    payload = with_groups(whole, block_size=block_size)
    verdict, peak = compare_peak_bytes(payload, Side())
    assert_verified(verdict)
    assert verdict.groups[0].compared_blocks == cdiv(100, 16)
    assert peak < MAX_COMPARE_BYTES
    verdict, peak = compare_peak_bytes(payload, Side(), corruptions=(Corruption(0, 0, 40),))
    assert verdict.mismatched_blocks == {0: tuple(range(cdiv(100, 16)))}
    assert peak < MAX_COMPARE_BYTES


def test_producer_blocks_past_the_consumers_are_not_materialized():
    # Per-token producer blocks, a million of them: only the consumer's
    # 100 tokens are looked at.
    per_token = produce(Side(block_size=1))
    extra = 2**20
    payload = KVChecksumPayload(extra, 1, {
        g: PayloadGroup(group.fingerprint, 1, 0, np.concatenate(
            [group.values, np.arange(extra - 100, dtype=np.uint64)]))
        for g, group in per_token.groups.items()})
    verdict, peak = compare_peak_bytes(payload, Side())
    # The last consumer block holds 4 of 16 tokens, the producer's chunk
    # there 16: not comparable, so not verified whole.
    assert_unverified(verdict, UnverifiedReason.NOT_COVERED_BY_PRODUCER, group=0)
    assert peak < MAX_COMPARE_BYTES


@pytest.mark.parametrize("block_size, start, num_blocks", [
    (1, 2**40 - 16, 7), (16, 2**36 - 7, 7), (2**39, 1, 1)])
def test_producer_blocks_far_past_the_consumers_are_unverified_in_bounded_memory(
        block_size, start, num_blocks):
    # As far as a payload can place them: the last token below 2**40.
    honest = produce(Side())
    payload = with_groups(honest, num_tokens=2**40 - 1, block_size=block_size, start=start,
                          values=np.arange(num_blocks, dtype=np.uint64))
    verdict, peak = compare_peak_bytes(payload, Side())
    assert_unverified(verdict, UnverifiedReason.NO_COMMON_BLOCKS, group=0)
    assert peak < MAX_COMPARE_BYTES


def padded_reference(producer, consumer):
    """The chunk comparison as first written, padding every side to whole chunks.

    Sized by the block size ratio, so only for small block sizes: the
    reference the bounded comparison must agree with.
    """
    def chunks(side, chunk_tokens):
        per_chunk = chunk_tokens // side.block_size
        num_blocks = side.values.shape[1]
        first = side.start // per_chunk
        end = -(-(side.start + num_blocks) // per_chunk)
        offset = side.start - first * per_chunk
        padded = np.zeros((side.values.shape[0], (end - first) * per_chunk), dtype=np.uint64)
        padded[:, offset:offset + num_blocks] = side.values
        sums = padded.reshape(side.values.shape[0], end - first, per_chunk).sum(
            axis=2, dtype=np.uint64)
        index = np.arange(first, end, dtype=np.int64)
        blocks_with_tokens = -(-side.num_tokens // side.block_size)
        low = index * per_chunk
        high = np.minimum(low + per_chunk, blocks_with_tokens)
        covered = (low >= side.start) & (high <= side.start + num_blocks) & (high > low)
        tokens = np.clip(side.num_tokens - index * chunk_tokens, 0, chunk_tokens)
        return first, sums, covered, tokens

    def positions(chunk_ids, per_chunk, start, num_blocks):
        found = (chunk_ids[:, None] * per_chunk + np.arange(per_chunk)[None, :]).ravel()
        return found[(found >= start) & (found < start + num_blocks)]

    small, large = sorted((producer.block_size, consumer.block_size))
    if large % small:
        return UnverifiedReason.BLOCK_SIZES_NOT_MULTIPLES
    per_chunk = large // consumer.block_size
    if consumer.start % per_chunk:
        return UnverifiedReason.UNALIGNED_FIRST_BLOCK
    (o_first, o_sums, o_covered, o_tokens) = chunks(consumer, large)
    (t_first, t_sums, t_covered, t_tokens) = chunks(producer, large)
    first = max(o_first, t_first)
    end = min(o_first + o_sums.shape[1], t_first + t_sums.shape[1])
    if end <= first:
        return UnverifiedReason.NO_COMMON_BLOCKS
    mine, other = slice(first - o_first, end - o_first), slice(first - t_first, end - t_first)
    compared = o_covered[mine] & t_covered[other] & (o_tokens[mine] == t_tokens[other])
    if not compared.any():
        return UnverifiedReason.NO_COMMON_BLOCKS
    differs = compared & (o_sums[:, mine] != t_sums[:, other]).any(axis=0)
    chunk_ids = np.arange(first, end, dtype=np.int64)
    count = positions(chunk_ids[compared], per_chunk, consumer.start,
                      consumer.values.shape[1]).size
    mismatched = positions(chunk_ids[differs], per_chunk, consumer.start,
                           consumer.values.shape[1])
    return tuple(int(p) for p in mismatched), int(count)


@st.composite
def block_values(draw, checks: int):
    """One side's values of one group, small enough for the padded reference.

    Values from a tiny range, so chunk sums are often equal and both
    mismatches and agreements come up.
    """
    block_size = draw(st.sampled_from([1, 2, 3, 4, 8, 16, 32]))
    num_blocks = draw(st.integers(0, 12))
    values = draw(st.lists(st.integers(0, 2), min_size=checks * num_blocks,
                           max_size=checks * num_blocks))
    return compare_module._BlockValues(
        start=draw(st.integers(0, 12)),
        values=np.array(values, dtype=np.uint64).reshape(checks, num_blocks),
        block_size=block_size, num_tokens=draw(st.integers(0, 300)))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(block_values(checks=1), st.integers(1, 3).flatmap(block_values))
def test_bounded_chunk_comparison_agrees_with_the_padded_reference(producer, consumer):
    result = compare_module._compare_chunks(producer, consumer)
    expected = padded_reference(producer, consumer)
    if isinstance(expected, UnverifiedReason):
        assert isinstance(result, compare_module._Problem) and result.key is expected, result
    else:
        assert result == expected


@st.composite
def sides_with_one_block_size(draw):
    """A producer and a consumer side of one block size (the usual P/D case,
    which _compare_chunks takes by its own shortcut)."""
    block_size = draw(st.sampled_from([1, 2, 3, 16]))
    producer = draw(block_values(checks=1))
    consumer = draw(st.integers(1, 3).flatmap(block_values))
    # Token counts around block boundaries, so the last-block rule is exercised.
    def tokens():
        return st.one_of(st.integers(0, 300),
                         st.integers(0, 14).map(lambda b: b * block_size),
                         st.integers(0, 14).map(lambda b: b * block_size + 1))
    return (producer._replace(block_size=block_size, num_tokens=draw(tokens())),
            consumer._replace(block_size=block_size, num_tokens=draw(tokens())))


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sides_with_one_block_size())
def test_the_equal_block_size_shortcut_agrees_with_the_general_comparison(sides):
    producer, consumer = sides
    result = compare_module._compare_chunks(producer, consumer)
    general = compare_module._compare_lined_up(producer, consumer)
    if isinstance(general, compare_module._Problem):
        assert isinstance(result, compare_module._Problem) and result.key is general.key, (result, general)
    else:
        assert result == general
    expected = padded_reference(producer, consumer)
    if isinstance(expected, UnverifiedReason):
        assert isinstance(result, compare_module._Problem) and result.key is expected, result
    else:
        assert result == expected


def test_windowed_group_with_larger_consumer_blocks_leaves_out_one_block_at_most():
    # Producer blocks of 8 from token 64 on; the consumer's four 32-token
    # blocks all loaded: only blocks 2 and 3 are compared. One block (the
    # window's first chunk) may be left out, not two.
    @dataclass
    class WindowedSide(Side):
        def consumer_scheduled(self):
            return {g: ConsumerGroupBlocks(self.start(g), self.num_blocks(g), self.block_size, windowed=True)
                    for g in GROUPS}

    verdict = consume(WindowedSide(block_size=32), produce(Side(block_size=8, starts={g: 8 for g in GROUPS})))
    assert_unverified(verdict, UnverifiedReason.NOT_COVERED_BY_PRODUCER, group=GROUPS[0])


def test_windowed_group_with_equal_block_sizes_leaves_out_no_block():
    # Equal block sizes clip the window at the same boundary on both sides:
    # the one-chunk slack of different sizes does not apply, and a payload
    # that leaves out the first loaded block must not verify.
    @dataclass
    class WindowedSide(Side):
        def consumer_scheduled(self):
            return {g: ConsumerGroupBlocks(self.start(g), self.num_blocks(g), self.block_size, windowed=True)
                    for g in GROUPS}

    verdict = consume(WindowedSide(), produce(Side(starts={g: 1 for g in GROUPS})))
    assert_unverified(verdict, UnverifiedReason.NOT_COVERED_BY_PRODUCER, group=GROUPS[0])
    assert "cover 6 of the 7 loaded blocks" in verdict.describe()
    assert_verified(consume(WindowedSide(), produce(Side())))


@pytest.mark.parametrize("ranges, cut", [(15, False), (16, False), (17, True)])
def test_positions_are_cut_only_past_sixteen_ranges(ranges, cut):
    from vllm_kvchecksum.core.verdicts import format_positions

    text = format_positions([3 * i for i in range(ranges)])
    assert text.endswith(", ...") is cut
    shown = text.removesuffix(", ...").split(", ")
    assert shown == [str(3 * i) for i in range(min(ranges, 16))]
