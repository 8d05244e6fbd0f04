"""A vLLM request's content, as the binding of P/D checksums covers it (core/binding.py).

Both sides read their own Request the same way: the producer when it sums
the checksums it sends, the consumer when it checks the ones it received.
What is read is what vLLM's block hashes cover (kv_cache_utils.
generate_block_hash_extra_keys), less what may differ between two hosts
serving the same request:

- token ids: `all_token_ids` (the prompt comes first; prompt embeddings
  have placeholder ids there, and their rows count instead);
- LoRA: the adapter's name, not its path (each host mounts its own);
- cache salt;
- multimodal inputs: each feature's identifier (vLLM's content hash) and
  placeholder range;
- prompt embeddings: a digest of each token's row.
"""

from __future__ import annotations

import array
from typing import Any

import numpy as np

from vllm_kvchecksum.core.binding import MultimodalSpan, TokenContent
from vllm_kvchecksum.core.payload import PayloadBinding

# The runs the producer binds, when the payload has no group to take a block
# size from.
DEFAULT_BINDING_BLOCK_SIZE = 16


def request_content(request: Any) -> TokenContent:
    """The TokenContent of a vLLM Request (tokens computed so far included)."""
    lora = getattr(request, "lora_request", None)
    spans = []
    for feature in getattr(request, "mm_features", None) or ():
        position = getattr(feature, "mm_position", None)
        identifier = getattr(feature, "identifier", None)
        if position is None or identifier is None:
            continue
        spans.append(MultimodalSpan(int(position.offset), int(position.length), str(identifier)))
    embeds = getattr(request, "prompt_embeds", None)
    return TokenContent(
        token_ids=token_array(request),
        lora_name=None if lora is None else str(lora.lora_name),
        cache_salt=getattr(request, "cache_salt", None),
        mm_spans=tuple(spans),
        embedding_digests=None if embeds is None else embedding_digests(embeds))


def token_array(request: Any) -> np.ndarray:
    """The request's token ids as int64, read from vLLM's list in one pass.

    Converting a Python list is most of the binding's cost for a long
    prompt; array.array reads it faster than numpy does.
    """
    tokens = getattr(request, "_all_token_ids", None)
    if not isinstance(tokens, list):
        tokens = list(request.all_token_ids)
    return np.frombuffer(array.array("q", tokens), dtype=np.int64)


def embedding_digests(embeds: Any) -> np.ndarray:
    """One uint64 per row of a (tokens, hidden) embedding tensor, from its bytes.

    Each row's bytes are read as uint64 words (the row zero-padded to whole
    words) and summed with per-column odd weights, mod 2**64: any change of
    a byte changes the digest.
    """
    import torch

    rows = embeds.detach().to("cpu").contiguous()
    raw = rows.view(torch.uint8).reshape(rows.shape[0], -1).numpy()
    pad = (-raw.shape[1]) % 8
    if pad:
        raw = np.concatenate([raw, np.zeros((raw.shape[0], pad), dtype=np.uint8)], axis=1)
    words = np.ascontiguousarray(raw).view("<u8")
    weights = (2 * np.arange(words.shape[1], dtype=np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        return (words * weights).sum(axis=1, dtype=np.uint64)


def bind_payload(payload, request: Any, block_size: int | None = None):
    """`payload` bound to the request's tokens [0, payload.num_tokens), in runs of
    block_size (default: its groups' smallest block size)."""
    if block_size is None:
        sizes = [g.block_size for g in payload.groups.values()]
        block_size = min(sizes) if sizes else DEFAULT_BINDING_BLOCK_SIZE
    content = request_content(request)
    binding = PayloadBinding(block_size, content.block_bindings(block_size, payload.num_tokens))
    return type(payload)(num_tokens=payload.num_tokens, producer_tp_size=payload.producer_tp_size,
                         groups=payload.groups, tp_local_groups=payload.tp_local_groups, binding=binding)
