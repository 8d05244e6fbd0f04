"""The checksum payload's wire format, and its decoder facing hostile input.

The payload arrives in client-supplied kv_transfer_params, so decoding must
either return a payload or raise ValueError, whatever it is given, and in
bounded time and memory. Valid payloads must round-trip exactly.
"""

import ast
import base64
import os

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_kvchecksum.core import payload as payload_module
from vllm_kvchecksum.core.payload import (MAX_GROUPS, MAX_PAYLOAD_BYTES, MAX_TOKENS, PAYLOAD_VERSION,
                                          KVChecksumPayload, PayloadBinding, PayloadGroup, PayloadVersionError,
                                          max_encoded_size, max_packed_size)

FUZZ = settings(max_examples=150, deadline=None,
                # The codec fixture only picks a module: nothing to reset per example.
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def sample_payload() -> KVChecksumPayload:
    return KVChecksumPayload(
        num_tokens=100, producer_tp_size=2,
        groups={0: PayloadGroup(fingerprint=2**64 - 1, block_size=16, start=0,
                                values=np.array([0, 1, 2**63, 2**64 - 1, 5, 6, 7],
                                                dtype=np.uint64)),
                3: PayloadGroup(fingerprint=0, block_size=32, start=2,
                                values=np.array([42, 43], dtype=np.uint64))})


def packed(message) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


@pytest.fixture(params=["pybase64", "standard library"])
def codec(request, monkeypatch):
    """Run a test with each base64 codec the payload may use: pybase64 (which
    vLLM requires) and the standard library's (without vLLM)."""
    if request.param == "pybase64":
        pybase64 = pytest.importorskip("pybase64")
        monkeypatch.setattr(payload_module, "_base64", pybase64)
    else:
        monkeypatch.setattr(payload_module, "_base64", base64)
    return request.param


def test_the_payload_uses_pybase64_where_vllm_is_installed():
    # vLLM requires pybase64; the consumer's decode then takes ~0.01 ms
    # instead of ~0.5 ms for a 128K-token, four-group payload.
    pytest.importorskip("pybase64")
    assert payload_module._base64.__name__ == "pybase64"


def decodes_or_value_error(read, data) -> KVChecksumPayload | None:
    """Run a decoder; a ValueError is an accepted outcome, any other exception fails."""
    try:
        result = read(data)
    except ValueError as exc:
        assert str(exc), "the error must say what was wrong"
        return None
    assert isinstance(result, KVChecksumPayload)
    return result


# -- the format ---------------------------------------------------------------


@pytest.mark.usefixtures("codec")
def test_round_trip_through_text_and_bytes():
    payload = sample_payload()
    text = payload.encode()
    assert isinstance(text, str) and text.isascii()
    assert KVChecksumPayload.decode(text) == payload
    assert KVChecksumPayload.decode(text.encode("ascii")) == payload
    assert KVChecksumPayload.from_bytes(payload.to_bytes()) == payload
    decoded = KVChecksumPayload.decode(text).groups[0].values
    assert decoded.dtype == np.uint64 and decoded.flags.writeable


def test_wire_format_is_version_and_body_with_little_endian_values():
    message = msgpack.unpackb(base64.b64decode(sample_payload().encode()))
    assert message == [PAYLOAD_VERSION, [100, 2, [
        [0, 2**64 - 1, 16, 0, np.array([0, 1, 2**63, 2**64 - 1, 5, 6, 7], "<u8").tobytes()],
        [3, 0, 32, 2, (42).to_bytes(8, "little") + (43).to_bytes(8, "little")]], [], None]]
    assert PAYLOAD_VERSION == 2


def test_hand_written_payload_decodes():
    text = b64(packed([2, [33, 1, [[7, 99, 16, 1, (5).to_bytes(8, "little") * 2]], [],
                           [16, (1).to_bytes(8, "little") * 3]]]))
    payload = KVChecksumPayload.decode(text)
    assert payload.num_tokens == 33 and payload.producer_tp_size == 1
    group = payload.groups[7]
    assert (group.fingerprint, group.block_size, group.start) == (99, 16, 1)
    assert group.values.tolist() == [5, 5]
    assert payload.binding.block_size == 16 and payload.binding.values.tolist() == [1, 1, 1]


def test_tp_local_groups_ride_their_field():
    import dataclasses

    payload = dataclasses.replace(sample_payload(), tp_local_groups={3})
    assert KVChecksumPayload.from_bytes(payload.to_bytes()) == payload
    assert KVChecksumPayload.decode(payload.encode()).tp_local_groups == {3}
    assert msgpack.unpackb(payload.to_bytes())[1][3] == [3]
    assert payload != sample_payload()
    assert msgpack.unpackb(sample_payload().to_bytes())[1][3] == []
    for bad in ([-1], ["x"], 5):
        with pytest.raises(ValueError, match="TP-local|tp_local"):
            KVChecksumPayload.from_bytes(packed([2, [33, 1, [], bad, None]]))


def test_a_binding_rides_the_last_field_and_is_checked():
    import dataclasses

    binding = PayloadBinding(16, np.arange(7, dtype=np.uint64))
    payload = dataclasses.replace(sample_payload(), binding=binding)
    assert KVChecksumPayload.decode(payload.encode()) == payload
    assert payload != sample_payload()
    assert msgpack.unpackb(payload.to_bytes())[1][4] == [16, np.arange(7, dtype="<u8").tobytes()]
    # One value per run of block_size tokens over num_tokens (100 tokens: 7 runs of 16).
    for wrong in (6, 8):
        with pytest.raises(ValueError, match="binding holds"):
            dataclasses.replace(sample_payload(), binding=PayloadBinding(16, np.zeros(wrong, np.uint64)))
    for bad, error in (([0, bytes(8 * 7)], "binding block_size"), ([16, bytes(12)], "whole uint64s"),
                       ([16, "x" * 8], "whole uint64s"), ([16], "binding must have 2 fields"),
                       ([16, bytes(8 * 6)], "binding holds 6 values")):
        with pytest.raises(ValueError, match=error):
            KVChecksumPayload.from_bytes(packed([2, [100, 1, [], [], bad]]))


def test_another_version_raises_its_own_error():
    with pytest.raises(PayloadVersionError, match="version 1 is not supported") as caught:
        KVChecksumPayload.decode(b64(packed([1, [33, 1, []]])))
    assert caught.value.version == 1
    assert isinstance(caught.value, ValueError)


def test_empty_payload_round_trips():
    empty = KVChecksumPayload(num_tokens=0, producer_tp_size=1, groups={})
    assert KVChecksumPayload.decode(empty.encode()) == empty


def test_equality_compares_values():
    other = sample_payload()
    other.groups[3].values[1] += np.uint64(1)
    assert other != sample_payload()


@pytest.mark.parametrize("kwargs, message", [
    (dict(fingerprint=2**64), "fingerprint"),
    (dict(fingerprint=-1), "fingerprint"),
    (dict(fingerprint=True), "bool"),
    (dict(block_size=0), "block_size"),
    (dict(start=-1), "start"),
    (dict(start=1.0), "float"),
    (dict(values=np.array([1], dtype=np.int64)), "uint64"),
    (dict(values=np.zeros((2, 2), dtype=np.uint64)), "1-D"),
    (dict(values=[1, 2]), "uint64"),
])
def test_constructor_refuses_bad_groups(kwargs, message):
    fields = dict(fingerprint=1, block_size=16, start=0, values=np.zeros(1, np.uint64))
    fields.update(kwargs)
    with pytest.raises(ValueError, match=message):
        PayloadGroup(**fields)


def test_constructor_accepts_numpy_integers():
    group = PayloadGroup(fingerprint=np.uint64(2**64 - 1), block_size=np.int64(16),
                         start=np.int32(0), values=np.zeros(1, "<u8"))
    assert type(group.fingerprint) is int and group.fingerprint == 2**64 - 1
    packed_payload = KVChecksumPayload(num_tokens=np.int64(16), producer_tp_size=1,
                                       groups={np.int64(0): group}).encode()
    assert KVChecksumPayload.decode(packed_payload).groups[0] == group


def test_constructor_refuses_blocks_past_the_tokens():
    group = PayloadGroup(fingerprint=1, block_size=16, start=1, values=np.zeros(2, np.uint64))
    with pytest.raises(ValueError, match="group 0 has blocks up to position 2"):
        KVChecksumPayload(num_tokens=32, producer_tp_size=1, groups={0: group})
    KVChecksumPayload(num_tokens=33, producer_tp_size=1, groups={0: group})


# -- refusing what is not a payload -------------------------------------------

GOOD_GROUP = [0, 5, 16, 0, bytes(16)]


def body(num_tokens=32, tp=1, groups=None, tp_local=None, binding=None):
    return [num_tokens, tp, [GOOD_GROUP] if groups is None else groups, [] if tp_local is None else tp_local,
            binding]


@pytest.mark.parametrize("message, error", [
    ([1, [32, 1, [GOOD_GROUP]]], "version 1 is not supported"),
    ([3, body()], "version 3 is not supported"),
    ([0, body()], "version 0 is not supported"),
    ([7], "version 7 is not supported"),
    (["1", body()], "version must be an integer, got str"),
    ([True, body()], "version must be an integer, got bool"),
    ([1.0, body()], "version must be an integer, got float"),
    ([2, body(), 3], "payload must have 2 fields"),
    ({}, "payload must be an array, got dict"),
    (None, "payload must be an array, got NoneType"),
    (5, "payload must be an array, got int"),
    ([2, None], "payload body must be an array"),
    ([2, [32, 1]], "payload body must have 5 fields"),
    ([2, body(num_tokens=True)], "num_tokens must be an integer, got bool"),
    ([2, body(num_tokens=32.0)], "num_tokens must be an integer, got float"),
    ([2, body(num_tokens=-1)], "num_tokens must be in"),
    ([2, body(num_tokens="32")], "num_tokens must be an integer, got str"),
    ([2, body(tp=0)], "producer_tp_size must be in"),
    ([2, body(tp=False)], "producer_tp_size must be an integer, got bool"),
    ([2, body(groups={})], "groups must be an array, got dict"),
    ([2, body(groups=b"")], "groups must be an array, got bytes"),
    ([2, body(groups=[[0, 5, 16, 0]])], "group entry 0 must have 5 fields"),
    ([2, body(groups=[5])], "group entry 0 must be an array, got int"),
    ([2, body(groups=[[True, 5, 16, 0, b""]])], "group id of entry 0 must be an integer"),
    ([2, body(groups=[[-1, 5, 16, 0, b""]])], "group id of entry 0 must be in"),
    ([2, body(groups=[[0, -5, 16, 0, b""]])], "fingerprint of group 0 must be in"),
    ([2, body(groups=[[0, 5.0, 16, 0, b""]])], "fingerprint of group 0 must be an integer"),
    ([2, body(groups=[[0, False, 16, 0, b""]])], "fingerprint of group 0 must be an integer"),
    ([2, body(groups=[[0, 5, 0, 0, b""]])], "block_size of group 0 must be in"),
    ([2, body(groups=[[0, 5, 16, -2, b""]])], "start of group 0 must be in"),
    ([2, body(groups=[[0, 5, 16, 0, bytes(12)]])], "hold 12 bytes, not a multiple of 8"),
    ([2, body(groups=[[0, 5, 16, 0, "abcdefgh"]])], "values of group 0 must be bin, got str"),
    ([2, body(groups=[[0, 5, 16, 0, [1, 2]]])], "values of group 0 must be bin, got list"),
    ([2, body(groups=[GOOD_GROUP, GOOD_GROUP])], "group 0 is listed twice"),
    ([2, body(num_tokens=16, groups=[[0, 5, 16, 0, bytes(16)]])], "fill only 1 blocks"),
])
def test_malformed_messages_raise_value_error_naming_the_fault(message, error):
    for read, data in ((KVChecksumPayload.from_bytes, packed(message)),
                       (KVChecksumPayload.decode, b64(packed(message)))):
        with pytest.raises(ValueError, match=error):
            read(data)


@pytest.mark.parametrize("data", [None, 5, 1.5, ["abc"], {"a": 1}, bytearray(b"x"), object()])
def test_decode_refuses_what_is_not_text(data):
    with pytest.raises(ValueError, match="must be base64 text"):
        KVChecksumPayload.decode(data)


@pytest.mark.parametrize("data", [None, 5, "text", ["abc"]])
def test_from_bytes_refuses_what_is_not_bytes(data):
    with pytest.raises(ValueError, match="must be bytes"):
        KVChecksumPayload.from_bytes(data)


def test_from_bytes_takes_bytes_like_objects():
    data = sample_payload().to_bytes()
    assert KVChecksumPayload.from_bytes(bytearray(data)) == sample_payload()
    assert KVChecksumPayload.from_bytes(memoryview(data)) == sample_payload()


@pytest.mark.parametrize("text", ["!!!!", "abc", "ab=c", "é" * 4, " " + b64(b"\x90"),
                                  b64(b"\x90") + "\n"])
@pytest.mark.usefixtures("codec")
def test_bad_base64_raises_value_error(text):
    with pytest.raises(ValueError, match="not valid base64"):
        KVChecksumPayload.decode(text)


@pytest.mark.parametrize("data", [
    b"", b"\xc1", b"\x92\x01", packed([2, body()]) + b"\x00",
    b"\x91" * 100_000 + b"\xc0",  # nested far deeper than any decoder stack
    b"\xdd\xff\xff\xff\xff",  # array of 2**32 - 1 entries, none present
    b"\xdf\xff\xff\xff\xff",  # map of 2**32 - 1 entries
    b"\xc6\xff\xff\xff\xff",  # bin of 4 GiB
    b"\xdb\xff\xff\xff\xff",  # str of 4 GiB
    b"\xc9\xff\xff\xff\xff\x05",  # ext of 4 GiB
    b"\xc7\x00\x05",  # empty ext type 5
    b"\xd6\xff\x00\x00\x00\x00",  # timestamp ext
    packed([2, [32, 1, [GOOD_GROUP] * (MAX_GROUPS + 1)]]),
    packed({"version": 1}),
    packed([2, [32, 1, [[0, 5, 16, 0, msgpack.ExtType(1, b"12345678")]]]]),
])
def test_malformed_msgpack_fails_fast_with_value_error(data):
    # Speed is not asserted here (no timing thresholds in tests): the
    # decoder's limits refuse these before allocating what they declare.
    for read, item in ((KVChecksumPayload.from_bytes, data), (KVChecksumPayload.decode, b64(data))):
        with pytest.raises(ValueError, match="invalid KV checksum payload"):
            read(item)


def test_text_over_the_limit_is_refused_before_decoding():
    text = "A" * (MAX_PAYLOAD_BYTES + 4)
    # The length check's own message: refused before base64 or msgpack run.
    with pytest.raises(ValueError, match="exceeds the limit"):
        KVChecksumPayload.decode(text)


def test_limit_is_read_at_call_time(monkeypatch):
    text = sample_payload().encode()
    monkeypatch.setattr(payload_module, "MAX_PAYLOAD_BYTES", len(text) - 1)
    with pytest.raises(ValueError, match="exceeds the limit"):
        KVChecksumPayload.decode(text)
    monkeypatch.setattr(payload_module, "MAX_PACKED_BYTES", 10)
    with pytest.raises(ValueError, match="exceed the limit"):
        KVChecksumPayload.from_bytes(sample_payload().to_bytes())


def test_max_tokens_is_the_documented_limit():
    assert MAX_TOKENS == 2**40  # docs/payload.md, "Field limits"


@pytest.mark.parametrize("message, error", [
    ([2, body(num_tokens=MAX_TOKENS)], f"num_tokens must be in \\[0, {MAX_TOKENS}\\)"),
    ([2, body(num_tokens=2**64 - 1)], f"num_tokens must be in \\[0, {MAX_TOKENS}\\)"),
    ([2, body(groups=[[0, 5, MAX_TOKENS, 0, b""]])],
     f"block_size of group 0 must be in \\[1, {MAX_TOKENS}\\)"),
    ([2, body(groups=[[0, 5, 16, MAX_TOKENS, b""]])],
     f"start of group 0 must be in \\[0, {MAX_TOKENS}\\)"),
])
def test_counts_no_request_can_reach_raise_value_error_naming_the_field(message, error):
    for read, data in ((KVChecksumPayload.from_bytes, packed(message)),
                       (KVChecksumPayload.decode, b64(packed(message)))):
        with pytest.raises(ValueError, match=error):
            read(data)


def test_counts_just_below_max_tokens_decode():
    group = PayloadGroup(fingerprint=1, block_size=MAX_TOKENS - 1, start=0,
                         values=np.zeros(1, np.uint64))
    payload = KVChecksumPayload(num_tokens=MAX_TOKENS - 1, producer_tp_size=1,
                                groups={0: group, 1: PayloadGroup(1, 1, MAX_TOKENS - 2,
                                                                  np.zeros(1, np.uint64))})
    assert KVChecksumPayload.decode(payload.encode()) == payload
    with pytest.raises(ValueError, match="block_size must be in"):
        PayloadGroup(fingerprint=1, block_size=MAX_TOKENS, start=0, values=np.zeros(0, np.uint64))
    with pytest.raises(ValueError, match="num_tokens must be in"):
        KVChecksumPayload(num_tokens=MAX_TOKENS, producer_tp_size=1, groups={})


def test_a_two_million_token_payload_fits_the_limit():
    blocks = 2 * 2**20 // 16
    groups = {g: PayloadGroup(fingerprint=g, block_size=16, start=0,
                              values=np.arange(blocks, dtype=np.uint64)) for g in range(4)}
    big = KVChecksumPayload(num_tokens=2 * 2**20, producer_tp_size=8, groups=groups)
    text = big.encode()
    assert len(text) < MAX_PAYLOAD_BYTES // 8
    assert KVChecksumPayload.decode(text) == big


# -- fuzzing ------------------------------------------------------------------

uint64s = st.integers(0, 2**64 - 1)


@st.composite
def payloads(draw) -> KVChecksumPayload:
    num_tokens = draw(st.integers(0, 5000))
    groups = {}
    for group_id in draw(st.sets(st.integers(0, 2**40), max_size=4)):
        block_size = draw(st.sampled_from([1, 16, 32, 256, 1000]))
        blocks = -(-num_tokens // block_size)
        start = draw(st.integers(0, blocks))
        count = draw(st.integers(0, min(blocks - start, 40)))
        values = np.array(draw(st.lists(uint64s, min_size=count, max_size=count)),
                          dtype=np.uint64)
        groups[group_id] = PayloadGroup(fingerprint=draw(uint64s), block_size=block_size,
                                        start=start, values=values)
    return KVChecksumPayload(num_tokens=num_tokens,
                             producer_tp_size=draw(st.integers(1, 2**20)), groups=groups)


@pytest.mark.usefixtures("codec")
@FUZZ
@given(payloads())
def test_valid_payloads_round_trip_exactly(payload):
    again = KVChecksumPayload.decode(payload.encode())
    assert again == payload
    assert KVChecksumPayload.from_bytes(payload.to_bytes()) == payload
    assert again.encode() == payload.encode()


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes_decode_or_raise_value_error(data):
    decodes_or_value_error(KVChecksumPayload.from_bytes, data)
    decodes_or_value_error(KVChecksumPayload.decode, b64(data))
    decodes_or_value_error(KVChecksumPayload.decode, data)


@pytest.mark.usefixtures("codec")
@FUZZ
@given(st.text(max_size=200))
def test_random_text_decodes_or_raises_value_error(text):
    decodes_or_value_error(KVChecksumPayload.decode, text)


msgpack_leaves = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1)
                  | st.floats(allow_nan=True) | st.text(max_size=10) | st.binary(max_size=24))
msgpack_values = st.recursive(
    msgpack_leaves,
    lambda children: (st.lists(children, max_size=6)
                      | st.dictionaries(st.text(max_size=4), children, max_size=4)),
    max_leaves=40)


@FUZZ
@given(msgpack_values)
def test_random_msgpack_structures_decode_or_raise_value_error(message):
    data = packed(message)
    decodes_or_value_error(KVChecksumPayload.from_bytes, data)
    decodes_or_value_error(KVChecksumPayload.decode, b64(data))


# Fields that are sometimes right, sometimes of a near-miss type or range.
int_fields = (st.integers(-2**63, 2**64 - 1) | st.booleans() | st.floats() | st.none()
              | st.text(max_size=3) | st.binary(max_size=9) | st.just([]))
values_fields = st.binary(max_size=40) | int_fields
group_entries = st.lists(int_fields, min_size=4, max_size=4).flatmap(
    lambda head: values_fields.map(lambda v: head + [v])) | st.lists(int_fields, max_size=6)


@FUZZ
@given(st.one_of(st.just(1), int_fields), int_fields, int_fields,
       st.lists(group_entries, max_size=4) | int_fields)
def test_near_miss_payloads_decode_or_raise_value_error(version, num_tokens, tp, groups):
    data = packed([version, [num_tokens, tp, groups]])
    decodes_or_value_error(KVChecksumPayload.from_bytes, data)


@FUZZ
@given(st.integers(1, 50_000), st.sampled_from([b"\x91", b"\x81\xa1k", b"\xdc\x00\x01"]))
def test_deeply_nested_input_raises_value_error(depth, opener):
    with pytest.raises(ValueError):
        KVChecksumPayload.from_bytes(opener * depth + b"\xc0")


@pytest.mark.usefixtures("codec")
@FUZZ
@given(payloads(), st.data())
def test_mutated_payloads_decode_or_raise_value_error(payload, data):
    original = payload.to_bytes()
    mutated = bytearray(original)
    for _ in range(data.draw(st.integers(1, 4))):
        if not mutated:
            break
        position = data.draw(st.integers(0, len(mutated) - 1))
        mutated[position] ^= 1 << data.draw(st.integers(0, 7))
    decodes_or_value_error(KVChecksumPayload.from_bytes, bytes(mutated))
    decodes_or_value_error(KVChecksumPayload.decode, b64(bytes(mutated)))
    cut = data.draw(st.integers(0, len(original)))
    truncated = original[:cut]
    if cut < len(original):
        with pytest.raises(ValueError):
            KVChecksumPayload.from_bytes(truncated)
    text = payload.encode()
    text_cut = data.draw(st.integers(0, len(text)))
    decodes_or_value_error(KVChecksumPayload.decode, text[:text_cut])
    char = data.draw(st.integers(0, max(len(text) - 1, 0)))
    decodes_or_value_error(KVChecksumPayload.decode,
                           text[:char] + data.draw(st.characters()) + text[char + 1:])


# -- dependencies ---------------------------------------------------------------

ALLOWED_IMPORTS = {"__future__", "base64", "pybase64", "binascii", "operator", "dataclasses", "typing",
                   "enum", "collections", "msgpack", "numpy", "hashlib", "vllm_kvchecksum"}


@pytest.mark.parametrize("module", ["payload.py", "compare.py", "verdicts.py", "binding.py"])
def test_module_imports_no_vllm(module):
    path = os.path.join(os.path.dirname(payload_module.__file__), module)
    tree = ast.parse(open(path).read())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module)
    assert {name.split(".")[0] for name in imported} <= ALLOWED_IMPORTS
    local = {name for name in imported if name.startswith("vllm_kvchecksum")}
    assert local <= {"vllm_kvchecksum.core.payload", "vllm_kvchecksum.core.records", "vllm_kvchecksum.core.verdicts",
                     "vllm_kvchecksum.core.binding"}


# -- the bound a request puts on its payload ---------------------------------


@st.composite
def honest_payloads(draw):
    """What a producer sends: every group's blocks cover at most the tokens,
    any block size (1 included), fingerprints and values anywhere in uint64."""
    num_tokens = draw(st.integers(0, 3000))
    groups = {}
    for gid in draw(st.sets(st.integers(0, 2**20), max_size=6)):
        block_size = draw(st.sampled_from([1, 2, 16, 32, 64, 160, 2**20]))
        blocks = -(-num_tokens // block_size)
        start = draw(st.integers(0, blocks))
        count = draw(st.integers(0, blocks - start))
        values = np.array(draw(st.lists(st.integers(0, 2**64 - 1), min_size=count, max_size=count)),
                          dtype=np.uint64)
        groups[gid] = PayloadGroup(fingerprint=draw(st.integers(0, 2**64 - 1)), block_size=block_size,
                                   start=start, values=values)
    return KVChecksumPayload(num_tokens=num_tokens, producer_tp_size=draw(st.integers(1, 2**31)),
                             groups=groups, tp_local_groups=frozenset(groups))


@FUZZ
@given(honest_payloads())
def test_an_honest_payload_fits_its_requests_bound(payload):
    """The bound never refuses what a producer of the same request sends."""
    packed_bytes = payload.to_bytes()
    assert len(packed_bytes) <= max_packed_size(payload.num_tokens, len(payload.groups))
    text = payload.encode()
    assert len(text) <= max_encoded_size(payload.num_tokens, len(payload.groups))
    assert KVChecksumPayload.decode(text, max_encoded_size(payload.num_tokens, len(payload.groups))) == payload


def test_the_bound_follows_the_request_not_the_global_limit():
    short = max_encoded_size(16, 1)
    assert short < 1000 < max_encoded_size(131072, 4) < MAX_PAYLOAD_BYTES
    text = sample_payload().encode()
    with pytest.raises(ValueError, match=f"exceeds the limit of {len(text) - 1}"):
        KVChecksumPayload.decode(text, len(text) - 1)
    data = sample_payload().to_bytes()
    with pytest.raises(ValueError, match=f"exceed the limit of {len(data) - 1}"):
        KVChecksumPayload.from_bytes(data, len(data) - 1)
    assert KVChecksumPayload.decode(text, len(text)) == sample_payload()
