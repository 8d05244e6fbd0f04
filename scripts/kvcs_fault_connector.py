"""A NixlConnector that corrupts the KV it loaded, for real-engine checks.

Load it on a consumer engine with

    kv_transfer_config = {"kv_connector": "KVCSFaultConnector",
                          "kv_connector_module_path": "kvcs_fault_connector", ...}

with this directory on PYTHONPATH (the engine core process inherits it).

Faults are controlled by the environment variable KVCS_FAULT: the path of
a switch file. While that file exists, every load the worker reports
finished (and not failed) has one bit flipped in each registered KV cache
tensor (every layer, K and V together) in the blocks at the request's block
positions listed in the file (comma-separated, default "0,1"), in every KV
cache group the load wrote. With KVCS_FAULT unset, or the file absent, loads
pass through untouched: the class is then a plain NixlConnector. A file
rather than a bare flag, so one engine can run a clean phase and a faulty
one (the engine core runs in another process and keeps its environment).

The flip happens in get_transfer_results, after NIXL wrote the blocks and
before the model runner checksums the finished load, so the consumer's KV
differs from what the producer checksummed exactly as a corrupt transfer
would.

If KVCS_VERDICT_LOG names a file, every process holding an instance (the
engine core's scheduler side, each worker) appends the records of the
"vllm.kv_checksum" logger to it, at debug level (vLLM logs only the first
verified load at info), so a driver script can read the consumer's
verdicts; the fault lines ("vllm.kv_checksum.fault") go there too.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, KVConnectorTransferResults
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector

FAULT_ENV = "KVCS_FAULT"
VERDICT_LOG_ENV = "KVCS_VERDICT_LOG"
DEFAULT_POSITIONS = (0, 1)

logger = logging.getLogger("vllm.kv_checksum.fault")
_log_attached = False


def _attach_verdict_log() -> None:
    """Send the vllm.kv_checksum records, debug included, to KVCS_VERDICT_LOG."""
    global _log_attached
    path = os.environ.get(VERDICT_LOG_ENV)
    if not path or _log_attached:
        return
    handler = logging.FileHandler(path)
    handler.setLevel(logging.DEBUG)
    handler.setFormatter(logging.Formatter("%(process)d %(levelname)s %(name)s: %(message)s"))
    checksum_logger = logging.getLogger("vllm.kv_checksum")
    checksum_logger.addHandler(handler)
    # vLLM's own handler keeps its level (INFO), so only this file gets the debug lines.
    checksum_logger.setLevel(logging.DEBUG)
    _log_attached = True


def fault_positions() -> tuple[int, ...] | None:
    """The block positions to corrupt now, or None when faults are off."""
    path = os.environ.get(FAULT_ENV)
    if not path:
        return None
    try:
        with open(path) as f:
            text = f.read().strip()
    except FileNotFoundError:
        return None
    if not text:
        return DEFAULT_POSITIONS
    return tuple(int(p) for p in text.replace(" ", "").split(",") if p)


class KVCSFaultConnector(NixlConnector):
    """NixlConnector whose worker flips bits in finished loads while KVCS_FAULT is on."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        # Worker side: per request being loaded, (physical block ids per group,
        # blocks per group already held locally), from the connector metadata.
        self._fault_loads: dict[str, tuple[Any, tuple[int, ...]]] = {}
        self._fault_caches: list[torch.Tensor] = []
        # The scheduler (verdicts) and the workers (fault lines) may be different processes.
        _attach_verdict_log()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        super().register_kv_caches(kv_caches)
        seen: set[int] = set()
        caches = []
        for cache_or_caches in kv_caches.values():
            for t in cache_or_caches if isinstance(cache_or_caches, (list, tuple)) else (cache_or_caches,):
                # Layers may share one tensor: flipping it twice would undo the fault.
                if t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    caches.append(t)
        self._fault_caches = caches
        shapes = sorted({tuple(t.shape) for t in caches})
        logger.info("fault connector: %d KV cache tensors registered, shapes %s (block dimension first)",
                    len(caches), shapes)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        super().start_load_kv(forward_context, **kwargs)
        for req_id, meta in self._connector_metadata.reqs_to_recv.items():
            # local_physical_block_ids is filled in by the worker's start_load_kv.
            self._fault_loads[req_id] = (meta.local_physical_block_ids, tuple(meta.local_num_computed_blocks))

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = super().get_transfer_results(finished_req_ids)
        for req_id in results.finished_recving:
            load = self._fault_loads.pop(req_id, None)
            if load is None or req_id in results.failed_recving:
                continue
            positions = fault_positions()
            if positions:
                self._corrupt(req_id, load, positions)
        return results

    def _corrupt(self, req_id: str, load, positions: tuple[int, ...]) -> None:
        block_ids, computed = load
        ratio = self.connector_worker._physical_blocks_per_logical_kv_block if self.connector_worker else 1
        flipped = {}
        for gid, group in enumerate(block_ids):
            # The load holds the blocks after the local prefix hit: position p of
            # the request is index p - computed of this list (in logical blocks).
            offset = computed[gid] if gid < len(computed) else 0
            hit = []
            for pos in positions:
                idx = (pos - offset) * ratio
                if 0 <= idx < len(group):
                    block = group[idx]
                    for t in self._fault_caches:
                        flat = t[block].view(torch.uint8).view(-1)
                        flat[0] ^= 1
                    hit.append(pos)
            if hit:
                flipped[gid] = hit
        logger.warning("fault connector: flipped one bit in %d KV cache tensors at request %s positions %s",
                       len(self._fault_caches), req_id,
                       ", ".join(f"group {g} blocks {p}" for g, p in flipped.items()) or "none (not loaded)")
