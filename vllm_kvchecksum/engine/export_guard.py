"""KV that failed its check stays its request's own: none of it leaves the instance with a checksum.

Under fail-open a request uses KV whose check failed (a mismatch). The rule,
set for patch 0022 (KVChecksumScheduler.take_cache_limits): that request's
`Request.max_cached_tokens` is the first token of the first bad block, and
its KV from there on (the bad block, every block after it, and every block
the request fills later, whose KV attended to the bad one) is tainted.
`export_limit` reads it. The GPU prefix cache never caches tainted blocks
(KVCacheCoordinator.cache_blocks); this module reads the same boundary where
KV leaves the instance:

- **Offloading tiers** (the bytes). `exportable_tokens(request, n)`: how many
  of a request's first n tokens a connector may store. The store connectors'
  schedulers cap their saves with it (MooncakeStoreScheduler, vLLM's
  OffloadingConnectorScheduler), so the tier never receives a tainted block:
  a later load of that prefix misses there and computes it.
- **Checksum entries of offloaded blocks** (any connector). `ExportGuard` keeps
  the scheduler's tainted requests, and each step tells the workers which
  block ids hold tainted KV (KVChecksumScheduled.tainted_blocks). The workers'
  `save_block_checksums` writes those blocks' entries XORed with
  TAINTED_ENTRY: whatever connector stores such a block anyway, every load of
  it is a mismatch (and is dropped from the tier), never verified.
- **P/D**. `clip_payload`: a producer's checksums of a tainted request cover
  only the blocks before its limit (KVChecksumScheduler.request_finished).
  The consumer's load of it is unverified (`not_covered_by_producer`;
  `no_common_blocks` when the first block is bad), never verified.

An unverified load under fail-open sets no limit (nothing says which block
is bad), as for the prefix cache.

**Before a verdict.** A synchronous load of offloaded KV is judged in the
update of the step that loaded it, but a store connector builds that step's
saves when the step is scheduled, and with the batch queue the next step's
too: they could store the loaded blocks, and the blocks the request computes
on them, before anyone knows whether they are bad. `hold_exports` (set by
KVChecksumScheduler.add_sync_load) keeps `exportable_tokens` below the load's
first token until the verdict (`release_exports`). A save held back is made
later by a connector that resumes from what it stored (vLLM's
OffloadingConnector, the Mooncake store's workers at the request's next
save); one the request finishes before is a later request's miss, never bad
KV in the tier. Imports no vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from vllm_kvchecksum.core.blocks import GroupLayout
from vllm_kvchecksum.core.compare import ProducerSum

# A child of "vllm", so it logs through vLLM's handlers and format.
logger = logging.getLogger("vllm.kv_checksum")

# XORed into the checksum entry of a tainted block (int64: fits the entries
# tensor): the entry then never matches the block's KV, so a load of it is a
# mismatch. "tainted!" in ASCII.
TAINTED_ENTRY = 0x7461696E74656421


def export_limit(request: Any) -> int | None:
    """The token from which `request`'s KV is tainted (never cached, never exported), or None.

    None also for anything but an int there (a request of a series without
    patch 0022, or a test's stand-in).
    """
    limit = getattr(request, "max_cached_tokens", None)
    return limit if isinstance(limit, int) and not isinstance(limit, bool) else None


# The attribute of a vLLM Request that holds its exports back while a
# synchronous load it runs on waits for its verdict: the first loaded token.
_HELD_FROM = "kv_checksum_exports_held_from"


def hold_exports(request: Any, from_token: int) -> None:
    """Until release_exports, none of `request`'s KV from `from_token` on leaves the instance."""
    held = getattr(request, _HELD_FROM, None)
    setattr(request, _HELD_FROM, from_token if held is None else min(held, from_token))


def release_exports(request: Any) -> None:
    """The verdicts `request`'s exports waited for are in (its own limit, if any, still holds)."""
    if getattr(request, _HELD_FROM, None) is not None:
        setattr(request, _HELD_FROM, None)


def exportable_tokens(request: Any, num_tokens: int) -> int:
    """How many of `request`'s first `num_tokens` tokens may leave the instance.

    For a store connector's scheduler: it stores no block holding a token at
    or past this (a partial block is never stored anyway). Below both the
    request's export limit and, while a verdict is pending, its held exports.
    """
    bounds = [num_tokens]
    limit = export_limit(request)
    if limit is not None:
        bounds.append(limit)
    held = getattr(request, _HELD_FROM, None)
    if isinstance(held, int) and not isinstance(held, bool):
        bounds.append(held)
    return max(0, min(bounds))


def clip_payload(result: ProducerSum, request: Any, layouts: Sequence[GroupLayout]) -> ProducerSum:
    """A producer's summed checksums of `request`, without the values of its tainted blocks.

    Each group keeps the blocks wholly before the limit (a Mamba state group,
    whose one state depends on every token, keeps none); num_tokens and the
    rest of the payload are unchanged, so a consumer that loads the request's
    blocks compares fewer than it loaded and the load is unverified.
    """
    limit = export_limit(request)
    payload = result.payload
    if payload is None or limit is None or limit >= payload.num_tokens:
        return result
    state_groups = {layout.group_id for layout in layouts if layout.is_state}
    groups = {}
    for group_id, group in payload.groups.items():
        end = 0 if group_id in state_groups else limit // group.block_size
        groups[group_id] = replace(group, values=group.values[:max(0, end - group.start)])
    logger.warning("KV checksums of request %s leave out its KV from token %d on, which failed its check "
                   "(fail-open): a consumer's load of it is unverified.", getattr(request, "request_id", "?"), limit)
    return ProducerSum(replace(payload, groups=groups))


class ExportGuard:
    """The scheduler's requests with tainted KV, and the block ids holding it, for the workers.

    `bind` (by the vLLM Scheduler) gives it the scheduler's requests and each
    request's block ids per KV cache group; unbound it tells the workers
    nothing. `taint` registers the requests take_cache_limits returns (their
    limits are read from the requests themselves, export_limit). A request
    is dropped once it has left the scheduler's requests, i.e. its blocks
    were freed (a preempted request stays, with the blocks it gets again).
    `step_blocks`, once per step: the block ids holding tainted KV now, when
    they changed since the last step.
    """

    def __init__(self, blocks_from: Callable[[int, Any], set[int]]):
        # KVChecksumScheduler.blocks_from: a request's block ids from a token on.
        self._blocks_from = blocks_from
        self._requests: Mapping[str, Any] | None = None
        self._block_ids_of: Callable[[str], Any] | None = None
        self._tainted: set[str] = set()
        self._told: frozenset[int] = frozenset()

    def bind(self, requests: Mapping[str, Any], block_ids_of: Callable[[str], Any]) -> None:
        self._requests = requests
        self._block_ids_of = block_ids_of

    def taint(self, req_ids) -> None:
        if self._requests is not None:  # unbound: nothing to tell the workers
            self._tainted.update(req_ids)

    def step_blocks(self) -> frozenset[int] | None:
        """The block ids whose KV is tainted now, or None when the workers already have them."""
        if not self._tainted and not self._told:
            return None
        blocks: set[int] = set()
        if self._requests is not None:
            for req_id in list(self._tainted):
                request = self._requests.get(req_id)
                limit = export_limit(request)
                if limit is None:  # gone (its blocks freed), or never limited
                    self._tainted.discard(req_id)
                    continue
                blocks |= self._blocks_from(limit, self._block_ids_of(req_id))
        now = frozenset(blocks)
        if now == self._told:
            return None
        self._told = now
        return now
