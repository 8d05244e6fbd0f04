"""Fault kinds for KV cache drills: pure functions that corrupt one request's
loaded KV in place, and say where the checksum must see it.

A fault-injecting connector (for operators' drills: does the consumer report
the damage where it should?) calls these on the KV a load just wrote. They
import only torch and numpy, never vLLM, so they are unit-tested on small
CPU caches against layer_block_checksums().

Common arguments of every fault function:

  caches: layer name -> that layer's KV cache tensor, one tensor holding K and
    V in its cell, block dimension first and cell last: "HND"
    [kernel_blocks, heads, tokens, cell] or "NHD" [kernel_blocks, tokens,
    heads, cell] (`layout`). The token dimension may be a kernel block size
    dividing block_size (logical block b = kernel blocks b*KB .. b*KB+KB-1).
    Layers sharing one tensor are corrupted once (a block-wide fault applied
    twice to the same memory would undo itself).
  block_ids: physical block ids of the loaded blocks of one KV cache group,
    as in layer_block_checksums(): block_ids[i] sits at request block
    position first_position + i.
  first_position: block position of block_ids[0] (after a local prefix-cache
    hit the load starts later than position 0).
  num_tokens: the request's tokens; slots at or past it are no value's part.
  block_size: tokens per block.
  rng: random.Random for every choice not given explicitly.

Every function changes bytes for real: it compares the bytes it would write
with those present, picks again (at most MAX_TRIES times) when a random
choice would change nothing, and raises ValueError when an explicit choice
changes nothing or no choice does. It returns a list of Injection records.
Faults other than change_tail only touch token slots below num_tokens (or,
for block-wide faults, whole blocks whose valid slots change), so the
checksum mismatch lands exactly at the reported positions.
"""

from __future__ import annotations

import inspect
import random
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

__all__ = ["Injection", "FAULT_KINDS", "MAX_TRIES", "inject", "flip_bit",
           "overwrite_piece", "swap_tokens", "swap_heads", "swap_layers",
           "swap_blocks", "misplace_block", "change_tail"]

MAX_TRIES = 64
PIECE_BYTES = 8
_MASK64 = 2**64 - 1


@dataclass(frozen=True)
class Injection:
    """One injected fault.

    positions / block_ids: the request block positions hit and their
    physical block ids (same order). token: token index within the block
    (other_token: the second token of swap_tokens). head: local KV head
    index of the tensor. byte: byte offset within the token's cell, where
    relevant. detectable: whether the checksum must report a mismatch at
    every one of `positions` (and nowhere else).
    """

    kind: str
    layer: str | None
    positions: tuple[int, ...]
    block_ids: tuple[int, ...]
    detectable: bool
    token: int | None = None
    head: int | None = None
    byte: int | None = None
    bit: int | None = None
    other_layer: str | None = None
    other_token: int | None = None
    other_head: int | None = None
    source_block_id: int | None = None


# ----------------------------------------------------------------- helpers

class _Req:
    """The loaded blocks of one request, and each layer's cache as bytes
    [num_blocks, heads, KB, kernel_tokens, cell_bytes] (a view, no copy)."""

    def __init__(self, caches, block_ids, first_position, num_tokens,
                 block_size, layout):
        if layout not in ("HND", "NHD"):
            raise ValueError(f"layout must be 'HND' or 'NHD', got {layout!r}")
        if not caches:
            raise ValueError("no KV cache tensors given")
        if first_position < 0 or num_tokens <= 0 or block_size <= 0:
            raise ValueError("first_position must be >= 0, num_tokens and "
                             "block_size > 0")
        self.block_ids = [int(b) for b in np.asarray(block_ids).reshape(-1)]
        self.first_position = first_position
        self.num_tokens = num_tokens
        self.block_size = block_size
        self.bytes: dict[str, torch.Tensor] = {}
        seen = set()
        self.distinct: list[str] = []  # layers not sharing memory with an earlier one
        for name, t in caches.items():
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise ValueError(f"layer {name}: a 4-D cache tensor is needed")
            b = _byte_view(t, layout, block_size, name)
            self.bytes[name] = b
            key = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
            if key not in seen:
                seen.add(key)
                self.distinct.append(name)
        for name, b in self.bytes.items():
            if self.block_ids and max(self.block_ids) >= b.shape[0]:
                raise ValueError(f"layer {name}: block id {max(self.block_ids)} "
                                 f"outside its {b.shape[0]} blocks")
        # Loaded positions that hold tokens.
        last = (num_tokens - 1) // block_size
        self.positions = [first_position + i for i in range(len(self.block_ids))
                          if first_position + i <= last]
        if not self.positions:
            raise ValueError("the load holds no block with request tokens")

    def block_id(self, position: int) -> int:
        if position not in self.positions:
            raise ValueError(f"block position {position} is not a loaded block "
                             f"holding tokens ({self.positions})")
        return self.block_ids[position - self.first_position]

    def valid(self, position: int) -> int:
        return max(0, min(self.block_size,
                          self.num_tokens - position * self.block_size))

    def kt(self, name: str) -> int:
        return self.bytes[name].shape[3]

    def cell(self, name, position, head, token) -> torch.Tensor:
        b = self.bytes[name]
        kt = b.shape[3]
        return b[self.block_id(position), head, token // kt, token % kt]

    def get(self, name, block_id, lo, hi) -> torch.Tensor:
        """Copy of slots [lo, hi) of a physical block: [heads, hi - lo, cell]."""
        b = self.bytes[name]
        parts = [b[block_id, :, k, s:e] for k, s, e in _ranges(lo, hi, b.shape[3])]
        return torch.cat(parts, dim=1).clone()

    def put(self, name, block_id, lo, data) -> None:
        b = self.bytes[name]
        off = 0
        for k, s, e in _ranges(lo, lo + data.shape[1], b.shape[3]):
            b[block_id, :, k, s:e] = data[:, off:off + e - s]
            off += e - s


def byte_blocks(caches: Mapping[str, torch.Tensor], block_ids: Sequence[int], first_position: int,
                num_tokens: int, block_size: int, layout: str = "HND") -> _Req:
    """A request's blocks in `caches` as the faults address them (for
    kv_witness): positions holding tokens, block ids, valid slots, bytes."""
    return _Req(caches, block_ids, first_position, num_tokens, block_size, layout)


def _byte_view(t: torch.Tensor, layout: str, block_size: int, name: str):
    if t.stride(-1) != 1:
        raise ValueError(f"layer {name}: the cell must be contiguous")
    u = t.view(torch.uint8)
    tok = u.shape[2] if layout == "HND" else u.shape[1]
    if block_size % tok or u.shape[0] % (block_size // tok):
        raise ValueError(f"layer {name}: kernel blocks of {tok} tokens do not "
                         f"tile {block_size}-token blocks")
    kb = block_size // tok
    nb = u.shape[0] // kb
    if u.shape[-1] % PIECE_BYTES:
        raise ValueError(f"layer {name}: cell of {u.shape[-1]} bytes is not "
                         "whole 8-byte pieces")
    if layout == "HND":
        return u.view(nb, kb, *u.shape[1:]).permute(0, 2, 1, 3, 4)
    return u.view(nb, kb, *u.shape[1:]).permute(0, 3, 1, 2, 4)


def _ranges(lo, hi, kt):
    """(kernel block, start, stop) pieces of the slot range [lo, hi)."""
    t = lo
    while t < hi:
        k, s = divmod(t, kt)
        e = min(kt, s + hi - t)
        yield k, s, e
        t += e - s


def _pieces(cell: torch.Tensor) -> list[int]:
    """A cell's bytes as little-endian 64-bit pieces (Python ints)."""
    raw = cell.detach().cpu().contiguous().numpy().tobytes()
    return [int.from_bytes(raw[i:i + 8], "little") for i in range(0, len(raw), 8)]


def _slice_sum(cells: torch.Tensor, first_token: int) -> int:
    """sum_j x_j * (2j + 1) mod 2**64 of consecutive token cells [n, cell]
    of one slice, the first at request token position first_token."""
    total = 0
    for i in range(cells.shape[0]):
        xs = _pieces(cells[i])
        p = len(xs)
        for q, x in enumerate(xs):
            total += x * (2 * ((first_token + i) * p + q) + 1)
    return total & _MASK64


def _pick(value, choices, rng):
    if value is not None:
        return value
    choices = list(choices)
    if not choices:
        raise ValueError("nothing to choose from")
    return rng.choice(choices)


def _retry(attempt, explicit: bool, what: str):
    """Run attempt() (None: it would change nothing) up to MAX_TRIES times."""
    for _ in range(1 if explicit else MAX_TRIES):
        inj = attempt()
        if inj is not None:
            return [inj]
    raise ValueError(f"{what}: "
                     + ("the given choice changes no byte it must change" if explicit
                        else f"no random choice changed the bytes in {MAX_TRIES} tries"))


def _random_bytes(rng, n, like: torch.Tensor) -> torch.Tensor:
    data = torch.frombuffer(bytearray(rng.randbytes(n)), dtype=torch.uint8)
    return data.to(like.device)


def _pick_cell(r, rng: random.Random, layer, position, token, head):
    """One token's cell of one head: the given choices, the rest drawn.

    Returns (layer name, block position, token, head, the cell's bytes).
    """
    name = _pick(layer, r.distinct, rng)
    pos = _pick(position, r.positions, rng)
    tok = _pick(token, range(r.valid(pos)), rng)
    if not 0 <= tok < r.valid(pos):
        raise ValueError(f"token {tok} is not a token of block {pos}")
    h = _pick(head, range(r.bytes[name].shape[1]), rng)
    return name, pos, tok, h, r.cell(name, pos, h, tok)


# ----------------------------------------------------------------- faults

def flip_bit(caches: Mapping[str, torch.Tensor], block_ids: Sequence[int], *,
             num_tokens: int, block_size: int, rng: random.Random,
             first_position: int = 0, layout: str = "HND",
             layer: str | None = None, position: int | None = None,
             token: int | None = None, head: int | None = None,
             byte: int | None = None, bit: int | None = None) -> list[Injection]:
    """Bit rot: one bit of one token's cell flips (memory or link error).

    Always detectable: a piece changes by +-2**k, and odd weight and factor
    keep the block's sum changed mod 2**64.
    """
    r = _Req(caches, block_ids, first_position, num_tokens, block_size, layout)
    name, pos, tok, h, cell = _pick_cell(r, rng, layer, position, token, head)
    off = _pick(byte, range(cell.shape[0]), rng)
    b = _pick(bit, range(8), rng)
    before = cell[off].clone()
    cell[off] ^= (1 << b)
    assert not torch.equal(before, cell[off])
    return [Injection("flip_bit", name, (pos,), (r.block_id(pos),), True,
                      token=tok, head=h, byte=off, bit=b)]


def overwrite_piece(caches: Mapping[str, torch.Tensor], block_ids: Sequence[int], *,
                    num_tokens: int, block_size: int, rng: random.Random,
                    first_position: int = 0, layout: str = "HND",
                    layer: str | None = None, position: int | None = None,
                    token: int | None = None, head: int | None = None,
                    byte: int | None = None, value: bytes | None = None
                    ) -> list[Injection]:
    """A partial overwrite: one aligned 8-byte piece of a token's cell is
    replaced by different bytes (a stray write, a torn DMA).

    Always detectable: exactly one piece changes, by a non-zero amount.
    """
    r = _Req(caches, block_ids, first_position, num_tokens, block_size, layout)
    explicit = value is not None
    if value is not None and len(value) != PIECE_BYTES:
        raise ValueError(f"value must be {PIECE_BYTES} bytes")

    def attempt():
        name, pos, tok, h, cell = _pick_cell(r, rng, layer, position, token, head)
        off = _pick(byte, range(0, cell.shape[0], PIECE_BYTES), rng)
        if off % PIECE_BYTES or not 0 <= off < cell.shape[0]:
            raise ValueError(f"byte offset {off} is not a piece of the cell")
        new = (torch.frombuffer(bytearray(value), dtype=torch.uint8).to(cell.device)
               if explicit else _random_bytes(rng, PIECE_BYTES, cell))
        if torch.equal(new, cell[off:off + PIECE_BYTES]):
            return None
        cell[off:off + PIECE_BYTES] = new
        return Injection("overwrite_piece", name, (pos,), (r.block_id(pos),), True,
                         token=tok, head=h, byte=off)

    return _retry(attempt, explicit, "overwrite_piece")


def swap_tokens(caches: Mapping[str, torch.Tensor], block_ids: Sequence[int], *,
                num_tokens: int, block_size: int, rng: random.Random,
                first_position: int = 0, layout: str = "HND",
                layer: str | None = None, head: int | None = None,
                position: int | None = None, token: int | None = None,
                other_position: int | None = None, other_token: int | None = None
                ) -> list[Injection]:
    """Descriptor misplacement of tokens: two tokens' cells of one layer and
    head trade places, in one block or across two (a wrong slot mapping).

    Detectable exactly when each hit block's weighted piece sum changes
    (computed here from the definition): the bytes must differ, and a swap
    of tokens whose pieces are a permutation of each other's could cancel.
    Random choices are retried until the swap is detectable.
    """
    r = _Req(caches, block_ids, first_position, num_tokens, block_size, layout)
    explicit = token is not None and other_token is not None

    def attempt():
        name = _pick(layer, r.distinct, rng)
        h = _pick(head, range(r.bytes[name].shape[1]), rng)
        p1 = _pick(position, r.positions, rng)
        if other_position is not None:
            p2 = other_position
        else:  # a given other_token means the same block
            p2 = p1 if other_token is not None else rng.choice(r.positions)
        t1 = _pick(token, range(r.valid(p1)), rng)
        others = [t for t in range(r.valid(p2)) if (p2, t) != (p1, t1)]
        if other_token is None and not others:
            return None
        t2 = _pick(other_token, others, rng)
        for p, t in ((p1, t1), (p2, t2)):
            if not 0 <= t < r.valid(p):
                raise ValueError(f"token {t} is not a token of block {p}")
        if (p1, t1) == (p2, t2):
            raise ValueError("swap_tokens needs two different tokens")
        c1, c2 = r.cell(name, p1, h, t1), r.cell(name, p2, h, t2)
        a, b = c1.clone(), c2.clone()
        if torch.equal(a, b):
            return None
        T1, T2 = p1 * block_size + t1, p2 * block_size + t2
        if p1 == p2:
            deltas = [_slice_sum(b[None], T1) - _slice_sum(a[None], T1)
                      + _slice_sum(a[None], T2) - _slice_sum(b[None], T2)]
        else:
            deltas = [_slice_sum(b[None], T1) - _slice_sum(a[None], T1),
                      _slice_sum(a[None], T2) - _slice_sum(b[None], T2)]
        detectable = all(d & _MASK64 for d in deltas)
        if not detectable and not explicit:
            return None
        c1.copy_(b)
        c2.copy_(a)
        pos = (p1,) if p1 == p2 else (p1, p2)
        return Injection("swap_tokens", name, pos, tuple(r.block_id(p) for p in pos),
                         detectable, token=t1, head=h, other_token=t2)

    return _retry(attempt, explicit, "swap_tokens")


def swap_heads(caches: Mapping[str, torch.Tensor], block_ids: Sequence[int], *,
               num_tokens: int, block_size: int, rng: random.Random,
               first_position: int = 0, layout: str = "HND",
               layer: str | None = None, position: int | None = None,
               head: int | None = None, other_head: int | None = None
               ) -> list[Injection]:
    """Descriptor misplacement of heads: two KV heads of one layer trade
    their data in one block (token slots below num_tokens), as a wrong head
    stride or TP head mapping would.

    The block's sum changes by 2 * (h1 - h2) * (S2 - S1), S the heads'
    weighted piece sums; detectable is computed from that.
    """
    r = _Req(caches, block_ids, first_position, num_tokens, block_size, layout)
    explicit = head is not None and other_head is not None

    def attempt():
        name = _pick(layer, r.distinct, rng)
        heads = r.bytes[name].shape[1]
        if heads < 2:
            raise ValueError(f"layer {name} has one KV head: nothing to swap")
        pos = _pick(position, r.positions, rng)
        h1 = _pick(head, range(heads), rng)
        h2 = _pick(other_head, [h for h in range(heads) if h != h1], rng)
        if h1 == h2:
            raise ValueError("swap_heads needs two different heads")
        bid, n = r.block_id(pos), r.valid(pos)
        data = r.get(name, bid, 0, n)
        if torch.equal(data[h1], data[h2]):
            return None
        first = pos * block_size
        delta = 2 * (h1 - h2) * (_slice_sum(data[h2], first) - _slice_sum(data[h1], first))
        detectable = bool(delta & _MASK64)
        if not detectable and not explicit:
            return None
        swapped = data.clone()
        swapped[[h1, h2]] = data[[h2, h1]]
        r.put(name, bid, 0, swapped)
        return Injection("swap_heads", name, (pos,), (bid,), detectable,
                         head=h1, other_head=h2)

    return _retry(attempt, explicit, "swap_heads")


def swap_layers(caches: Mapping[str, torch.Tensor], block_ids: Sequence[int], *,
                num_tokens: int, block_size: int, rng: random.Random,
                first_position: int = 0, layout: str = "HND",
                layer: str | None = None, other_layer: str | None = None,
                position: int | None = None) -> list[Injection]:
    """Descriptor misplacement of layers: two layers trade their data of one
    block (all heads, token slots below num_tokens), as a wrong per-layer
    base address would.

    detectable when the bytes differ: the slices' factors differ by
    2**17 * (l1 - l2), so the change cancels only if the weighted sums agree
    in their low 47 bits or so (about 2**-47 for unrelated data).
    """
    r = _Req(caches, block_ids, first_position, num_tokens, block_size, layout)
    explicit = layer is not None and other_layer is not None

    def attempt():
        l1 = _pick(layer, r.distinct, rng)
        shape = r.bytes[l1].shape[1:]
        others = [n for n in r.distinct if n != l1 and r.bytes[n].shape[1:] == shape]
        if other_layer is None and not others:
            raise ValueError("swap_layers needs two layers of one shape that do "
                             "not share memory")
        l2 = _pick(other_layer, others, rng)
        if l1 == l2 or r.bytes[l2].shape[1:] != shape:
            raise ValueError("swap_layers needs two different layers of one shape")
        pos = _pick(position, r.positions, rng)
        bid, n = r.block_id(pos), r.valid(pos)
        a, b = r.get(l1, bid, 0, n), r.get(l2, bid, 0, n)
        if torch.equal(a, b):
            return None  # also: two names sharing one tensor
        r.put(l1, bid, 0, b)
        r.put(l2, bid, 0, a)
        return Injection("swap_layers", l1, (pos,), (bid,), True, other_layer=l2)

    return _retry(attempt, explicit, "swap_layers")


def swap_blocks(caches: Mapping[str, torch.Tensor], block_ids: Sequence[int], *,
                num_tokens: int, block_size: int, rng: random.Random,
                first_position: int = 0, layout: str = "HND",
                position: int | None = None, other_position: int | None = None
                ) -> list[Injection]:
    """Descriptor misplacement of blocks: two block positions of the request
    trade their whole blocks in every layer (a permuted block list).

    detectable at both positions when each one's valid slots change.
    """
    r = _Req(caches, block_ids, first_position, num_tokens, block_size, layout)
    if len(r.positions) < 2:
        raise ValueError("swap_blocks needs two loaded blocks")
    explicit = position is not None and other_position is not None

    def attempt():
        p1 = _pick(position, r.positions, rng)
        p2 = _pick(other_position, [p for p in r.positions if p != p1], rng)
        if p1 == p2:
            raise ValueError("swap_blocks needs two different positions")
        b1, b2 = r.block_id(p1), r.block_id(p2)
        n1, n2 = r.valid(p1), r.valid(p2)
        blocks = {n: (r.get(n, b1, 0, block_size), r.get(n, b2, 0, block_size))
                  for n in r.distinct}
        if all(torch.equal(x[:, :n1], y[:, :n1]) for x, y in blocks.values()) or \
                all(torch.equal(x[:, :n2], y[:, :n2]) for x, y in blocks.values()):
            return None
        for n, (x, y) in blocks.items():
            r.put(n, b1, 0, y)
            r.put(n, b2, 0, x)
        return Injection("swap_blocks", None, (p1, p2), (b1, b2), True)

    return _retry(attempt, explicit, "swap_blocks")


def misplace_block(caches: Mapping[str, torch.Tensor], block_ids: Sequence[int], *,
                   num_tokens: int, block_size: int, rng: random.Random,
                   source_block_id: int, first_position: int = 0,
                   layout: str = "HND", position: int | None = None
                   ) -> list[Injection]:
    """Another request's KV: the block at one position is overwritten, in
    every layer, by a copy of physical block source_block_id (e.g. a block
    of another request, a stale or freed block).

    detectable when the position's valid slots change.
    """
    r = _Req(caches, block_ids, first_position, num_tokens, block_size, layout)
    for n, b in r.bytes.items():
        if not 0 <= source_block_id < b.shape[0]:
            raise ValueError(f"source block {source_block_id} outside layer {n}")
    explicit = position is not None

    def attempt():
        pos = _pick(position, r.positions, rng)
        bid, n = r.block_id(pos), r.valid(pos)
        if bid == source_block_id:
            return None
        src = {k: r.get(k, source_block_id, 0, block_size) for k in r.distinct}
        if all(torch.equal(s[:, :n], r.get(k, bid, 0, n)) for k, s in src.items()):
            return None
        for k, s in src.items():
            r.put(k, bid, 0, s)
        return Injection("misplace_block", None, (pos,), (bid,), True,
                         source_block_id=source_block_id)

    return _retry(attempt, explicit, "misplace_block")


def change_tail(caches: Mapping[str, torch.Tensor], block_ids: Sequence[int], *,
                num_tokens: int, block_size: int, rng: random.Random,
                first_position: int = 0, layout: str = "HND",
                layer: str | None = None) -> list[Injection]:
    """Junk past the prompt: the slots at or past num_tokens in the request's
    last (partial) block get other KV values in one layer, all heads (copies
    of the block's own tokens), as decode or draft tokens written after the
    load would.

    Never detectable, by design: those slots are no part of any checksum, so
    the checksum must NOT report this (a false-alarm drill). Raises
    ValueError when the last block is full (no such slots) or not loaded.
    """
    r = _Req(caches, block_ids, first_position, num_tokens, block_size, layout)
    if num_tokens % block_size == 0:
        raise ValueError(f"the last block is full ({num_tokens} tokens, block "
                         f"size {block_size}): no slots past the prompt to change")
    last = (num_tokens - 1) // block_size
    if last not in r.positions:
        raise ValueError(f"the last block (position {last}) is not loaded")
    bid, n = r.block_id(last), r.valid(last)
    explicit = False

    def attempt():
        name = _pick(layer, r.distinct, rng)
        old = r.get(name, bid, n, block_size)
        # Real KV values (copies of the block's own tokens), as a decode or a
        # misdirected write would leave there: random bytes would hold NaN /
        # Inf patterns no model writes, which some attention kernels do not
        # mask (0 * NaN), so the drill would test the kernel, not the checksum.
        valid = r.get(name, bid, 0, n)
        picks = [rng.randrange(n) for _ in range(old.shape[1])]
        new = valid[:, picks].contiguous()
        if torch.equal(old, new):
            return None
        r.put(name, bid, n, new)
        return Injection("change_tail", name, (last,), (bid,), False, token=n)

    return _retry(attempt, explicit, "change_tail")


FAULT_KINDS: dict[str, Callable[..., list[Injection]]] = {
    "flip_bit": flip_bit,
    "overwrite_piece": overwrite_piece,
    "swap_tokens": swap_tokens,
    "swap_heads": swap_heads,
    "swap_layers": swap_layers,
    "swap_blocks": swap_blocks,
    "misplace_block": misplace_block,
    "change_tail": change_tail,
}


def takes_position(kind: str) -> bool:
    """Whether the kind can be told which block position to hit (its `position` choice)."""
    return "position" in inspect.signature(FAULT_KINDS[kind]).parameters


def inject(kind: str, caches: Mapping[str, torch.Tensor], block_ids: Sequence[int],
           *, num_tokens: int, block_size: int, rng: random.Random,
           first_position: int = 0, **choices) -> list[Injection]:
    """Inject one fault of `kind` (a FAULT_KINDS key); choices are the
    kind's keyword arguments (misplace_block needs source_block_id)."""
    try:
        fn = FAULT_KINDS[kind]
    except KeyError:
        raise ValueError(f"unknown fault kind {kind!r}; known: "
                         f"{', '.join(FAULT_KINDS)}") from None
    return fn(caches, block_ids, num_tokens=num_tokens, block_size=block_size,
              rng=rng, first_position=first_position, **choices)
