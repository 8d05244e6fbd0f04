"""KVChecksumScheduler: the scheduler half of KV checksums.

Created by the vLLM Scheduler when kv_transfer_config.enable_kv_checksum is
set (see `create`). It decides each step which blocks the workers checksum,
sums the workers' parts, sends a producer's checksums with its finished
requests, and compares a consumer's loads before they run. A failed check
under kv_checksum_fail_closed is handed back to the Scheduler as a failed
KV load, so kv_load_failure_policy applies.

Producer: add_send (the step whose scheduled tokens cross the prompt),
collect (top of update_from_output), request_finished (the payload to
return in kv_transfer_params, or to hand to a connector-owned carrier).
Consumer: add_recv (an async load starts), collect, verify_finished_loads
(the aggregated finished_recving of the step).
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm_kvchecksum.blocks import GroupLayout, request_blocks
from vllm_kvchecksum.carrier import KV_TRANSFER_PARAMS_KEY, KVChecksumCarrier
from vllm_kvchecksum.compare import CheckStatus, LoadVerdict, compare_load, sum_producer
from vllm_kvchecksum.payload import KVChecksumPayload
from vllm_kvchecksum.records import KVChecksumBlocks, KVChecksumOutput, KVChecksumRecord, KVChecksumScheduled

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# A child of "vllm", so it logs through vLLM's handlers and format.
logger = logging.getLogger("vllm.kv_checksum")

# Finish statuses after which a producer's checksums are sent; an aborted
# request sends none.
_NORMAL_FINISHES = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")


def client_reason(verdict: LoadVerdict) -> str:
    """What a client is told when its request fails a KV checksum check."""
    if verdict.status is CheckStatus.MISMATCH:
        groups = ", ".join(f"group {g} blocks {list(b)}" for g, b in verdict.mismatched_blocks.items())
        return f"kv_checksum_mismatch: the KV loaded from the producer is corrupt ({groups})"
    return f"kv_checksum_unverified: {', '.join(k.value for k in verdict.reason_keys)}"


class KVChecksumConfigError(ValueError):
    """KV checksums were asked for in a setup that cannot honour them."""


def checksums_requested(vllm_config: VllmConfig) -> bool:
    kv = vllm_config.kv_transfer_config
    return kv is not None and kv.enable_kv_checksum


def unsupported_reason(vllm_config: VllmConfig) -> str | None:
    """Why this parallel setup cannot checksum its KV, or None.

    Shared by the scheduler and the workers, so both sides agree.
    """
    pc = vllm_config.parallel_config
    if pc.decode_context_parallel_size > 1 or pc.prefill_context_parallel_size > 1:
        return ("context parallelism (decode_context_parallel_size or prefill_context_parallel_size > 1) "
                "splits token positions across ranks")
    backend = pc.distributed_executor_backend
    if (pc.pipeline_parallel_size > 1 and backend == "ray"
            and os.environ.get("VLLM_USE_RAY_V2_EXECUTOR_BACKEND", "0") != "1"):
        return ("the Ray executor with pipeline_parallel_size > 1 drops the connector outputs of non-last "
                "stages; set VLLM_USE_RAY_V2_EXECUTOR_BACKEND=1")
    return None


def kv_checksum_enabled(vllm_config: VllmConfig) -> bool:
    """enable_kv_checksum is set and the setup supports it (warns once if not)."""
    if not checksums_requested(vllm_config):
        return False
    reason = unsupported_reason(vllm_config)
    if reason is not None:
        logger.warning("KV checksums are disabled: %s.", reason)
        return False
    return True


@dataclass
class _Pending:
    """A request being checksummed: its blocks and the records so far."""

    blocks: KVChecksumBlocks
    records: list[KVChecksumRecord] = field(default_factory=list)
    # Consumer only: the producer's checksums, or why there are none.
    expected: KVChecksumPayload | None = None
    missing_reason: str = ""


class KVChecksumScheduler:
    """What to checksum, the sums, and the verdicts, on one scheduler."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, connector,
                 null_block_id: int = 0):
        kv = vllm_config.kv_transfer_config
        pc = vllm_config.parallel_config
        self.fail_closed = bool(kv.kv_checksum_fail_closed)
        self.connector = connector
        self.tp_size = pc.tensor_parallel_size
        self.num_workers = pc.tensor_parallel_size * pc.pipeline_parallel_size
        self.null_block_id = null_block_id
        self.layouts = [
            GroupLayout(gid, kv_cache_config.kv_cache_groups[gid].kv_cache_spec.block_size,
                        getattr(kv_cache_config.kv_cache_groups[gid].kv_cache_spec, "sliding_window", None))
            for gid in kv_cache_config.transfer_group_ids
        ]
        self._step = KVChecksumScheduled()
        self._sends: dict[str, _Pending] = {}
        self._recvs: dict[str, _Pending] = {}
        self._warned: set[str] = set()
        # Verdicts so far ("verified", "mismatch", "unverified"), and
        # producer payloads "sent" / "not_sent": for logs, metrics, tests.
        self.stats: Counter[str] = Counter()

    @classmethod
    def create(cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, connector,
               null_block_id: int = 0) -> KVChecksumScheduler | None:
        """The checksum scheduler, or None when checksums are off or cannot run.

        Raises KVChecksumConfigError when kv_checksum_fail_closed is set but
        no load could ever be verified (the connector carries no checksums),
        since failing every load would be worse than a startup error.
        """
        if not kv_checksum_enabled(vllm_config):
            return None
        kv = vllm_config.kv_transfer_config
        if connector is None or not connector.can_carry_kv_checksums():
            name = kv.kv_connector or "no connector"
            if kv.kv_checksum_fail_closed:
                raise KVChecksumConfigError(
                    f"kv_transfer_config.enable_kv_checksum with kv_checksum_fail_closed=True, but {name} cannot "
                    "carry KV checksums, so every load would fail. Use a connector that carries them (e.g. "
                    "NixlConnector in pull mode) or set kv_checksum_fail_closed=False.")
            logger.warning("KV checksums are disabled: %s cannot carry them (kv_transfer_config."
                           "enable_kv_checksum is ignored).", name)
            return None
        self = cls(vllm_config, kv_cache_config, connector, null_block_id)
        logger.info("KV checksums enabled (%s): %d workers, groups %s.",
                    "fail-closed" if self.fail_closed else "fail-open", self.num_workers,
                    [layout.group_id for layout in self.layouts])
        return self

    # -- each step ---------------------------------------------------------

    def add_send(self, request: Request, block_ids, num_tokens: int) -> None:
        """A producer request's prompt KV is complete after this step."""
        if self.connector.kv_checksum_carrier(request, False) is None:
            return
        blocks = KVChecksumBlocks(num_tokens, request_blocks(block_ids, self.layouts, 0, num_tokens,
                                                             self.null_block_id))
        self._step.reqs_to_send[request.request_id] = blocks
        self._sends[request.request_id] = _Pending(blocks)

    def add_recv(self, request: Request, block_ids, num_local_tokens: int, num_tokens: int) -> None:
        """A consumer request's async load of tokens [num_local_tokens, num_tokens) starts."""
        if self.connector.kv_checksum_carrier(request, True) is None:
            return
        blocks = KVChecksumBlocks(num_tokens, request_blocks(block_ids, self.layouts, num_local_tokens,
                                                             num_tokens, self.null_block_id))
        pending = _Pending(blocks)
        text = (request.kv_transfer_params or {}).get(KV_TRANSFER_PARAMS_KEY)
        if text is None:
            pending.missing_reason = "the producer sent no KV checksums (is enable_kv_checksum set there?)"
        else:
            try:
                pending.expected = KVChecksumPayload.decode(text)
            except ValueError as exc:
                pending.missing_reason = f"the producer's KV checksums are invalid: {exc}"
        self._recvs[request.request_id] = pending

    def build_checksum_meta(self) -> KVChecksumScheduled | None:
        """This step's requests for the workers; resets the step's state.

        Pending loads are listed every step: each worker checksums a load in
        the step its own connector reports it finished, so workers keep no
        state across steps.
        """
        step, self._step = self._step, KVChecksumScheduled()
        step.reqs_to_recv = {rid: p.blocks for rid, p in self._recvs.items()}
        return None if step.is_empty() else step

    def collect(self, output: KVChecksumOutput | None) -> None:
        """Keep the step's worker records of pending requests."""
        if not output:
            return
        for record in output.finalize():
            for rid in record.requests:
                pending = self._sends.get(rid) or self._recvs.get(rid)
                if pending is not None:
                    pending.records.append(record)

    # -- producer ----------------------------------------------------------

    def request_finished(self, request: Request) -> dict[str, Any] | None:
        """The kv_transfer_params to add for a finished producer request."""
        pending = self._sends.pop(request.request_id, None)
        if pending is None or request.status.name not in _NORMAL_FINISHES:
            return None
        scheduled = {g: (b.start, len(b.block_ids)) for g, b in pending.blocks.groups.items()}
        result = sum_producer(pending.records, request.request_id, self.num_workers, scheduled,
                              pending.blocks.num_tokens, self.tp_size)
        if result.payload is None:
            self.stats["not_sent"] += 1
            logger.warning("KV checksums of request %s are not sent: %s", request.request_id, result.reason)
            return None
        self.stats["sent"] += 1
        carrier = self.connector.kv_checksum_carrier(request, False)
        if carrier is KVChecksumCarrier.KV_TRANSFER_PARAMS:
            return {KV_TRANSFER_PARAMS_KEY: result.payload.encode()}
        return None

    # -- consumer ----------------------------------------------------------

    def verify_finished_loads(self, finished_recving, already_failed=()) -> dict[str, str]:
        """Compare the loads the step reports finished (on every worker).

        Loads the connector already reported failed are not compared.
        Returns the loads to fail, each with a short reason for the client
        (the request's stop_reason when it ends with an error): under
        fail-closed every mismatch and unverified load, under fail-open none
        (they are only logged).
        """
        failed = {}
        for rid in finished_recving or ():
            pending = self._recvs.pop(rid, None)
            if pending is None or rid in already_failed:
                continue
            scheduled = {g: (b.start, len(b.block_ids), self._block_size(g))
                         for g, b in pending.blocks.groups.items()}
            verdict = compare_load(pending.expected, pending.records, rid, self.num_workers, scheduled,
                                   pending.blocks.num_tokens, missing_reason=pending.missing_reason)
            self.stats[verdict.status.value] += 1
            self._log(verdict)
            if verdict.status is not CheckStatus.VERIFIED and self.fail_closed:
                failed[rid] = client_reason(verdict)
        return failed

    def forget(self, req_id: str) -> None:
        """The request ended (or its load failed): drop what is kept for it."""
        self._sends.pop(req_id, None)
        self._recvs.pop(req_id, None)
        self._step.reqs_to_send.pop(req_id, None)

    def _block_size(self, group_id: int) -> int:
        return next(layout.block_size for layout in self.layouts if layout.group_id == group_id)

    def _log(self, verdict: LoadVerdict) -> None:
        action = "failing the load (kv_checksum_fail_closed)" if self.fail_closed else "using it anyway (fail-open)"
        if verdict.status is CheckStatus.MISMATCH:
            logger.error("%s; %s.", verdict.describe(), action)
        elif verdict.status is CheckStatus.UNVERIFIED:
            for key in verdict.reason_keys:
                if key.value not in self._warned:
                    self._warned.add(key.value)
                    logger.warning("KV loads are unverified (%s), %s; e.g. %s. Further loads unverified for this "
                                   "reason are logged at debug level.", key.value, action, verdict.describe())
            logger.debug("%s; %s.", verdict.describe(), action)
        elif self.stats["verified"] == 1:
            logger.info("%s; further verified loads are logged at debug level.", verdict.describe())
        else:
            logger.debug(verdict.describe())
