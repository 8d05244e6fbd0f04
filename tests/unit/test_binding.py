"""Binding P/D checksums to the request content they were computed for.

core/binding.py's hashes and runs, and compare_load with a consumer's own
content: another request's KV sent with that request's (matching)
checksums is a mismatch of its own cause, at the blocks from the first
differing token on; the same content verifies at any block sizes; a payload
bound to nothing never verifies.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_kvchecksum.core.binding import MultimodalSpan, TokenContent, first_difference
from vllm_kvchecksum.core.compare import compare_load
from vllm_kvchecksum.core.payload import KVChecksumPayload, PayloadBinding, PayloadGroup
from vllm_kvchecksum.core.records import GroupChecksums, KVChecksumRecord
from vllm_kvchecksum.core.verdicts import CheckStatus, UnverifiedReason

REQ = "req-1"
FINGERPRINT = 77


def tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, size=n)


# -- the hashes ---------------------------------------------------------------


def test_runs_add_up_over_any_block_size():
    content = TokenContent(tokens(100))
    by_1 = content.block_bindings(1, 100)
    for size in (2, 16, 32, 48, 100, 128):
        runs = content.block_bindings(size, 100)
        assert runs.shape == (-(-100 // size),)
        summed = np.add.reduceat(by_1, np.arange(0, 100, size), dtype=np.uint64)
        assert np.array_equal(runs, summed), size
    assert content.block_bindings(16, 40).tolist() == content.block_bindings(16, 100)[:3].tolist()[:2] + [
        int(by_1[32:40].sum(dtype=np.uint64))]


@pytest.mark.parametrize("change", [
    "token", "swap", "lora", "salt", "mm_identifier", "mm_offset", "embedding"])
def test_each_part_of_the_content_changes_the_binding(change):
    ids = tokens(64)
    base = dict(token_ids=ids, lora_name="adapter-a", cache_salt="salt-1",
                mm_spans=(MultimodalSpan(10, 8, "img-1"),), embedding_digests=np.arange(64, dtype=np.uint64))
    other = dict(base)
    if change == "token":
        other["token_ids"] = ids.copy()
        other["token_ids"][40] += 1
    elif change == "swap":
        other["token_ids"] = ids.copy()
        other["token_ids"][[40, 41]] = ids[[41, 40]]
    elif change == "lora":
        other["lora_name"] = None
    elif change == "salt":
        other["cache_salt"] = "salt-2"
    elif change == "mm_identifier":
        other["mm_spans"] = (MultimodalSpan(10, 8, "img-2"),)
    elif change == "mm_offset":
        other["mm_spans"] = (MultimodalSpan(11, 8, "img-1"),)
    else:
        digests = np.arange(64, dtype=np.uint64)
        digests[50] += np.uint64(1)
        other["embedding_digests"] = digests
    a, b = TokenContent(**base).block_bindings(16, 64), TokenContent(**other).block_bindings(16, 64)
    differ = np.flatnonzero(a != b).tolist()
    first_run = {"token": 2, "swap": 2, "lora": 0, "salt": 0, "mm_identifier": 0, "mm_offset": 0,
                 "embedding": 3}[change]
    assert differ and differ[0] == first_run
    assert np.array_equal(TokenContent(**base).block_bindings(16, 64), a)  # deterministic


def test_first_difference_finds_the_first_run_that_differs():
    ids = tokens(100)
    own = TokenContent(ids)
    theirs = ids.copy()
    theirs[70] += 1
    runs = TokenContent(theirs).block_bindings(16, 100)
    assert first_difference(own, 16, runs, 100, 100) == 64
    # Only runs starting before `upto` are looked at.
    assert first_difference(own, 16, runs, 100, 64) is None
    assert first_difference(own, 16, runs, 100, 65) == 64
    assert first_difference(own, 16, TokenContent(ids).block_bindings(16, 100), 100, 100) is None


def test_bound_tokens_this_request_lacks_differ():
    own = TokenContent(tokens(40))
    longer = TokenContent(np.concatenate([tokens(40), [1, 2, 3, 4, 5, 6, 7, 8]]))
    runs = longer.block_bindings(16, 48)
    # The producer bound 48 tokens; this request has 40, and loaded them all.
    assert first_difference(own, 16, runs, 48, 40) == 32
    # Runs within this side's tokens agree.
    assert first_difference(own, 16, runs[:2], 32, 40) is None


@settings(max_examples=60, deadline=None)
@given(block_size=st.integers(1, 2**40 - 1), count=st.integers(0, 5000), num_tokens=st.integers(0, 2**40 - 1))
def test_first_difference_works_by_this_sides_tokens_whatever_the_payload_says(block_size, count, num_tokens):
    own = TokenContent(tokens(30))
    result = first_difference(own, block_size, np.zeros(count, np.uint64), num_tokens, 30)
    assert result is None or 0 <= result < 30


# -- compare_load with the consumer's own content -------------------------------


def record(values_by_group: dict[int, tuple[int, int, np.ndarray]]) -> KVChecksumRecord:
    """One TP 1 worker's record of REQ: group -> (start, block_size, values)."""
    rec = KVChecksumRecord(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
                           fingerprints={g: FINGERPRINT for g in values_by_group}, skipped_groups={})
    rec.requests[REQ] = {g: GroupChecksums(start=s, num_blocks=len(v), block_size=b,
                                           partials={(1, 0): np.asarray(v, np.uint64)})
                         for g, (s, b, v) in values_by_group.items()}
    return rec


def kv_values(content_seed: int, n_tokens: int, block_size: int) -> np.ndarray:
    """Stand-in checksums of some KV: a value per token (from the seed), summed per block."""
    per_token = np.random.default_rng(1000 + content_seed).integers(0, 2**63, size=n_tokens).astype(np.uint64)
    return np.add.reduceat(per_token, np.arange(0, n_tokens, block_size), dtype=np.uint64)


def payload_for(content: TokenContent, values: np.ndarray, n_tokens: int, block_size: int,
                binding_block_size: int | None = None, bound: bool = True) -> KVChecksumPayload:
    bbs = binding_block_size or block_size
    binding = PayloadBinding(bbs, content.block_bindings(bbs, n_tokens)) if bound else None
    return KVChecksumPayload(num_tokens=n_tokens, producer_tp_size=1,
                             groups={0: PayloadGroup(FINGERPRINT, block_size, 0, values)}, binding=binding)


N = 96  # six 16-token blocks


def test_another_requests_kv_with_its_own_checksums_is_a_mismatch_of_its_own_cause():
    ours, theirs = tokens(N, seed=1), tokens(N, seed=1).copy()
    theirs[50] += 7  # the other prompt differs from token 50 (block 3) on
    received = kv_values(2, N, 16)  # their KV, sent with their checksums: values agree
    payload = payload_for(TokenContent(theirs), received, N, 16)
    verdict = compare_load(payload, [record({0: (0, 16, received)})], REQ, 1, {0: (0, 6, 16)}, N,
                           own=TokenContent(ours))
    assert verdict.status is CheckStatus.MISMATCH and verdict.cause == "wrong_request"
    group = verdict.groups[0]
    assert group.foreign_blocks == (3, 4, 5) and group.mismatched_blocks == (3, 4, 5)
    assert (group.foreign_from_token, group.foreign_to_token) == (48, 64)
    assert "another request's KV at block positions 3-5" in verdict.describe()
    assert "tokens [48, 64)" in verdict.describe()
    # Without the consumer's content, the values alone verify: the binding is what catches it.
    assert compare_load(payload, [record({0: (0, 16, received)})], REQ, 1, {0: (0, 6, 16)}, N).status \
        is CheckStatus.VERIFIED


def test_the_same_content_verifies_at_other_block_sizes():
    ids = tokens(N, seed=3)
    per_16 = kv_values(3, N, 16)
    per_32 = np.add.reduceat(per_16, np.arange(0, per_16.size, 2), dtype=np.uint64)
    own = TokenContent(ids)
    for producer_bs, values, consumer_bs, consumer_values in ((16, per_16, 32, per_32), (32, per_32, 16, per_16)):
        payload = payload_for(TokenContent(ids), values, N, producer_bs)
        n = len(consumer_values)
        verdict = compare_load(payload, [record({0: (0, consumer_bs, consumer_values)})], REQ, 1,
                               {0: (0, n, consumer_bs)}, N, own=own)
        assert verdict.status is CheckStatus.VERIFIED, verdict.describe()
        # And a changed token is found at the consumer's own positions.
        other = ids.copy()
        other[70] += 1
        wrong = payload_for(TokenContent(other), values, N, producer_bs)
        verdict = compare_load(wrong, [record({0: (0, consumer_bs, consumer_values)})], REQ, 1,
                               {0: (0, n, consumer_bs)}, N, own=own)
        first_run = 70 // producer_bs * producer_bs
        assert verdict.groups[0].foreign_blocks == tuple(range(first_run // consumer_bs, n))


def test_a_difference_inside_the_local_hit_makes_every_loaded_block_foreign():
    ours, theirs = tokens(N, seed=4), tokens(N, seed=4).copy()
    theirs[5] += 1  # inside block 0, which this side computed itself
    values = kv_values(4, N, 16)
    payload = payload_for(TokenContent(theirs), values, N, 16)
    # The consumer loaded blocks 2-5 (blocks 0-1 were a local prefix-cache hit).
    verdict = compare_load(payload, [record({0: (2, 16, values[2:])})], REQ, 1, {0: (2, 4, 16)}, N,
                           own=TokenContent(ours))
    assert verdict.groups[0].foreign_blocks == (2, 3, 4, 5)


def test_corrupt_and_foreign_blocks_are_told_apart():
    ours, theirs = tokens(N, seed=5), tokens(N, seed=5).copy()
    theirs[80] += 1  # block 5
    values = kv_values(5, N, 16)
    corrupted = values.copy()
    corrupted[1] += np.uint64(1)
    payload = payload_for(TokenContent(theirs), values, N, 16)
    verdict = compare_load(payload, [record({0: (0, 16, corrupted)})], REQ, 1, {0: (0, 6, 16)}, N,
                           own=TokenContent(ours))
    group = verdict.groups[0]
    assert group.mismatched_blocks == (1, 5) and group.foreign_blocks == (5,)
    assert verdict.cause == "wrong_request"
    assert "differs at block positions 1" in verdict.describe()
    # The same corruption of the right request's KV is "corrupt".
    right = payload_for(TokenContent(ours), values, N, 16)
    verdict = compare_load(right, [record({0: (0, 16, corrupted)})], REQ, 1, {0: (0, 6, 16)}, N,
                           own=TokenContent(ours))
    assert verdict.cause == "corrupt" and verdict.groups[0].foreign_blocks == ()


def test_a_payload_bound_to_nothing_never_verifies():
    ids = tokens(N, seed=6)
    values = kv_values(6, N, 16)
    payload = payload_for(TokenContent(ids), values, N, 16, bound=False)
    verdict = compare_load(payload, [record({0: (0, 16, values)})], REQ, 1, {0: (0, 6, 16)}, N,
                           own=TokenContent(ids))
    assert verdict.status is CheckStatus.UNVERIFIED
    assert verdict.reason_keys == (UnverifiedReason.NOT_BOUND,)
    # A mismatch stays a mismatch.
    bad = values.copy()
    bad[0] += np.uint64(1)
    verdict = compare_load(payload, [record({0: (0, 16, bad)})], REQ, 1, {0: (0, 6, 16)}, N,
                           own=TokenContent(ids))
    assert verdict.status is CheckStatus.MISMATCH and verdict.cause == "corrupt"


@pytest.mark.parametrize("state_block_size", [1024, 16])
def test_a_foreign_state_group_is_foreign_at_its_one_position(state_block_size):
    # A Mamba state summarizes every token before it: a difference at token
    # 90 makes it another request's state, also when its block (16 tokens at
    # position 0) ends before that token.
    ours, theirs = tokens(N, seed=7), tokens(N, seed=7).copy()
    theirs[90] += 1
    state = np.array([12345], np.uint64)
    payload = KVChecksumPayload(num_tokens=N, producer_tp_size=1,
                                groups={1: PayloadGroup(FINGERPRINT, state_block_size, 0, state)},
                                binding=PayloadBinding(16, TokenContent(theirs).block_bindings(16, N)))
    verdict = compare_load(payload, [record({1: (0, state_block_size, state)})], REQ, 1,
                           {1: (0, 1, state_block_size, True)}, N, own=TokenContent(ours))
    assert verdict.status is CheckStatus.MISMATCH and verdict.groups[1].foreign_blocks == (0,)


def test_a_load_unverified_as_a_whole_still_reports_another_requests_kv():
    ours, theirs = tokens(N, seed=8), tokens(N, seed=8).copy()
    theirs[0] += 1
    values = kv_values(8, N, 16)
    payload = payload_for(TokenContent(theirs), values, N, 16)
    # No worker reported the request: the values cannot be compared.
    verdict = compare_load(payload, [], REQ, 1, {0: (0, 6, 16)}, N, own=TokenContent(ours))
    assert verdict.status is CheckStatus.MISMATCH and verdict.groups[0].foreign_blocks == tuple(range(6))


def test_a_payload_of_another_version_is_counted_by_its_own_reason():
    verdict = compare_load(None, [], REQ, 1, {0: (0, 6, 16)}, N, missing_reason="version 1",
                           missing_key=UnverifiedReason.PAYLOAD_VERSION, own=TokenContent(tokens(N)))
    assert verdict.status is CheckStatus.UNVERIFIED and verdict.reason_key is UnverifiedReason.PAYLOAD_VERSION


def test_payload_binding_is_required_to_cover_every_token():
    payload = payload_for(TokenContent(tokens(N)), kv_values(0, N, 16), N, 16, binding_block_size=32)
    assert payload.binding.values.shape == (3,)
    with pytest.raises(ValueError):
        dataclasses.replace(payload, num_tokens=N + 1)


def test_a_token_moved_within_a_run_changes_its_binding():
    ids = tokens(32)
    swapped = ids.copy()
    swapped[[3, 9]] = ids[[9, 3]]
    assert ids[3] != ids[9]
    a, b = TokenContent(ids).block_bindings(16, 32), TokenContent(swapped).block_bindings(16, 32)
    assert a[0] != b[0] and a[1] == b[1]


def test_the_first_of_several_differing_runs_is_where_the_foreign_blocks_start():
    ours, theirs = tokens(N, seed=10), tokens(N, seed=10).copy()
    theirs[20] += 1  # run 1
    theirs[70] += 1  # run 4
    values = kv_values(10, N, 16)
    payload = payload_for(TokenContent(theirs), values, N, 16)
    verdict = compare_load(payload, [record({0: (0, 16, values)})], REQ, 1, {0: (0, 6, 16)}, N,
                           own=TokenContent(ours))
    group = verdict.groups[0]
    assert group.foreign_blocks == (1, 2, 3, 4, 5) and group.foreign_from_token == 16
    assert first_difference(TokenContent(ours), 16, payload.binding.values, N, N) == 16


def test_every_embedding_row_is_bound_the_last_included():
    ids = np.zeros(40, np.int64)  # prompt embeddings: placeholder ids
    digests = np.arange(40, dtype=np.uint64)
    changed = digests.copy()
    changed[-1] += np.uint64(1)
    a = TokenContent(ids, embedding_digests=digests).block_bindings(16, 40)
    b = TokenContent(ids, embedding_digests=changed).block_bindings(16, 40)
    assert a[:2].tolist() == b[:2].tolist() and a[2] != b[2]


def test_a_windowed_group_is_foreign_only_from_the_first_differing_token():
    ours, theirs = tokens(N, seed=11), tokens(N, seed=11).copy()
    theirs[70] += 1  # block 4
    values = kv_values(11, N, 16)
    payload = payload_for(TokenContent(theirs), values, N, 16)
    # The window's blocks 2-5 were loaded (a sliding-window group).
    verdict = compare_load(payload, [record({0: (2, 16, values[2:])})], REQ, 1, {0: (2, 4, 16, False, True)}, N,
                           own=TokenContent(ours))
    assert verdict.groups[0].foreign_blocks == (4, 5)


def test_one_foreign_group_makes_the_load_another_requests():
    ours, theirs = tokens(N, seed=12), tokens(N, seed=12).copy()
    theirs[90] += 1  # block 5
    values = kv_values(12, N, 16)
    window = kv_values(13, N, 16)
    payload = KVChecksumPayload(num_tokens=N, producer_tp_size=1,
                                groups={0: PayloadGroup(FINGERPRINT, 16, 0, values),
                                        1: PayloadGroup(FINGERPRINT, 16, 0, window[:4])},
                                binding=PayloadBinding(16, TokenContent(theirs).block_bindings(16, N)))
    # Group 1 loaded blocks 0-3 only: none at or past the differing token.
    verdict = compare_load(payload, [record({0: (0, 16, values), 1: (0, 16, window[:4])})], REQ, 1,
                           {0: (0, 6, 16), 1: (0, 4, 16)}, N, own=TokenContent(ours))
    assert verdict.groups[1].status is CheckStatus.VERIFIED and verdict.groups[0].foreign_blocks == (5,)
    assert verdict.wrong_request and verdict.cause == "wrong_request"
    line = verdict.describe()
    assert line.startswith("KV checksum mismatch for request 'req-1': another request's KV")
    assert "and differs at" not in line  # nothing corrupt: no block is listed twice


def test_bindings_of_other_run_sizes_are_not_equal():
    values = np.arange(3, dtype=np.uint64)
    assert PayloadBinding(16, values) == PayloadBinding(16, values.copy())
    assert PayloadBinding(16, values) != PayloadBinding(32, values)
