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

from vllm_kvchecksum.faults import byte_blocks

__all__ = ["DIGEST_CHARS", "block_digests", "state_block_digests", "differing_positions"]

# Hex characters kept per block: 64 bits, enough to tell blocks apart in a run.
DIGEST_CHARS = 16


def block_digests(caches: Mapping[str, torch.Tensor], block_ids: Sequence[int], first_position: int,
                  num_tokens: int, block_size: int) -> dict[int, str]:
    """Block position -> digest of that block's bytes, for the positions of
    `block_ids` (block_ids[0] at `first_position`) holding tokens below
    `num_tokens`. caches: one KV cache group's [blocks, heads, tokens, cell]
    tensors on this worker."""
    blocks = byte_blocks(caches, block_ids, first_position, num_tokens, block_size)
    digests = {}
    for position in blocks.positions:
        block_id, valid = blocks.block_id(position), blocks.valid(position)
        h = hashlib.sha256()
        for name in sorted(blocks.distinct):
            h.update(name.encode())
            h.update(blocks.get(name, block_id, 0, valid).contiguous().cpu().numpy().tobytes())
        digests[position] = h.hexdigest()[:DIGEST_CHARS]
    return digests


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


def differing_positions(sent: Mapping[int, str], loaded: Mapping[int, str]) -> list[int]:
    """The block positions a load holds whose digest differs from the
    producer's (positions the producer did not digest are not judged)."""
    sent = {int(p): d for p, d in sent.items()}
    return sorted(int(p) for p, d in loaded.items() if int(p) in sent and sent[int(p)] != d)
