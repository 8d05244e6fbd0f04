"""Binding a producer's checksums to the request content they were computed for.

A block's KV checksum says the bytes arrived intact, not whose bytes they
are: the KV of another prompt of the same length, sent with that prompt's
checksums, compares equal. So the producer also sends, per run of tokens,
a *binding*: a sum over the tokens of a 64-bit hash of each token's
content, which the consumer recomputes from its own request. A load whose
bindings differ holds another request's KV, at the positions from the first
token that differs on.

What one token's hash covers is what vLLM's block hashes cover, minus
anything that differs between two hosts for the same request:

- its position in the request and its token id;
- the request's LoRA adapter (by name: the path may differ between hosts)
  and its cache salt, folded into a seed every token's hash starts from;
- for a token inside a multimodal placeholder, the input's identifier (the
  content hash vLLM computes) and the token's offset in the placeholder;
- for prompt embeddings, a digest of the token's embedding row.

The hash of token t is h_t = mix(seed + C1 * (t + 1) + C2 * id_t + e_t)
with e_t the multimodal or embedding part (0 for a plain token) and mix the
splitmix64 finalizer, all mod 2**64. The binding of tokens [a, b) is
sum_{a <= t < b} h_t mod 2**64. Sums add up over consecutive ranges, so
bindings do not depend on the KV cache block size, the TP/PP split or the
memory layout, and neither side needs prefix caching (no vLLM block hash is
read).

This is no cryptographic MAC: a client that edits its own kv_transfer_params
can still hurt only itself. It tells apart two requests' KV by chance
2**-64 per range, and says where they part.

Pure numpy, no vLLM (the engine layer reads a vLLM Request into a
TokenContent, request_binding.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

# The binding's own version, folded into every seed: a change to what is
# hashed must change every value, so old and new never compare equal.
BINDING_DOMAIN = b"vllm-kvchecksum binding v1"

_C1 = np.uint64(0x9E3779B97F4A7C15)
_C2 = np.uint64(0xD6E8FEB86659FD93)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64 values (wrapping), in place."""
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= _MIX1
        x ^= x >> np.uint64(27)
        x *= _MIX2
        x ^= x >> np.uint64(31)
    return x


_position_terms = np.zeros(0, dtype=np.uint64)


def _positions(n: int) -> np.ndarray:
    """C1 * (t + 1) for t < n, from a table kept for the longest request seen
    (so at most max_model_len entries)."""
    global _position_terms
    if _position_terms.shape[0] < n:
        with np.errstate(over="ignore"):
            _position_terms = _C1 * np.arange(1, max(n, 2 * _position_terms.shape[0]) + 1, dtype=np.uint64)
        _position_terms.flags.writeable = False
    return _position_terms[:n]


def digest64(*parts: bytes | str | None) -> int:
    """A 64-bit digest of a few labelled parts (None is its own value)."""
    h = hashlib.blake2b(digest_size=8, person=b"kvcs-binding")
    for part in parts:
        if part is None:
            h.update(b"\x00")
            continue
        data = part.encode("utf-8", "surrogatepass") if isinstance(part, str) else bytes(part)
        h.update(b"\x01" + len(data).to_bytes(8, "little") + data)
    return int.from_bytes(h.digest(), "little")


@dataclass(frozen=True)
class MultimodalSpan:
    """A multimodal input's placeholder tokens [offset, offset + length) and its identifier."""

    offset: int
    length: int
    identifier: str


@dataclass
class TokenContent:
    """What a request's tokens are, as far as their KV depends on it.

    token_ids: the request's tokens (prompt first), as vLLM holds them.
    lora_name / cache_salt: the request's LoRA adapter name and cache salt.
    mm_spans: its multimodal inputs' placeholders.
    embedding_digests: one uint64 per prompt token from its embedding row
      (prompt embeddings only), else None.
    """

    token_ids: Sequence[int] | np.ndarray
    lora_name: str | None = None
    cache_salt: str | None = None
    mm_spans: Sequence[MultimodalSpan] = ()
    embedding_digests: np.ndarray | None = None
    _prefix: np.ndarray | None = field(default=None, init=False, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def seed(self) -> int:
        return digest64(BINDING_DOMAIN, self.lora_name, self.cache_salt)

    def token_hashes(self) -> np.ndarray:
        """h_t for every token, uint64."""
        n = self.num_tokens
        ids = np.asarray(self.token_ids)
        # In place from one copy: this runs on a scheduler thread, once per
        # request and side, over every token (docs/performance.md).
        x = ids.astype(np.uint64) if ids.dtype != np.uint64 else ids.copy()
        with np.errstate(over="ignore"):
            x *= _C2
            x += _positions(n)
            x += np.uint64(self.seed())
            for span in self.mm_spans:
                lo, hi = max(0, span.offset), min(n, span.offset + span.length)
                if lo >= hi:
                    continue
                base = np.uint64(digest64(b"mm", span.identifier))
                x[lo:hi] += _mix(base + np.arange(lo - span.offset, hi - span.offset, dtype=np.uint64))
            if self.embedding_digests is not None:
                digests = np.asarray(self.embedding_digests, dtype=np.uint64)
                m = min(n, digests.shape[0])
                x[:m] += _mix(digests[:m].copy() ^ np.uint64(0x5851F42D4C957F2D))
        return _mix(x)

    def prefix_sums(self) -> np.ndarray:
        """P[i] = sum of h_t for t < i (mod 2**64), i in [0, num_tokens]; computed once."""
        if self._prefix is None:
            prefix = np.zeros(self.num_tokens + 1, dtype=np.uint64)
            np.cumsum(self.token_hashes(), dtype=np.uint64, out=prefix[1:])
            self._prefix = prefix
        return self._prefix

    def block_bindings(self, block_size: int, num_tokens: int) -> np.ndarray:
        """The bindings of tokens [0, num_tokens) in runs of block_size: one per run."""
        if not 1 <= block_size or not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"cannot bind {num_tokens} tokens in runs of {block_size}: the request "
                             f"holds {self.num_tokens}")
        prefix = self.prefix_sums()
        ends = np.minimum(np.arange(1, -(-num_tokens // block_size) + 1, dtype=np.int64) * block_size,
                          num_tokens)
        starts = np.arange(ends.shape[0], dtype=np.int64) * block_size
        with np.errstate(over="ignore"):
            return prefix[ends] - prefix[starts]


def first_difference(own: TokenContent, block_size: int, bindings: np.ndarray,
                     num_tokens: int, upto: int) -> int | None:
    """The first token of the first run of the producer's bindings that differs from ours, or None.

    bindings: the producer's, runs of block_size tokens over [0, num_tokens).
    Only runs that start before `upto` (the end of what this side loaded)
    are looked at, so the work follows this side's tokens whatever the
    payload says. A run that reaches past this side's own tokens differs
    (the producer bound tokens this request does not have).
    """
    runs = min(int(bindings.shape[0]), -(-min(upto, num_tokens) // block_size))
    if runs <= 0:
        return None
    starts = np.arange(runs, dtype=np.int64) * block_size
    ends = np.minimum(starts + block_size, num_tokens)
    present = ends <= own.num_tokens
    prefix = own.prefix_sums()
    ours = np.zeros(runs, dtype=np.uint64)
    with np.errstate(over="ignore"):
        ours[present] = prefix[ends[present]] - prefix[starts[present]]
    differs = ~present | (ours != bindings[:runs])
    where = np.flatnonzero(differs)
    return int(starts[where[0]]) if where.size else None
