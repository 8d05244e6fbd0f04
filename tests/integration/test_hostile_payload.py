"""Forged kv_checksums against a real consumer scheduler.

kv_transfer_params come from the client, so a payload can decode fine and
still carry any integer in its fields. Whatever it carries, the consumer
must end the load with a verdict (mismatch or unverified; verified only
with the producer's own checksums), in memory bounded by its own blocks,
and go on verifying the next clean load: an exception here escapes
Scheduler.update_from_output and kills the engine core.

See pd_harness for the producer and consumer; the payloads start from a
real producer's and get forged field by field.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import logging
import resource
import tracemalloc
from typing import NamedTuple

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from pd_harness import Side, load, make_request, make_side, prefill, prompt_of, series_lacks_producer_tp_size, stats

import vllm_kvchecksum.core.payload as payload_module
import vllm_kvchecksum.engine.scheduler as scheduler_module
from vllm_kvchecksum.engine.scheduler import NOT_RETRYABLE_NOTE
from vllm_kvchecksum.core.payload import PAYLOAD_VERSION, KVChecksumPayload, PayloadGroup

PROMPT = 77  # 5 blocks of 16 tokens, the last holding 13; the consumer loads all 77
# What one load may allocate, the payload's decode and comparison included.
# A clean load peaks at tens of KiB here; before the comparison was bounded,
# one forged block size asked for 32 GiB.
MAX_LOAD_BYTES = 64 * 2**20
# How much the test process's address space may grow during a load, so a
# runaway allocation fails at once with MemoryError instead of taking the
# machine's memory.
ADDRESS_SPACE_HEADROOM = 4 * 2**30


# -- bounded memory -----------------------------------------------------------


def address_space_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


@contextlib.contextmanager
def address_space_capped():
    """Cap this process's address space a little above its current size."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = address_space_bytes() + ADDRESS_SPACE_HEADROOM
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def measured_load(consumer: Side, producer: Side, producer_req, params: dict, tamper=None):
    """load(), returning its result and the peak bytes it allocated (tracemalloc).

    numpy reports its arrays to tracemalloc, so a comparison sized by a
    payload value shows here; the address-space cap turns one too large to
    allocate into a MemoryError.
    """
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    tracemalloc.reset_peak()
    try:
        with address_space_capped():
            result = load(consumer, producer, producer_req, params, tamper=tamper)
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        if not was_tracing:
            tracemalloc.stop()


# -- forging ------------------------------------------------------------------


class Forgery(NamedTuple):
    """The integer fields of a one-group payload as sent, and how many values."""

    num_tokens: int
    producer_tp_size: int
    group_id: int
    fingerprint: int
    block_size: int
    start: int
    num_blocks: int  # the first num_blocks of the producer's values are sent

    def same_checksums(self, other: Forgery) -> bool:
        """Both send the same group's values for the same blocks, or a prefix of them."""
        where = ("group_id", "fingerprint", "block_size", "start")
        return (all(getattr(self, name) == getattr(other, name) for name in where)
                and self.num_blocks <= other.num_blocks)


def fields_of(payload: KVChecksumPayload) -> Forgery:
    (group_id, group), = payload.groups.items()  # the harness's model has one group
    return Forgery(payload.num_tokens, payload.producer_tp_size, group_id, group.fingerprint,
                   group.block_size, group.start, group.num_blocks)


def forged_text(original: KVChecksumPayload, forgery: Forgery) -> str:
    """The original's checksum values under the forged fields, as kv_checksums text.

    With the original's binding to the prompt where it still fits the forged
    token count (a client keeps what it cannot recompute), else none.
    Through KVChecksumPayload.encode when the fields make a valid payload;
    otherwise packed by hand in the same wire format, for the consumer's
    decoder to refuse.
    """
    (values,) = (group.values[:forgery.num_blocks] for group in original.groups.values())
    for binding in (original.binding, None):
        try:
            payload = KVChecksumPayload(
                num_tokens=forgery.num_tokens, producer_tp_size=forgery.producer_tp_size,
                groups={forgery.group_id: PayloadGroup(forgery.fingerprint, forgery.block_size,
                                                       forgery.start, values)}, binding=binding)
        except ValueError:
            continue
        return payload.encode()
    group = (forgery.group_id, forgery.fingerprint, forgery.block_size, forgery.start,
             values.astype("<u8").tobytes())
    message = (PAYLOAD_VERSION, (forgery.num_tokens, forgery.producer_tp_size, [group], [], None))
    return base64.b64encode(msgpack.packb(message, use_bin_type=True)).decode("ascii")


def assert_clean_load_verifies(producer: Side, consumer: Side, seed: int) -> None:
    before = stats(consumer)
    preq, params = prefill(producer, prompt_of(PROMPT, seed=seed))
    result = load(consumer, producer, preq, params)
    assert stats(consumer) == {**before, "verified": before.get("verified", 0) + 1}
    assert not result.request.is_finished()


def verdicts_since(consumer: Side, before: dict) -> dict:
    """The consumer's verdict counts that changed since `before`, by how much."""
    after = stats(consumer)
    return {key: after[key] - before.get(key, 0) for key in after
            if after[key] != before.get(key, 0)}


def assert_load_refused_cleanly(result, consumer: Side, before: dict) -> str:
    """The forged load was compared without error, unverified or a mismatch, and failed.

    Returns the request's stop_reason.
    """
    assert verdicts_since(consumer, before) in ({"unverified": 1}, {"mismatch": 1})
    out = result.outputs[result.request.request_id]
    assert out.finish_reason is not None and out.finish_reason.name == "ERROR"
    assert out.stop_reason.startswith(("kv_checksum_unverified", "kv_checksum_mismatch"))
    # An error while comparing would also end unverified: make sure there was none.
    assert "comparison_error" not in out.stop_reason, out.stop_reason
    return out.stop_reason


# -- the case from the issue --------------------------------------------------


@pytest.mark.parametrize("block_size, claimed_tokens, num_blocks, verdict", [
    # The case: past the old decoder by claiming tokens for every block.
    (2**40, 5 * 2**40, 5, "unverified"),
    # Within the decoder's limits, so it reaches the comparison.
    (2**36, 5 * 2**36, 5, "unverified"),
    # One giant block holding the consumer's 77 tokens: compared, and wrong.
    (2**36, PROMPT, 1, "mismatch"),
], ids=["2**40", "2**36", "2**36-compared"])
def test_forged_huge_block_size_does_not_crash_the_consumer(block_size, claimed_tokens,
                                                            num_blocks, verdict, logs):
    P = make_side("kv_producer")
    C = make_side("kv_consumer", fail_closed=True, policy="fail")
    preq, params = prefill(P, prompt_of(PROMPT))
    original = KVChecksumPayload.decode(params["kv_checksums"])
    forgery = fields_of(original)._replace(block_size=block_size, num_tokens=claimed_tokens,
                                           num_blocks=num_blocks)
    forged = forged_text(original, forgery)
    result, peak = measured_load(C, P, preq, {**params, "kv_checksums": forged})
    assert_load_refused_cleanly(result, C, before={})
    assert stats(C) == {verdict: 1}
    assert peak < MAX_LOAD_BYTES
    assert_clean_load_verifies(P, C, seed=1)


# -- the scheduler's last line of defence -------------------------------------


def test_an_error_while_comparing_fails_that_load_only(monkeypatch, logs):
    """Two loads finish in one step; comparing the first raises."""
    P = make_side("kv_producer")
    C = make_side("kv_consumer", fail_closed=True, policy="fail")
    producer_reqs = [prefill(P, prompt_of(PROMPT, seed=seed)) for seed in (1, 2)]
    reqs = [make_request(preq.prompt_token_ids, params=dict(params), block_size=C.block_size)
            for preq, params in producer_reqs]
    for req in reqs:
        C.scheduler.add_request(req)
    C.step()
    for req, (preq, _) in zip(reqs, producer_reqs):
        assert req.status.name == "WAITING_FOR_REMOTE_KVS", req.status
        C.write_tokens(req.request_id, 0, req.num_computed_tokens, source=P,
                       source_id=preq.request_id)
    real_compare = scheduler_module.compare_load
    broken = reqs[0].request_id

    def compare_load(expected, records, req_id, *args, **kwargs):
        if req_id == broken:
            raise MemoryError("Unable to allocate 32.0 GiB (injected by the test)")
        return real_compare(expected, records, req_id, *args, **kwargs)

    monkeypatch.setattr(scheduler_module, "compare_load", compare_load)
    _, outputs = C.step(finished_recving={req.request_id for req in reqs})
    assert stats(C) == {"unverified": 1, "verified": 1}
    out = outputs[broken]
    assert out.finish_reason.name == "ERROR"
    assert out.stop_reason.startswith("kv_checksum_unverified") and \
        "comparison_error" in out.stop_reason
    assert not reqs[1].is_finished()
    errors = [r for r in logs.records if r.levelno == logging.ERROR]
    assert any(broken in r.getMessage() and "MemoryError" in r.getMessage() for r in errors), \
        logs.text
    monkeypatch.undo()
    assert_clean_load_verifies(P, C, seed=3)


def test_an_error_while_comparing_is_logged_and_the_load_used_fail_open(monkeypatch, logs):
    P = make_side("kv_producer")
    C = make_side("kv_consumer")
    preq, params = prefill(P, prompt_of(PROMPT))

    def compare_load(*args, **kwargs):
        raise RuntimeError("injected by the test")

    monkeypatch.setattr(scheduler_module, "compare_load", compare_load)
    result = load(C, P, preq, params)
    assert stats(C) == {"unverified": 1}
    assert result.next_scheduled == 1  # fail-open: used anyway
    assert "comparison_error" in logs.text


def test_an_error_while_decoding_leaves_the_load_unverified(monkeypatch, logs):
    P = make_side("kv_producer")
    C = make_side("kv_consumer", fail_closed=True, policy="fail")
    preq, params = prefill(P, prompt_of(PROMPT))

    class ExplodingPayload:
        @staticmethod
        def decode(text, *limits):
            raise MemoryError("injected by the test")

    monkeypatch.setattr(scheduler_module, "KVChecksumPayload", ExplodingPayload)
    result = load(C, P, preq, params)
    assert stats(C) == {"unverified": 1}
    out = result.outputs[result.request.request_id]
    assert out.finish_reason.name == "ERROR"
    assert out.stop_reason.startswith("kv_checksum_unverified")
    assert any(r.levelno == logging.ERROR and result.request.request_id in r.getMessage()
               for r in logs.records), logs.text
    monkeypatch.undo()
    assert_clean_load_verifies(P, C, seed=1)


# -- fuzzing the fields -------------------------------------------------------

# The consumer's own numbers: 16-token blocks, 5 of them, 77 tokens.
CONSUMER_NUMBERS = (4, 5, 6, 13, 15, 16, 17, 32, 64, 76, 77, 78, 80)
UINT64_BOUNDARIES = sorted({0, 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1}
                           | {2**k + d for k in range(1, 64) for d in (-1, 0, 1)})


def adversarial(original: int, *near: int) -> st.SearchStrategy[int]:
    """A boundary, or a value next to the original or `near`."""
    neighbours = sorted({v + d for v in (original, *near) for d in (-1, 0, 1)
                         if 0 <= v + d < 2**64})
    return st.one_of(st.sampled_from(UINT64_BOUNDARIES), st.sampled_from(neighbours))


@st.composite
def forgeries(draw, original: Forgery) -> Forgery:
    """A few of the original's fields replaced, the others kept.

    Few at a time, and the token count often fitted to the forged blocks,
    so that most forgeries get past the decoder to the comparison.
    """
    # Each field forged one time in three, at least one; a group id or a
    # fingerprint of another model ends the comparison early, so those less.
    forged = ({name for name in Forgery._fields
               if draw(st.integers(0, 7 if name in ("group_id", "fingerprint") else 2)) == 0}
              or {draw(st.sampled_from(Forgery._fields))})

    def field(name: str, strategy: st.SearchStrategy[int]) -> int:
        return draw(strategy) if name in forged else getattr(original, name)

    block_size = field("block_size", adversarial(original.block_size, *CONSUMER_NUMBERS))
    start = field("start", adversarial(original.start, *CONSUMER_NUMBERS))
    num_blocks = field("num_blocks", st.integers(0, original.num_blocks))
    blocks_end = start + num_blocks
    enough = [t for t in ((blocks_end - 1) * block_size + 1, blocks_end * block_size)
              if 0 <= t < 2**64] or [original.num_tokens]
    if "num_tokens" in forged:
        num_tokens = draw(st.one_of(adversarial(original.num_tokens, *CONSUMER_NUMBERS),
                                    st.sampled_from(enough)))
    elif {"block_size", "start", "num_blocks"} & forged and draw(st.integers(0, 3)) > 0:
        num_tokens = draw(st.sampled_from(enough))
    else:
        num_tokens = original.num_tokens
    return Forgery(
        num_tokens=num_tokens,
        producer_tp_size=field("producer_tp_size", adversarial(original.producer_tp_size, 2, 4)),
        group_id=field("group_id", adversarial(original.group_id, 1)),
        fingerprint=field("fingerprint", adversarial(original.fingerprint)),
        block_size=block_size, start=start, num_blocks=num_blocks)


class Instances:
    """A producer and a consumer, replaced before the producer runs out of blocks.

    The producer keeps each prefilled request's blocks (no consumer
    reports the transfer done), so a pair serves a few examples only.
    `real` holds the fields of the producer's payloads, the same for every
    prompt of PROMPT tokens (the fingerprint depends on the layers only).
    """

    EXAMPLES_PER_PAIR = 6

    def __init__(self):
        self.seeds = itertools.count(100)
        self.uses = self.EXAMPLES_PER_PAIR
        producer, _ = self.pair()
        _, params = prefill(producer, prompt_of(PROMPT, seed=next(self.seeds)))
        self.real = fields_of(KVChecksumPayload.decode(params["kv_checksums"]))

    def pair(self) -> tuple[Side, Side]:
        if self.uses >= self.EXAMPLES_PER_PAIR:
            self.producer = make_side("kv_producer")
            self.consumer = make_side("kv_consumer", fail_closed=True, policy="fail")
            self.uses = 0
        self.uses += 1
        return self.producer, self.consumer


@pytest.fixture(scope="module")
def instances():
    return Instances()


def forged_load_outcome(instances: Instances, forgery: Forgery, corrupt: int | None = None) -> str:
    """A fresh prompt loaded with `forgery` as its payload: "verified", or the stop_reason.

    corrupt: flip a bit of the loaded block at this position on the consumer
    (a transfer that went wrong).

    Checks what holds for every forged load: nothing raised, memory stayed
    bounded, the load failed (fail-closed) unless verified, and the next
    clean load on the same consumer verifies.
    """
    P, C = instances.pair()
    preq, params = prefill(P, prompt_of(PROMPT, seed=next(instances.seeds)))
    original = KVChecksumPayload.decode(params["kv_checksums"])
    assert fields_of(original) == instances.real
    before = stats(C)
    tamper = None if corrupt is None else (lambda req: C.corrupt(req.request_id, position=corrupt))
    result, peak = measured_load(C, P, preq, {**params, "kv_checksums": forged_text(original, forgery)},
                                 tamper=tamper)
    assert peak < MAX_LOAD_BYTES
    if verdicts_since(C, before) == {"verified": 1}:
        assert not result.request.is_finished()
        outcome = "verified"
    else:
        outcome = assert_load_refused_cleanly(result, C, before)
    assert_clean_load_verifies(P, C, seed=next(instances.seeds))
    return outcome


def test_the_producers_fields_are_what_the_forgeries_assume(instances):
    # 5 blocks of 16 tokens from position 0, 77 tokens, TP 1, group 0.
    assert instances.real._replace(fingerprint=0) == Forgery(PROMPT, 1, 0, 0, 16, 0, 5)


# Forgeries tried on every run, with the verdict each gets: "verified",
# "mismatch", or the reason it is unverified. Fields not named keep the
# producer's values; v0..v4 below are its 5 block values.
HAND_PICKED = {
    "prefix-of-the-values": (dict(num_blocks=3), "not_covered_by_producer"),
    "tokens-near-the-limit": (dict(num_tokens=2**40 - 1), "not_covered_by_producer"),  # last block not comparable
    # NIXL transfers from TP 1 (before the series' patch for it, the payload's was taken).
    "tp-size-at-the-limit": (dict(producer_tp_size=2**63 - 1),
                             "verified" if series_lacks_producer_tp_size() else "producer_tp_size_differs"),
    "no-values": (dict(num_blocks=0), "no_common_blocks"),
    "past-the-consumers-blocks": (dict(start=6, num_tokens=11 * 16), "no_common_blocks"),
    "shifted-by-one": (dict(start=1, num_tokens=6 * 16), "mismatch"),  # v0 vs block 1
    "halved-block-size": (dict(block_size=8), "mismatch"),  # v0+v1 vs block 0
    "doubled-block-size": (dict(block_size=32, num_tokens=5 * 32), "mismatch"),
    "one-giant-block": (dict(block_size=2**39, num_blocks=1), "mismatch"),  # v0 vs all 5
    "giant-blocks-at-the-limit": (dict(block_size=2**40, num_tokens=5 * 2**40),
                                  "no_producer_checksums"),
    "last-position-below-the-limit": (dict(block_size=1, start=2**40 - 6,
                                           num_tokens=2**40 - 1), "no_common_blocks"),
    "too-few-tokens": (dict(num_tokens=0), "no_producer_checksums"),
    "zero-block-size": (dict(block_size=0), "no_producer_checksums"),
    "other-fingerprint": (dict(fingerprint=2**64 - 1), "fingerprint_differs"),
    "other-group": (dict(group_id=2**63 - 1),
                    "not_checksummed_by_producer, not_checksummed_by_consumer"),
}


@pytest.mark.parametrize("changes, verdict", HAND_PICKED.values(), ids=HAND_PICKED.keys())
def test_hand_picked_forgeries(instances, changes, verdict):
    outcome = forged_load_outcome(instances, instances.real._replace(**changes))
    if verdict == "verified":
        assert outcome == "verified"
    elif verdict == "mismatch":
        assert outcome.startswith("kv_checksum_mismatch"), outcome
    else:
        # A payload the client got wrong: a retry meets it again.
        assert outcome == f"kv_checksum_unverified: {verdict}{NOT_RETRYABLE_NOTE}"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_forged_field_values_never_crash_the_consumer(instances, data):
    forgery = data.draw(forgeries(instances.real), label="forgery")
    outcome = forged_load_outcome(instances, forgery)
    if outcome == "verified":
        # The token count, the TP size and fewer values change which blocks
        # are compared (or nothing), never what they are compared with.
        assert forgery.same_checksums(instances.real), forgery
    event(outcome.split(" (")[0])  # the verdict and reasons, without block lists


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_no_forgery_turns_a_mismatch_into_a_verify(instances, data):
    """A load with one corrupt block, and a payload whose fields a client
    edited (fewer values, another start, token count, block size, TP size,
    group or fingerprint): never verified."""
    forgery = data.draw(forgeries(instances.real), label="forgery")
    position = data.draw(st.integers(0, instances.real.num_blocks - 1), label="corrupt block")
    outcome = forged_load_outcome(instances, forgery, corrupt=position)
    assert outcome != "verified", (forgery, position)
    event(outcome.split(" (")[0].split(":")[0])


# -- a payload's size is bounded by its request -------------------------------


def _oversized_payload() -> KVChecksumPayload:
    """Well-formed, about 0.6 MB, far under the global limit: what a 77-token
    prompt's producer could never send."""
    return KVChecksumPayload(num_tokens=PROMPT, producer_tp_size=1, groups={
        g: PayloadGroup(fingerprint=1, block_size=1, start=0, values=np.zeros(PROMPT, dtype=np.uint64))
        for g in range(1000)})


@pytest.fixture
def decoded(monkeypatch):
    """The sizes of the payloads msgpack-decoded while the test runs."""
    sizes = []
    real = payload_module._unpack

    def unpack(data):
        sizes.append(len(data))
        return real(data)

    monkeypatch.setattr(payload_module, "_unpack", unpack)
    return sizes


def test_a_payload_larger_than_its_request_allows_is_not_decoded(decoded, logs):
    """A 77-token prompt carrying a large payload in kv_transfer_params: not
    decoded, the load unverified with the reason; the next load verifies."""
    P = make_side("kv_producer")
    C = make_side("kv_consumer", fail_closed=True, policy="fail")
    preq, params = prefill(P, prompt_of(PROMPT))
    result = load(C, P, preq, {**params, "kv_checksums": _oversized_payload().encode()})
    assert decoded == []  # refused before base64 or msgpack ran
    assert stats(C) == {"unverified": 1}
    out = result.outputs[result.request.request_id]
    assert out.finish_reason.name == "ERROR" and "no_producer_checksums" in out.stop_reason
    assert "exceeds the limit of" in logs.text
    assert_clean_load_verifies(P, C, seed=1)
    assert decoded  # the honest payload was decoded


def test_bytes_a_connector_delivers_are_bounded_by_the_request_too(decoded):
    """The same bound for bytes from a push notif or a Mooncake response."""
    P = make_side("kv_producer")
    C = make_side("kv_consumer", fail_closed=True, policy="fail")
    _, params = prefill(P, prompt_of(PROMPT))
    text = params.pop("kv_checksums")
    req = make_request(prompt_of(PROMPT), params=params, block_size=16)
    C.scheduler.add_request(req)
    C.step()
    checksums = C.scheduler.kv_checksum
    pending = checksums._recvs[req.request_id]
    checksums._decode_expected(pending, req.request_id, _oversized_payload().to_bytes(), "connector message")
    assert pending.expected is None and "exceed the limit of" in pending.missing_reason
    assert decoded == []
    honest = KVChecksumPayload.decode(text).to_bytes()
    decoded.clear()
    checksums._decode_expected(pending, req.request_id, honest, "connector message")
    assert pending.expected is not None and decoded == [len(honest)]


def test_a_long_prompts_honest_payload_is_within_its_bound(decoded):
    """The bound grows with the request: 40 blocks of checksums (far more
    than a short prompt's bound) decode and verify."""
    P = make_side("kv_producer")
    C = make_side("kv_consumer", fail_closed=True, policy="fail")
    preq, params = prefill(P, prompt_of(16 * 40 + 5))
    load(C, P, preq, params)
    assert stats(C) == {"verified": 1}
    assert max(decoded) > 40 * 8


# -- found missing by an outside mutation round --------------------------------


def test_bytes_just_over_the_requests_bound_are_refused():
    """The bound is the request's (tokens x groups), not a looser one."""
    from vllm_kvchecksum.core.payload import max_packed_size

    P = make_side("kv_producer")
    C = make_side("kv_consumer", fail_closed=True, policy="fail")
    _, params = prefill(P, prompt_of(PROMPT))
    params.pop("kv_checksums")
    req = make_request(prompt_of(PROMPT), params=params, block_size=16)
    C.scheduler.add_request(req)
    C.step()
    checksums = C.scheduler.kv_checksum
    pending = checksums._recvs[req.request_id]
    bound = max_packed_size(pending.request_tokens, len(checksums.layouts))
    from vllm_kvchecksum.core.payload import PayloadBinding

    # One group more than the model has, each and the binding at 1-token runs.
    data = KVChecksumPayload(num_tokens=PROMPT, producer_tp_size=1, groups={
        g: PayloadGroup(fingerprint=1, block_size=1, start=0, values=np.zeros(PROMPT, dtype=np.uint64))
        for g in range(len(checksums.layouts) + 1)},
        binding=PayloadBinding(1, np.zeros(PROMPT, dtype=np.uint64))).to_bytes()
    assert bound < len(data) < 2 * bound
    checksums._decode_expected(pending, req.request_id, data, "connector message")
    assert pending.expected is None and "exceed the limit of" in pending.missing_reason


@pytest.mark.parametrize("claimed", [True, 1.0, "1"])
def test_a_connector_tp_size_of_another_type_is_not_taken_for_the_payloads(claimed):
    from vllm_kvchecksum.core.compare import compare_load
    from vllm_kvchecksum.core.verdicts import UnverifiedReason

    payload = KVChecksumPayload(num_tokens=16, producer_tp_size=1, groups={})
    verdict = compare_load(payload, [], "r", 1, {}, 16, producer_tp_size=claimed)
    assert verdict.reason_key is UnverifiedReason.PRODUCER_TP_SIZE_DIFFERS


def test_a_tp_size_hook_that_raises_leaves_the_load_compared(logs):
    if series_lacks_producer_tp_size():
        pytest.skip("connectors say the producer's TP size from a later patch of the series on")
    P = make_side("kv_producer")
    C = make_side("kv_consumer", fail_closed=True, policy="fail")

    def broken(request):
        raise RuntimeError("injected by the test")

    C.scheduler.kv_checksum.connector.get_kv_checksum_producer_tp_size = broken
    preq, params = prefill(P, prompt_of(PROMPT))
    load(C, P, preq, params)
    assert stats(C) == {"verified": 1}, logs.text
    assert "not cross-checked" in logs.text
