"""Ground truth for drills and the soak: digests of the KV bytes a transfer moved.

A producer's drill connector digests the blocks of each request whose
prompt KV it is about to send (in the step that finishes the prompt, after
the forward, as the checksum worker does); a consumer's digests the blocks a
load wrote, when its connector reports the load finished. A load whose
digests differ from its producer's, at any block position both hold, received
KV that differs from what the producer computed: a victim. The soak
(scripts/kvcs_soak) compares that with the checksums' verdicts.

Independent of the checksum definition: sha256 of the raw bytes of each
block's token slots that hold the request's tokens, layer after layer (by
name), with no arithmetic on the values; for a Mamba state block, the bytes
of the states the connector transfers from each layer's page. Only the cache
addressing is shared with the drill's faults (faults.byte_blocks). Imports
no vLLM.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import torch

from vllm_kvchecksum.drills.faults import byte_blocks

__all__ = ["DIGEST_CHARS", "head_digests", "state_block_digests", "differing_positions", "key_position"]

# Hex characters kept per block: 64 bits, enough to tell blocks apart in a run.
DIGEST_CHARS = 16


def head_digests(caches: Mapping[str, torch.Tensor], first_heads: Mapping[str, int], block_ids: Sequence[int],
                 first_position: int, num_tokens: int, block_size: int) -> dict[str, str]:
    """"position:hHEAD" -> digest of one global KV head's bytes in a block, over
    the group's layers (by name): a rank holds some heads, so digests of the
    same head on two sides compare whatever their TP sizes. first_heads:
    each layer's first global KV head on this worker. caches: one KV cache
    group's [blocks, heads, tokens, cell] tensors on this worker; the
    positions of `block_ids` (block_ids[0] at `first_position`) holding
    tokens below `num_tokens`, each over its token slots only."""
    blocks = byte_blocks(caches, block_ids, first_position, num_tokens, block_size)
    hashers: dict[tuple[int, int], hashlib._Hash] = {}
    for position in blocks.positions:
        block_id, valid = blocks.block_id(position), blocks.valid(position)
        for name in sorted(blocks.distinct):
            data = blocks.get(name, block_id, 0, valid)
            for local in range(data.shape[0]):
                h = hashers.setdefault((position, first_heads[name] + local), hashlib.sha256())
                h.update(name.encode())
                h.update(data[local].contiguous().cpu().numpy().tobytes())
    return {f"{p}:h{head}": h.hexdigest()[:DIGEST_CHARS] for (p, head), h in sorted(hashers.items())}


def state_block_digests(pages: Mapping[str, tuple[torch.Tensor, int]], block_ids: Sequence[int],
                        first_position: int) -> dict[int, str]:
    """Block position -> digest of a Mamba state group's blocks: for each
    layer (by name), the first `covered` bytes of the block's page, the states
    the connector transfers (mamba_plan.covered_state_bytes).
    pages: name -> (page view [blocks, ...] of the layer, covered bytes)."""
    digests = {}
    for i, block_id in enumerate(block_ids):
        h = hashlib.sha256()
        for name in sorted(pages):
            page, covered = pages[name]
            h.update(name.encode())
            h.update(page[block_id].reshape(-1).view(torch.uint8)[:covered].cpu().numpy().tobytes())
        digests[first_position + i] = h.hexdigest()[:DIGEST_CHARS]
    return digests


def key_position(key) -> int:
    """The block position of a digest key ("position", or "position:part")."""
    return int(str(key).split(":", 1)[0])


def differing_positions(sent: Mapping[str, str], loaded: Mapping[str, str | Sequence[str]]) -> list[int]:
    """The block positions where a load's digest differs from the producer's,
    at keys both hold (keys the producer did not digest are not judged). A
    loaded value may list several workers' digests of one key (a replicated
    head): any that differs counts."""
    sent = {str(k): d for k, d in sent.items()}
    differ = set()
    for key, got in loaded.items():
        want = sent.get(str(key))
        if want is None:
            continue
        if any(d != want for d in ([got] if isinstance(got, str) else got)):
            differ.add(key_position(key))
    return sorted(differ)
