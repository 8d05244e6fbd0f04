"""The producer's KV checksums as they travel to the consumer.

A KVChecksumPayload holds, per KV cache group, one uint64 per block
position of the whole model (the producer's TP and PP parts already
summed by its scheduler), plus what the consumer needs to line its own
blocks up with them: the number of tokens covered and each group's block
size and first block position.

Wire format, version 2: msgpack of the pair (version, body) with

    body = (num_tokens, producer_tp_size,
            [(group_id, fingerprint, block_size, start, values), ...],
            [tp_local_group_id, ...],
            binding)

`tp_local_group_id`s are the groups whose values depend on the producer's
TP size (Mamba state whose layers do not describe their TP split).
`binding` is (block_size, values): the request content the checksums were
computed for (binding.py), one uint64 per run of block_size tokens over
[0, num_tokens), or nil for a payload bound to nothing (which a consumer
never verifies). Version 1 had no binding; a reader refuses any version
but its own with PayloadVersionError, so a consumer tells a producer of
another version from a corrupt payload.

where `values` is a msgpack bin holding the group's checksums as
little-endian uint64 (the binding's values likewise). `to_bytes` / `from_bytes` give these msgpack bytes
(for connectors that carry bytes themselves); `encode` / `decode` wrap them
in standard base64 text, for the "kv_checksums" entry of kv_transfer_params.

The payload may come from a client (kv_transfer_params are part of the
request), so decoding treats it as untrusted: any malformed input raises
ValueError and nothing else, and the size limits below bound its time and
memory before anything is allocated for it.

This module imports neither vLLM nor torch. It uses pybase64 (which vLLM
requires) when installed, else the standard library's base64.
"""

from __future__ import annotations

import binascii
import operator
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

try:
    # SIMD base64, a vLLM requirement: on a 128K-token payload of four
    # groups (350 KB of text) it decodes in about 0.01 ms where the standard
    # library's takes 0.4-0.7 ms, on the consumer's scheduler thread
    # (scripts/bench_scheduler.py --consumer). Same alphabet and padding;
    # it refuses a few malformed texts the standard library lets through
    # (extra trailing "="), and raises binascii.Error, a ValueError.
    import pybase64 as _base64
except ImportError:  # without vLLM (a GPU box, or the package alone)
    import base64 as _base64

PAYLOAD_VERSION = 2

# Longest base64 text `decode` accepts. A group costs 8 bytes per block
# position, about 10.7 once in base64: a 2M-token prompt with 16-token blocks
# is 131072 positions, 1.4 MB of base64 per group, and even 1-token blocks
# (16.8 MB per group) leave room for three groups. 64 MiB is far above any
# real payload while keeping a hostile one to a bounded amount of work.
MAX_PAYLOAD_BYTES = 64 * 2**20

# Longest msgpack input `from_bytes` accepts: what MAX_PAYLOAD_BYTES of
# base64 decodes to.
MAX_PACKED_BYTES = MAX_PAYLOAD_BYTES // 4 * 3

# Most groups a payload may list (models have a handful of KV cache groups).
# It is also msgpack's array length limit, so a declared huge container
# fails before anything is allocated for it.
MAX_GROUPS = 1024

_UINT64_LIMIT = 2**64
# Counts and positions: non-negative and small enough for int64 arithmetic.
_COUNT_LIMIT = 2**63

# Token counts, block sizes and block positions must be below this: 2**40
# (about 10**12) tokens is far beyond any context length or KV cache block,
# so only a forged payload comes near it. The comparison does not rely on
# it (its memory follows the consumer's own blocks, see compare.py); it
# refuses early what no producer can send.
MAX_TOKENS = 2**40

# Bytes a payload may spend besides its values: the header, and per group
# its fields and the TP-local list entry (msgpack ints take at most 9 bytes).
_FIXED_BYTES = 64
_GROUP_BYTES = 64


def max_packed_size(num_tokens: int, num_groups: int) -> int:
    """The most msgpack bytes an honest payload of a request takes.

    num_tokens: the request's tokens; num_groups: the consumer's transfer
    groups. One uint64 per token and group (block size 1, the smallest
    there is), as many again for the binding, plus the fields: far above
    any producer's payload (8 bytes per block), and bounded by the request,
    so a short prompt cannot make the scheduler decode megabytes.
    """
    return _FIXED_BYTES + (max(num_groups, 1) + 1) * (_GROUP_BYTES + 8 * max(num_tokens, 1))


def max_encoded_size(num_tokens: int, num_groups: int) -> int:
    """max_packed_size as base64 text (kv_transfer_params)."""
    return -(-max_packed_size(num_tokens, num_groups) // 3) * 4


_BODY_FIELDS = ("num_tokens", "producer_tp_size", "groups", "tp_local_groups", "binding")
_GROUP_FIELDS = ("group_id", "fingerprint", "block_size", "start", "values")


class PayloadVersionError(ValueError):
    """The payload is of another version than this reader's (a producer
    running another release of the series)."""

    def __init__(self, version: int):
        super().__init__(f"payload version {version} is not supported (this reader knows version "
                         f"{PAYLOAD_VERSION}: run one release of the series on producers and consumers)")
        self.version = version


def _short(value: Any) -> str:
    """Client-supplied data, described briefly enough for an error message."""
    if isinstance(value, (bytes, str, list, dict)):
        return f"of length {len(value)}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _checked_int(name: str, value: Any, low: int, limit: int) -> int:
    """`value` as a Python int in [low, limit), or ValueError naming `name`.

    Accepts ints and numpy integers; bool and float are refused, so a
    payload field is never silently reinterpreted.
    """
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be an integer, got bool {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise ValueError(
            f"{name} must be an integer, got {type(value).__name__} {_short(value)}") from None
    if not low <= number < limit:
        raise ValueError(f"{name} must be in [{low}, {limit}), got {number}")
    return number


def _uint64_values(name: str, values: Any) -> np.ndarray:
    """`values` as a 1-D uint64 array, or ValueError naming `name`."""
    if not isinstance(values, np.ndarray) or values.ndim != 1 or values.dtype.kind != "u" \
            or values.dtype.itemsize != 8:
        raise ValueError(f"{name} must be a 1-D uint64 numpy array, got "
                         f"{getattr(values, 'dtype', type(values).__name__)} "
                         f"with shape {getattr(values, 'shape', None)}")
    return values.astype(np.uint64, copy=False)


@dataclass(frozen=True, eq=False)
class PayloadGroup:
    """The producer's checksums of one KV cache group.

    values[i] is the checksum of block position start + i, the tokens
    [(start + i) * block_size, (start + i + 1) * block_size) of the request
    (fewer in the last block). `fingerprint` identifies the group's layers
    and dtypes on the producer (the sum of its PP stages' fingerprints).
    """

    fingerprint: int
    block_size: int
    start: int
    values: np.ndarray

    def __post_init__(self):
        set_field = object.__setattr__
        set_field(self, "fingerprint",
                  _checked_int("fingerprint", self.fingerprint, 0, _UINT64_LIMIT))
        set_field(self, "block_size", _checked_int("block_size", self.block_size, 1, MAX_TOKENS))
        set_field(self, "start", _checked_int("start", self.start, 0, MAX_TOKENS))
        set_field(self, "values", _uint64_values("values", self.values))

    @property
    def num_blocks(self) -> int:
        return int(self.values.shape[0])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PayloadGroup):
            return NotImplemented
        return (self.fingerprint == other.fingerprint and self.block_size == other.block_size
                and self.start == other.start and np.array_equal(self.values, other.values))

    __hash__ = None  # mutable numpy values


@dataclass(frozen=True, eq=False)
class PayloadBinding:
    """The request content the checksums were computed for (binding.py).

    values[i] binds tokens [i * block_size, min((i + 1) * block_size,
    num_tokens)) of the request: one value per run, covering every token
    the payload covers.
    """

    block_size: int
    values: np.ndarray

    def __post_init__(self):
        set_field = object.__setattr__
        set_field(self, "block_size", _checked_int("binding block_size", self.block_size, 1, MAX_TOKENS))
        set_field(self, "values", _uint64_values("binding values", self.values))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PayloadBinding):
            return NotImplemented
        return self.block_size == other.block_size and np.array_equal(self.values, other.values)

    __hash__ = None


@dataclass(frozen=True, eq=False)
class KVChecksumPayload:
    """The producer's summed checksums of one request, per KV cache group id.

    num_tokens: the tokens the checksums cover, [0, num_tokens); slots past
      it in the last block are not part of any value.
    producer_tp_size: the producer's TP size (some groups are compared only
      between equal TP sizes).
    groups: the groups the producer checksummed; a group it skipped or could
      not sum is absent.
    tp_local_groups: of those, the ones whose values depend on the TP size:
      a consumer of another TP size leaves a group out only when both sides
      say so (otherwise its fingerprint decides).
    binding: what request content the values are for (None: bound to
      nothing, which a consumer never verifies).
    """

    num_tokens: int
    producer_tp_size: int
    groups: dict[int, PayloadGroup]
    tp_local_groups: frozenset[int] = frozenset()
    binding: PayloadBinding | None = None

    def __post_init__(self):
        set_field = object.__setattr__
        set_field(self, "num_tokens", _checked_int("num_tokens", self.num_tokens, 0, MAX_TOKENS))
        set_field(self, "producer_tp_size",
                  _checked_int("producer_tp_size", self.producer_tp_size, 1, _COUNT_LIMIT))
        if not isinstance(self.groups, dict):
            raise ValueError(f"groups must be a dict, got {type(self.groups).__name__}")
        if len(self.groups) > MAX_GROUPS:
            raise ValueError(f"at most {MAX_GROUPS} groups, got {len(self.groups)}")
        groups = {}
        for group_id, group in self.groups.items():
            group_id = _checked_int("group id", group_id, 0, _COUNT_LIMIT)
            if not isinstance(group, PayloadGroup):
                raise ValueError(f"group {group_id} must be a PayloadGroup, "
                                 f"got {type(group).__name__}")
            blocks_with_tokens = -(-self.num_tokens // group.block_size)
            if group.start + group.num_blocks > blocks_with_tokens:
                raise ValueError(
                    f"group {group_id} has blocks up to position "
                    f"{group.start + group.num_blocks - 1}, but {self.num_tokens} tokens fill "
                    f"only {blocks_with_tokens} blocks of {group.block_size}")
            groups[group_id] = group
        set_field(self, "groups", groups)
        if not isinstance(self.tp_local_groups, (set, frozenset, list, tuple)):
            raise ValueError(f"tp_local_groups must be a set, got {type(self.tp_local_groups).__name__}")
        set_field(self, "tp_local_groups", frozenset(
            _checked_int("TP-local group id", g, 0, _COUNT_LIMIT) for g in self.tp_local_groups))
        if self.binding is not None:
            if not isinstance(self.binding, PayloadBinding):
                raise ValueError(f"binding must be a PayloadBinding, got {type(self.binding).__name__}")
            runs = -(-self.num_tokens // self.binding.block_size)
            if self.binding.values.shape[0] != runs:
                raise ValueError(f"the binding holds {self.binding.values.shape[0]} values, but "
                                 f"{self.num_tokens} tokens make {runs} runs of {self.binding.block_size}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KVChecksumPayload):
            return NotImplemented
        return (self.num_tokens == other.num_tokens
                and self.producer_tp_size == other.producer_tp_size
                and self.groups == other.groups
                and self.tp_local_groups == other.tp_local_groups
                and self.binding == other.binding)

    __hash__ = None

    # -- writing ---------------------------------------------------------

    def to_bytes(self) -> bytes:
        """The payload as msgpack bytes, for connectors that carry bytes."""
        groups = [(group_id, group.fingerprint, group.block_size, group.start,
                   group.values.astype("<u8", copy=False).tobytes())
                  for group_id, group in sorted(self.groups.items())]
        binding = None if self.binding is None else (
            self.binding.block_size, self.binding.values.astype("<u8", copy=False).tobytes())
        body = [self.num_tokens, self.producer_tp_size, groups, sorted(self.tp_local_groups), binding]
        return msgpack.packb((PAYLOAD_VERSION, body), use_bin_type=True)

    def encode(self) -> str:
        """The payload as base64 text, for kv_transfer_params["kv_checksums"]."""
        return _base64.b64encode(self.to_bytes()).decode("ascii")

    # -- reading ---------------------------------------------------------

    @classmethod
    def decode(cls, text: str | bytes, max_size: int = MAX_PAYLOAD_BYTES) -> KVChecksumPayload:
        """Read a payload written by `encode`; ValueError for anything else.

        max_size: the longest text to decode (max_encoded_size of the
        request, when it is known), at most MAX_PAYLOAD_BYTES.
        """
        if not isinstance(text, (str, bytes)):
            raise ValueError(
                f"KV checksum payload must be base64 text, got {type(text).__name__}")
        limit = min(max_size, MAX_PAYLOAD_BYTES)
        if len(text) > limit:
            raise ValueError(f"KV checksum payload of {len(text)} characters exceeds "
                             f"the limit of {limit}")
        try:
            packed = _base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"KV checksum payload is not valid base64: {exc}") from None
        return cls.from_bytes(packed)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview,
                   max_size: int = MAX_PACKED_BYTES) -> KVChecksumPayload:
        """Read a payload written by `to_bytes`; ValueError for anything else.

        max_size: the most bytes to decode (max_packed_size of the request,
        when it is known), at most MAX_PACKED_BYTES.
        """
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ValueError(f"KV checksum payload must be bytes, got {type(data).__name__}")
        try:
            limit = min(max_size, MAX_PACKED_BYTES)
            if len(data) > limit:
                raise ValueError(f"{len(data)} bytes exceed the limit of {limit}")
            data = bytes(data)
            return _payload_from_message(_unpack(data))
        except PayloadVersionError:
            raise
        except ValueError as exc:
            raise ValueError(f"invalid KV checksum payload: {exc}") from None
        except Exception as exc:  # anything a hostile input provokes is a ValueError
            raise ValueError(f"invalid KV checksum payload: "
                             f"{type(exc).__name__}: {exc}") from None


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not allowed")


def _unpack(data: bytes) -> Any:
    """msgpack-decode `data` with limits that fit a payload and nothing bigger."""
    try:
        return msgpack.unpackb(data, use_list=True, raw=False, strict_map_key=True,
                               max_str_len=64, max_bin_len=len(data), max_array_len=MAX_GROUPS,
                               max_map_len=0, max_ext_len=0, ext_hook=_refuse_ext)
    except msgpack.exceptions.StackError:
        raise ValueError("not valid msgpack (nested too deeply)") from None
    except Exception as exc:
        detail = str(exc) or "malformed input"
        raise ValueError(f"not valid msgpack ({type(exc).__name__}: {detail})") from None


def _fields(name: str, value: Any, names: tuple[str, ...]) -> list:
    """`value` as a list of len(names) fields, or ValueError naming `name`."""
    if not isinstance(value, list):
        raise ValueError(f"{name} must be an array, got {type(value).__name__} {_short(value)}")
    if len(value) != len(names):
        raise ValueError(f"{name} must have {len(names)} fields ({', '.join(names)}), "
                         f"got {len(value)}")
    return value


def _payload_from_message(message: Any) -> KVChecksumPayload:
    """Build the payload from the decoded (version, body) pair, checking every type."""
    if isinstance(message, list) and message and isinstance(message[0], int) \
            and not isinstance(message[0], bool) and message[0] != PAYLOAD_VERSION:
        raise PayloadVersionError(message[0])
    version, body = _fields("payload", message, ("version", "body"))
    _checked_int("payload version", version, PAYLOAD_VERSION, PAYLOAD_VERSION + 1)
    num_tokens, producer_tp_size, group_list, tp_local_list, binding_entry = _fields(
        "payload body", body, _BODY_FIELDS)
    if not isinstance(tp_local_list, list):
        raise ValueError(f"tp_local_groups must be an array, got {type(tp_local_list).__name__}")
    num_tokens = _checked_int("num_tokens", num_tokens, 0, MAX_TOKENS)
    producer_tp_size = _checked_int("producer_tp_size", producer_tp_size, 1, _COUNT_LIMIT)
    if not isinstance(group_list, list):
        raise ValueError(f"groups must be an array, got {type(group_list).__name__}")
    groups: dict[int, PayloadGroup] = {}
    for index, entry in enumerate(group_list):
        group_id, fingerprint, block_size, start, values = _fields(
            f"group entry {index}", entry, _GROUP_FIELDS)
        group_id = _checked_int(f"group id of entry {index}", group_id, 0, _COUNT_LIMIT)
        if group_id in groups:
            raise ValueError(f"group {group_id} is listed twice")
        if not isinstance(values, bytes):
            raise ValueError(f"values of group {group_id} must be bin, "
                             f"got {type(values).__name__}")
        if len(values) % 8:
            raise ValueError(f"values of group {group_id} hold {len(values)} bytes, "
                             "not a multiple of 8")
        groups[group_id] = PayloadGroup(
            fingerprint=_checked_int(f"fingerprint of group {group_id}", fingerprint,
                                     0, _UINT64_LIMIT),
            block_size=_checked_int(f"block_size of group {group_id}", block_size,
                                    1, MAX_TOKENS),
            start=_checked_int(f"start of group {group_id}", start, 0, MAX_TOKENS),
            values=np.frombuffer(values, dtype="<u8").astype(np.uint64))
    binding = None
    if binding_entry is not None:
        block_size, values = _fields("binding", binding_entry, ("block_size", "values"))
        if not isinstance(values, bytes) or len(values) % 8:
            raise ValueError("binding values must be bin of whole uint64s, got "
                             f"{type(values).__name__} {_short(values)}")
        binding = PayloadBinding(
            block_size=_checked_int("binding block_size", block_size, 1, MAX_TOKENS),
            values=np.frombuffer(values, dtype="<u8").astype(np.uint64))
    return KVChecksumPayload(num_tokens=num_tokens, producer_tp_size=producer_tp_size,
                             groups=groups, tp_local_groups=frozenset(
                                 _checked_int(f"TP-local group {i}", g, 0, _COUNT_LIMIT)
                                 for i, g in enumerate(tp_local_list)), binding=binding)
