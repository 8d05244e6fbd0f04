"""Requests NIXL push would cross: two live requests that share an X-Request-Id.

vLLM's NIXL push pairs a consumer's registration (PUSH_REG) with a producer
request by the request id stripped of vLLM's random suffix
(nixl/utils.get_base_request_id, the function used here, so the rule is the
connector's own). Two live requests whose client-supplied X-Request-Id is
the same (a proxy passing a client's id through, a retry with an edited
prompt) are then paired with whichever registration comes first: each may
receive the other's KV. The binding of the checksums catches the KV when the
prompts differ; this module finds the clash itself, so the second request is
refused with an error naming the id, whatever the prompts.

A side only sees its own requests: the producer the sends it holds, the
consumer the loads it waits for.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("vllm.kv_checksum")

# Live ids a scheduler remembers per side (insertion order, oldest dropped
# first): bounded by its own state, not by what clients send.
MAX_LIVE_IDS = 65536


def pairs_by_base_id(connector: Any) -> bool:
    """Whether the connector (or a MultiConnector child) is vLLM's NIXL push connector."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPushConnector
    except Exception:  # a vLLM without push
        return False
    children = getattr(connector, "_connectors", None)
    if children:
        return any(pairs_by_base_id(child) for child in children)
    return isinstance(connector, NixlPushConnector)


def base_request_id(request_id: str) -> str:
    """The id NIXL push pairs requests by."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import get_base_request_id

    return get_base_request_id(request_id)


class LiveIds:
    """One side's live requests by the id NIXL push pairs them by."""

    def __init__(self) -> None:
        self._by_base: dict[str, str] = {}
        self._base_of: dict[str, str] = {}

    def add(self, request_id: str) -> str | None:
        """Register a live request; the other live request it clashes with, or None.

        A clashing request is not registered: the first keeps the id.
        """
        base = base_request_id(request_id)
        other = self._by_base.get(base)
        if other is not None and other != request_id:
            return other
        self._by_base[base] = request_id
        self._base_of[request_id] = base
        while len(self._base_of) > MAX_LIVE_IDS:
            self.remove(next(iter(self._base_of)))
        return None

    def remove(self, request_id: str) -> None:
        base = self._base_of.pop(request_id, None)
        if base is not None and self._by_base.get(base) == request_id:
            del self._by_base[base]

    def __len__(self) -> int:
        return len(self._base_of)


def clash_message(side: str, request_id: str, other: str) -> str:
    return (f"request {request_id!r} shares its X-Request-Id {base_request_id(request_id)!r} with live request "
            f"{other!r} on this {side}: NIXL push pairs transfers by that id, so the two could receive each "
            f"other's KV. Its KV checksums are refused; give each request a unique X-Request-Id (do not pass a "
            f"client's id through the proxy unchanged).")
