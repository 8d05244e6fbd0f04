"""KVChecksumScheduler: the scheduler half of KV checksums.

Created by the vLLM Scheduler when kv_transfer_config.enable_kv_checksum is
set (see `create`). It decides each step which blocks the workers checksum,
sums the workers' parts, sends a producer's checksums with its finished
requests, and compares a consumer's loads before they run. A failed check
under kv_checksum_fail_closed is handed back to the Scheduler as a failed
KV load, so kv_load_failure_policy applies.

Producer: add_send (the step whose scheduled tokens cross the prompt),
collect (top of update_from_output), request_finished (the payload to
return in kv_transfer_params, or to hand to a connector-owned carrier),
recheck_before_free (the connector reports the transfer complete: the
blocks are checksummed once more before they are freed) and take_rechecked
(the re-checks judged, whose blocks the Scheduler frees now).
Consumer: add_recv (an async load starts), collect (also takes the
checksums a connector-owned carrier delivered to the workers),
verify_finished_loads (the aggregated finished_recving of the step).

Each step's SchedulerOutput carries only what changed (build_checksum_meta):
a load's blocks go to the workers once, in the step it starts, and each
worker keeps them until its own connector reports the load finished. When
the scheduler stops waiting for a load (the request ended, the load failed
or was compared), it tells the workers to forget it, so no worker keeps a
request's state after the scheduler has dropped it.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm_kvchecksum.core.blocks import GroupLayout, group_blocks, request_blocks
from vllm_kvchecksum.engine.carrier import KV_TRANSFER_PARAMS_KEY, KVChecksumCarrier
from vllm_kvchecksum.engine import incident, metrics
from vllm_kvchecksum.core.compare import ProducerSum, compare_load, sum_producer
from vllm_kvchecksum.core.verdicts import CheckStatus, LoadVerdict, UnverifiedReason, format_positions
from vllm_kvchecksum.engine.offload import OFFLOADED_SOURCE, compare_offloaded
from vllm_kvchecksum.engine.export_guard import ExportGuard, clip_payload, hold_exports, release_exports
from vllm_kvchecksum.core.payload import KVChecksumPayload, PayloadVersionError, max_encoded_size, max_packed_size
from vllm_kvchecksum.engine.request_binding import bind_payload, request_content
from vllm_kvchecksum.engine.push_ids import LiveIds, clash_message, pairs_by_base_id
from vllm_kvchecksum.engine.recheck import RecheckResult, RecheckStatus, recheck
from vllm_kvchecksum.core.records import (KVChecksumBlocks, KVChecksumOutput, KVChecksumRecord, KVChecksumScheduled,
                                          RecordPurpose)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# A child of "vllm", so it logs through vLLM's handlers and format.
logger = logging.getLogger("vllm.kv_checksum")

# Finish statuses after which a producer's checksums are sent; an aborted
# request sends none.
NORMAL_FINISHES = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")


# Every client_reason starts with it; vLLM's OpenAI server passes such a
# stop_reason on to the client as the error message (a retryable error).
KV_CHECKSUM_ERROR_PREFIX = "kv_checksum_"


# Block positions named per group in a client's error (and the server's
# error log line); a long prompt can differ in thousands.
CLIENT_MAX_POSITIONS = 32
# Producer requests read after their release that a scheduler remembers, so a
# request read from several workers (TP, PP) is counted once.
MAX_READS_AFTER_RELEASE_KEPT = 4096


def _client_positions(blocks) -> str:
    shown = list(blocks[:CLIENT_MAX_POSITIONS])
    more = len(blocks) - len(shown)
    return f"{shown}" + (f" and {more} more" if more else "")


# Why a load could not be compared, when a retry may compare it: a worker's
# report missing is transient. Every other reason of a P/D load is a fact of
# the setup or of the request (checksums off on the producer, other layers,
# block sizes, TP sizes, a payload that does not fit) that a retry meets
# again, so a proxy that retries 503s would loop.
_TRANSIENT_UNVERIFIED = frozenset({UnverifiedReason.MISSING_WORKERS})

# Ends the client reason of a failure a retry will not fix.
NOT_RETRYABLE_NOTE = " (not retryable: a retry meets the same setup; see the server's log)"


def client_reason(verdict: LoadVerdict) -> str:
    """What a client is told when its request fails a KV checksum check.

    A mismatch is retryable (the KV went bad on its way; the retry transfers
    or computes it again), and so is any failed load of offloaded KV (what
    failed was dropped from the store, so the retry recomputes it). An
    unverified P/D load is retryable only for a transient reason; the others
    end with NOT_RETRYABLE_NOTE (client_error_is_retryable).
    """
    if verdict.status is CheckStatus.MISMATCH:
        groups = ", ".join(f"group {g} blocks {_client_positions(b)}" for g, b in verdict.mismatched_blocks.items())
        source = ("loaded back from the offloaded KV cache" if verdict.source == OFFLOADED_SOURCE
                  else "loaded from the producer")
        return f"{KV_CHECKSUM_ERROR_PREFIX}mismatch: the KV {source} is corrupt ({groups})"
    reason = f"{KV_CHECKSUM_ERROR_PREFIX}unverified: {', '.join(k.value for k in verdict.reason_keys)}"
    if verdict.source != OFFLOADED_SOURCE and not set(verdict.reason_keys) <= _TRANSIENT_UNVERIFIED:
        reason += NOT_RETRYABLE_NOTE
    return reason


def client_error_is_retryable(stop_reason: str) -> bool:
    """For the OpenAI server: whether a request ended by this KV checksum
    failure (a client_reason) may succeed when retried (HTTP 503), or not
    (HTTP 500 with the reason)."""
    return stop_reason.startswith(KV_CHECKSUM_ERROR_PREFIX) and not stop_reason.endswith(NOT_RETRYABLE_NOTE)


def _carrier_name(connector) -> str:
    """How the connector carries a producer request's checksums, for the startup log.

    Asked with a stand-in for a P/D producer request (connectors decide from
    its kv_transfer_params: the P/D flag, and the transfer id Mooncake's
    router always sets); "decided per request" when the answer needs more.
    """

    class _Probe:
        request_id = "kv-checksum-startup-probe"
        kv_transfer_params = {"do_remote_decode": True, "transfer_id": "kv-checksum-startup-probe"}

    try:
        carrier = connector.kv_checksum_carrier(_Probe(), False)
    except Exception:
        return "decided per request"
    return "none for P/D producer requests" if carrier is None else carrier.value


class KVChecksumConfigError(ValueError):
    """KV checksums were asked for in a setup that cannot honour them."""


def checksums_requested(vllm_config: VllmConfig) -> bool:
    kv = vllm_config.kv_transfer_config
    return kv is not None and kv.enable_kv_checksum


def _ray_v2_executor() -> bool:
    """Whether vLLM picks its Ray V2 executor, read the way vLLM reads it.

    vLLM 0.34 has no other Ray executor, and no switch between them.
    """
    from vllm import envs

    if "VLLM_USE_RAY_V2_EXECUTOR_BACKEND" not in envs.environment_variables:
        return True
    return bool(envs.VLLM_USE_RAY_V2_EXECUTOR_BACKEND)


def unsupported_reason(vllm_config: VllmConfig) -> str | None:
    """Why this parallel setup cannot checksum its KV, or None.

    Shared by the scheduler and the workers, so both sides agree.
    """
    pc = vllm_config.parallel_config
    if pc.decode_context_parallel_size > 1 or pc.prefill_context_parallel_size > 1:
        return ("context parallelism (decode_context_parallel_size or prefill_context_parallel_size > 1) "
                "splits token positions across ranks")
    if pc.pipeline_parallel_size > 1 and pc.distributed_executor_backend == "ray" and not _ray_v2_executor():
        return ("the legacy Ray executor with pipeline_parallel_size > 1 drops the connector outputs of non-last "
                "stages; use the Ray V2 executor (VLLM_USE_RAY_V2_EXECUTOR_BACKEND=1, vLLM's default)")
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


def transfer_layouts(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> list[GroupLayout]:
    """The block rule's layout of each transfer group.

    The window clip comes from the function NIXL and Mooncake choose their
    transferred blocks with, so the comparison covers exactly what they send.
    """
    from vllm.distributed.kv_transfer.kv_connector.utils import sliding_window_transfer_blocks

    windows = sliding_window_transfer_blocks(vllm_config, kv_cache_config)
    return [GroupLayout(gid, group.kv_cache_spec.block_size, window, _state_block_rule(group.kv_cache_spec))
            for gid, group, window in zip(kv_cache_config.transfer_group_ids, kv_cache_config.transfer_groups,
                                          windows, strict=True)]


def _state_block_rule(spec):
    """For a Mamba state group, the rule NIXL picks the transferred state block with; else None.

    clip_ssm_state_blocks keeps the running-state slot: it drops the group's
    speculative scratch slots (the spec's num_speculative_blocks, as NIXL's
    scheduler reads it) and everything before the running state.
    """
    from vllm.distributed.kv_transfer.kv_connector.utils import clip_ssm_state_blocks
    from vllm.v1.kv_cache_interface import MambaSpec

    if not isinstance(spec, MambaSpec):
        return None
    return functools.partial(clip_ssm_state_blocks, num_spec_blocks=spec.num_speculative_blocks)


@dataclass
class _Pending:
    """A request being checksummed: its blocks and the records so far."""

    blocks: KVChecksumBlocks
    records: list[KVChecksumRecord] = field(default_factory=list)
    # Consumer only: the producer's checksums, or why there are none.
    expected: KVChecksumPayload | None = None
    missing_reason: str = ""
    missing_key: UnverifiedReason = UnverifiedReason.NO_PRODUCER_CHECKSUMS
    # Consumer, connector-owned carrier: no copy of the checksums received yet.
    awaiting_connector: bool = False
    # Consumer: the request's token count, which bounds the size of the
    # producer's checksums decoded for it (payload.max_packed_size).
    request_tokens: int = 0
    # Consumer, P/D: the producer's TP size as the connector transfers from
    # it (None: the connector does not say), checked against the payload's.
    producer_tp_size: Any = None
    # Consumer: the request. A P/D load's payload binding must match its own
    # content (request_binding.py, read when the load is judged); a load of
    # offloaded KV (blocks.offloaded) has the hashes of its loaded blocks per
    # group below, which the tags are derived from.
    request: Any = None
    block_hashes: dict[int, list] = field(default_factory=dict)
    # A synchronous load: its request's blocks from the first loaded one on
    # (per group), which no other request may hit until the verdict; and
    # whether its request ended before that (judged, never failed).
    held: dict[int, tuple[int, ...]] = field(default_factory=dict)
    ended: bool = False
    # Consumer, P/D: the producer's request and engine as the load names
    # them (bounded strings from kv_transfer_params), and the carrier, for
    # the incident line of a mismatch.
    remote: tuple[str | None, str | None] = (None, None)
    carrier: str | None = None
    # Producer, NIXL push: the live request whose X-Request-Id this one
    # shares (push_ids.py); its checksums are not sent.
    clashes_with: str | None = None


class KVChecksumScheduler:
    """What to checksum, the sums, and the verdicts, on one scheduler."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, connector,
                 null_block_id: int = 0, hash_block_size: int | None = None):
        kv = vllm_config.kv_transfer_config
        pc = vllm_config.parallel_config
        self.fail_closed = bool(kv.kv_checksum_fail_closed)
        self.engine_id = kv.engine_id
        self.connector = connector
        # As the operator configured it (kv_transfer_config.kv_connector).
        self.connector_name = kv.kv_connector or type(connector).__name__
        self.tp_size = pc.tensor_parallel_size
        self.num_workers = pc.tensor_parallel_size * pc.pipeline_parallel_size
        self.null_block_id = null_block_id
        self.layouts = transfer_layouts(vllm_config, kv_cache_config)
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        # Loads of offloaded KV are checked per block against entries tagged
        # with the request's block hashes: only groups whose blocks each have
        # one hash (and not Mamba state, which is not stored per block).
        self.offload_layouts = [layout for layout in self.layouts
                                if not layout.is_state and layout.block_size == hash_block_size]
        self._step = KVChecksumScheduled()
        # NIXL push pairs requests by their id without vLLM's suffix: live
        # sends and loads by that id, to refuse a second one (push_ids.py).
        self.pairs_by_base_id = pairs_by_base_id(connector)
        self._live_sends = LiveIds()
        self._live_loads = LiveIds()
        self._sends: dict[str, _Pending] = {}
        # Producer requests whose checksums were sent, until their transfer
        # completes (expected: the payload sent); then, until the re-check's
        # step has run, the ones being re-checked.
        self._sent: dict[str, _Pending] = {}
        self._rechecking: dict[str, _Pending] = {}
        # getattr: the series' prefixes before the re-check's patch lack the key.
        self.recheck_sends = bool(getattr(kv, "kv_checksum_producer_recheck", False))
        # Producer requests read after the connector released their blocks,
        # already counted (insertion order; at most MAX_READS_AFTER_RELEASE_KEPT).
        self._read_after_release: dict[str, None] = {}
        self._recvs: dict[str, _Pending] = {}
        # Synchronous loads of offloaded KV by the step that performs them
        # (KVChecksumScheduled.step): with a batch queue several steps are in
        # flight, and each load is judged with its own step's records.
        self._sync: dict[int, dict[str, _Pending]] = {}
        # The synchronous-load records of the output being processed
        # (collect), for verify_sync_loads.
        self._sync_records: list[KVChecksumRecord] = []
        # Block ids of synchronous loads not judged yet (how many loads hold
        # each): a local prefix-cache hit stops before them (usable_local_hit).
        self._held: Counter[int] = Counter()
        self._warned: set[str] = set()
        # Verdicts so far ("verified", "mismatch", "unverified"), and
        # producer payloads "sent" / "not_sent": for logs and tests.
        self.stats: Counter[str] = Counter()
        # The counts not yet taken for vLLM's stats (metrics.py keys).
        self._metrics: Counter[str] = Counter()
        # Of the output being processed (reset by collect): per load failed
        # under fail-closed, the tokens a recompute keeps (None: none, the
        # whole prompt) and the load's end (recompute_from); per load used
        # under fail-open although it mismatched, the token from which its
        # request's blocks must stay out of the prefix cache
        # (take_cache_limits).
        self._failed_prefix: dict[str, tuple[int | None, int]] = {}
        self._cache_limits: dict[str, int] = {}
        # Where KV leaves the instance, those requests' KV from their limit on does not (export_guard.py).
        self.export_guard = ExportGuard(self.blocks_from)
        # The gauges as last reported (take_metrics); all 0 at the start.
        self._gauges_reported: dict[str, int] = dict.fromkeys(metrics.GAUGES, 0)

    @classmethod
    def create(cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, connector,
               null_block_id: int = 0, hash_block_size: int | None = None) -> KVChecksumScheduler | None:
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
        self = cls(vllm_config, kv_cache_config, connector, null_block_id, hash_block_size)
        if self.fail_closed:
            mode = f"fail-closed: a load that fails its check is a KV load failure (kv_load_failure_policy=" \
                   f"{kv.kv_load_failure_policy!r})"
        else:
            mode = "fail-open: a load that fails its check is logged and counted, and used"
        logger.info("KV checksums enabled (%s); %s, carrier %s; %d workers; transfer groups %s (the workers log "
                    "which of them they checksum, and why any is skipped).", mode, type(connector).__name__,
                    _carrier_name(connector), self.num_workers,
                    [layout.group_id for layout in self.layouts])
        return self

    def take_metrics(self) -> dict[str, int] | None:
        """The counts since the last call (metrics.py keys), for vLLM's SchedulerStats; None if none.

        With them, each gauge (metrics.GAUGES) whose value changed since the
        last call: the state held now.
        """
        gauges = self.gauges()
        changed = {k: v for k, v in gauges.items() if self._gauges_reported.get(k) != v}
        if not self._metrics and not changed:
            return None
        counts, self._metrics = dict(self._metrics), Counter()
        counts.update(changed)
        self._gauges_reported = gauges
        return counts

    def gauges(self) -> dict[str, int]:
        """What this scheduler holds now: loads and sends in flight, held blocks."""
        return {metrics.LOADS_IN_FLIGHT: len(self._recvs) + sum(len(loads) for loads in self._sync.values()),
                metrics.SENDS_IN_FLIGHT: len(self._sends) + len(self._sent) + len(self._rechecking),
                metrics.HELD_BLOCKS: len(self._held)}

    # -- each step ---------------------------------------------------------

    def add_send(self, request: Request, block_ids, num_tokens: int) -> None:
        """A producer request's prompt KV is complete after this step.

        num_tokens: the tokens computed after this step. Only the prompt's are
        checksummed, as its consumer loads them: the step that completes the
        prompt can compute further (a preempted request recomputes its prompt
        and outputs in one step), and a last block checksummed over more
        tokens than the consumer loads could not be compared.
        """
        if self.connector.kv_checksum_carrier(request, False) is None:
            return
        num_tokens = min(num_tokens, request.num_prompt_tokens)
        blocks = KVChecksumBlocks(num_tokens, request_blocks(block_ids, self.layouts, 0, num_tokens,
                                                             self.null_block_id))
        self._step.reqs_to_send[request.request_id] = blocks
        pending = self._sends[request.request_id] = _Pending(blocks)
        if self.pairs_by_base_id:
            pending.clashes_with = self._live_sends.add(request.request_id)

    def add_recv(self, request: Request, block_ids, num_local_tokens: int, num_tokens: int) -> None:
        """A consumer request's async load of tokens [num_local_tokens, num_tokens) starts.

        A P/D load is checked against its producer's checksums; any other
        load from a tier whose loads bring stored checksums back
        (get_kv_checksum_sources) against those (add_offloaded_load).
        """
        carrier = self.connector.kv_checksum_carrier(request, True)
        if carrier is None:
            self.add_offloaded_load(request, block_ids, num_local_tokens, num_tokens)
            return
        blocks = KVChecksumBlocks(num_tokens, request_blocks(block_ids, self.layouts, num_local_tokens,
                                                             num_tokens, self.null_block_id))
        pending = _Pending(blocks, request_tokens=request.num_tokens,
                           producer_tp_size=self._producer_tp_size(request),
                           remote=incident.remote_ids(request.kv_transfer_params),
                           carrier=getattr(carrier, "value", str(carrier)), request=request)
        other = (self._live_loads.add(request.request_id)
                 if self.pairs_by_base_id and carrier is KVChecksumCarrier.CONNECTOR else None)
        if other is not None:
            # Its registration may be paired with the other load's producer
            # request: nothing received for it can be trusted.
            pending.missing_key = UnverifiedReason.DUPLICATE_REQUEST_ID
            pending.missing_reason = clash_message("consumer", request.request_id, other)
            logger.error("KV checksums: %s", pending.missing_reason)
        elif carrier is KVChecksumCarrier.CONNECTOR:
            # The connector delivers them to the workers with the load (collect).
            pending.awaiting_connector = True
            pending.missing_reason = ("the connector delivered no KV checksums with the load (is "
                                      "enable_kv_checksum set on the producer, and is it the same version?)")
        else:
            text = (request.kv_transfer_params or {}).get(KV_TRANSFER_PARAMS_KEY)
            if text is None:
                pending.missing_reason = "the producer sent no KV checksums (is enable_kv_checksum set there?)"
            else:
                self._decode_expected(pending, request.request_id, text, "kv_transfer_params")
        self._recvs[request.request_id] = pending
        # Sent once, in this step: each worker keeps the blocks until its own
        # connector reports the load finished or the scheduler forgets it.
        self._step.reqs_to_recv[request.request_id] = blocks

    def _producer_tp_size(self, request: Request) -> Any:
        """The connector's answer to get_kv_checksum_producer_tp_size, or None.

        A connector of a series without the hook, or one that raised, says
        nothing (the payload's TP size is used, as before the hook).
        """
        ask = getattr(self.connector, "get_kv_checksum_producer_tp_size", None)
        if ask is None:
            return None
        try:
            return ask(request)
        except Exception:
            logger.exception("KV checksums: %s.get_kv_checksum_producer_tp_size raised for request %s; the "
                             "payload's producer TP size is not cross-checked.", type(self.connector).__name__,
                             request.request_id)
            return None

    def _offload_tiers(self, request: Request, num_tokens: int) -> tuple[set, set]:
        """(the tiers this load comes from, the tiers whose loads bring checksums back)."""
        sources = set(self.connector.get_kv_checksum_sources(request) or ())
        if not sources:
            return set(), sources
        return set(self.connector.get_external_cache_hit_sources(request, num_tokens) or ()), sources

    def add_offloaded_load(self, request: Request, block_ids, num_local_tokens: int, num_tokens: int) -> None:
        """An async load of offloaded KV (not P/D) of tokens [num_local_tokens, num_tokens) starts.

        Checked when its connector serves it from tiers that bring the
        checksums stored with the KV back (get_kv_checksum_sources): every
        full block loaded, in the groups whose blocks have one hash each.
        """
        pending = self._offloaded_pending(request, block_ids, num_local_tokens, num_tokens)
        if pending is None:
            return
        self._recvs[request.request_id] = pending
        self._step.reqs_to_recv[request.request_id] = pending.blocks

    def add_sync_load(self, request: Request, block_ids, num_local_tokens: int, num_tokens: int) -> None:
        """A synchronous load of tokens [num_local_tokens, num_tokens) is scheduled in this step.

        The connector loads them during the step, before the forward uses
        them; the workers checksum them after the forward, and
        verify_sync_loads compares them in the same step's update. Only with
        one KV cache group: vLLM rolls a bad synchronous load back by its
        invalid blocks, which it supports for one group only.
        """
        if self.num_kv_cache_groups != 1:
            pending = self._offloaded_pending(request, block_ids, num_local_tokens, num_tokens, count=False)
            if pending is not None:
                self._metrics[metrics.labelled(metrics.OFFLOADED_NOT_CHECKED, "sync_load")] += 1
                if "sync_load" not in self._warned:
                    self._warned.add("sync_load")
                    logger.warning("KV checksums: synchronous loads of offloaded KV (e.g. request %s) are not "
                                   "checked with %d KV cache groups: vLLM rolls a bad synchronous load back by "
                                   "invalid blocks, which it supports for one group only. Use the connector's "
                                   "asynchronous loads to have them checked. Logged once.", request.request_id,
                                   self.num_kv_cache_groups)
            return
        pending = self._offloaded_pending(request, block_ids, num_local_tokens, num_tokens)
        if pending is not None:
            # vLLM caches these blocks now, and with a batch queue schedules
            # the next step before this one's verdict: hold every block from
            # the first loaded one on (those computed after it in this step
            # attend to it) until then.
            pending.held = {g: tuple(block_ids[g][b.start:]) for g, b in pending.blocks.groups.items()}
            self._held.update(i for ids in pending.held.values() for i in ids)
            # Nor may a connector store them, or send them on, before then
            # (export_guard.py: it builds this step's saves after this).
            hold_exports(request, num_local_tokens)
            self._sync.setdefault(self._step.step, {})[request.request_id] = pending
            self._step.reqs_loaded[request.request_id] = pending.blocks

    def usable_local_hit(self, hit_blocks) -> int | None:
        """How many blocks of a local prefix-cache hit a request may use, or None for all.

        hit_blocks: the hit's blocks per KV cache group (KVCacheBlocks.blocks).
        The hit stops before the first block a synchronous load holds whose
        check has not passed (add_sync_load): no request runs on KV before
        its verdict. Holds exist with one KV cache group only.
        """
        if not self._held:
            return None
        keep = min((next((i for i, block in enumerate(blocks) if block.block_id in self._held), len(blocks))
                    for blocks in hit_blocks), default=0)
        return keep if any(keep < len(blocks) for blocks in hit_blocks) else None

    def _release(self, pending: _Pending) -> None:
        self._held.subtract(i for ids in pending.held.values() for i in ids)
        self._held = +self._held  # drop the zero counts

    def verify_sync_loads(self, scheduled: KVChecksumScheduled | None
                          ) -> tuple[set[int], dict[str, str], set[int]]:
        """Compare the synchronous loads of the step whose output this is.

        scheduled: that step's checksum requests (its SchedulerOutput's
        kv_checksum_scheduled); its loads are judged with the records that
        came with the output (collect). With a batch queue (async scheduling,
        PP) the next step may already be scheduled: its loads wait for their
        own. Every load judged stops holding its blocks.
        Returns:
        - the block ids to report invalid (vLLM then drops the step's outputs
          of the requests using them and recomputes or fails them, by
          kv_load_failure_policy); empty under fail-open;
        - per failed request, the reason for the client;
        - the block ids to evict from the prefix cache, under any policy: of
          each load that failed (the rule of on_kv_checksum_failure), its
          request's blocks from the first bad one on, so no other request
          hits them (the request itself keeps them until it drops them).
        """
        invalid: set[int] = set()
        reasons: dict[str, str] = {}
        unusable: set[int] = set()
        loads = self._sync.pop(scheduled.step, {}) if scheduled is not None else {}
        records, self._sync_records = self._sync_records, []
        for record in records:
            for rid in record.requests:
                if rid in loads:
                    loads[rid].records.append(record)
        for rid, pending in loads.items():
            self._release(pending)
            verdict = self._judge(rid, pending)
            failed = (None if verdict is None or verdict.status is CheckStatus.VERIFIED
                      else self._failed_positions(pending, verdict))
            if failed is None:
                # Its KV may leave the instance now, unless another of its
                # loads still waits. A load that failed keeps it in for the
                # request's life (a fail-open limit may be later than the
                # load's start, a failed request may still be stored).
                if not any(rid in waiting for waiting in self._sync.values()):
                    release_exports(pending.request)
                continue
            for gid, positions in failed.items():
                start = pending.blocks.groups[gid].start
                unusable.update(pending.held[gid][min(positions, default=start) - start:])
            if not self.fail_closed or pending.ended:
                continue
            reasons[rid] = client_reason(verdict)
            for gid, positions in failed.items():
                blocks = pending.blocks.groups[gid]
                invalid.update(blocks.block_ids[p - blocks.start] for p in positions)
        return invalid, reasons, unusable

    def _offloaded_pending(self, request: Request, block_ids, num_local_tokens: int, num_tokens: int,
                           count: bool = True) -> _Pending | None:
        """What to check of a load of offloaded KV, or None when it is not checked."""
        if not self.offload_layouts:
            return None
        try:
            tiers, sources = self._offload_tiers(request, num_tokens - num_local_tokens)
        except Exception:
            logger.exception("KV checksums: asking the connector where request %s's load comes from raised; the "
                             "load is not checked.", request.request_id)
            return None
        if not sources:
            return None
        if not tiers or not tiers <= sources:
            if count:
                self._metrics[metrics.labelled(metrics.OFFLOADED_NOT_CHECKED, "tier_not_covered")] += 1
            logger.debug("KV checksums: the load of request %s comes from %s; checksums come back only from %s, so "
                         "it is not checked.", request.request_id, sorted(t.value for t in tiers),
                         sorted(t.value for t in sources))
            return None
        groups, hashes = {}, {}
        hash_lists: dict[tuple[int, int], list] = {}  # one list per block range, shared by its groups
        for layout in self.offload_layouts:
            full_end = num_tokens // layout.block_size * layout.block_size
            blocks = group_blocks(block_ids[layout.group_id], layout, num_local_tokens, full_end,
                                  self.null_block_id)
            if blocks is None or not blocks.block_ids:
                continue
            groups[layout.group_id] = blocks
            span = (blocks.start, blocks.start + len(blocks.block_ids))
            if span not in hash_lists:
                hash_lists[span] = list(request.block_hashes[span[0]:span[1]])
            hashes[layout.group_id] = hash_lists[span]
        if not groups:
            return None
        return _Pending(KVChecksumBlocks(num_tokens, groups, offloaded=True), request=request, block_hashes=hashes)

    def _decode_expected(self, pending: _Pending, req_id: str, data, source: str) -> None:
        """Decode the producer's checksums of a load into `pending` (or say why not).

        `data` is untrusted (a client's kv_transfer_params, or bytes another
        host sent through the connector): it is decoded only up to the size
        the request's own tokens and this model's groups allow (anything
        longer makes the load unverified), so a short prompt costs the
        engine loop little whatever it carries; nothing the decoder raises
        escapes into the engine loop.
        """
        groups = len(self.layouts)
        try:
            pending.expected = (
                KVChecksumPayload.from_bytes(data, max_packed_size(pending.request_tokens, groups))
                if isinstance(data, (bytes, bytearray))
                else KVChecksumPayload.decode(data, max_encoded_size(pending.request_tokens, groups)))
        except PayloadVersionError as exc:
            pending.missing_key = UnverifiedReason.PAYLOAD_VERSION
            pending.missing_reason = f"the producer's KV checksums ({source}) are of another version: {exc}"
        except ValueError as exc:
            pending.missing_reason = f"the producer's KV checksums ({source}) are invalid: {exc}"
        except Exception as exc:
            # The decoder raises only ValueError by design; anything else is
            # a bug, and must not escape the scheduler and stop the engine.
            logger.exception("Decoding the KV checksums of request %s (%s) raised %s; the load will be "
                             "unverified. Please report this with the request's %s.",
                             req_id, source, type(exc).__name__, source)
            pending.missing_reason = (f"the producer's KV checksums ({source}) could not be decoded "
                                      f"({type(exc).__name__}: {exc})")

    def build_checksum_meta(self) -> KVChecksumScheduled | None:
        """This step's news for the workers, or None; resets the step's state.

        Only what changed since the last step: loads that started (workers
        keep them), loads to forget, and sends. A steady step with loads in
        flight sends nothing.
        """
        step, self._step = self._step, KVChecksumScheduled(step=self._step.step + 1)
        step.tainted_blocks = self.export_guard.step_blocks()
        return None if step.is_empty() else step

    def collect(self, output: KVChecksumOutput | None) -> None:
        """Keep the step's worker records of pending requests.

        Called first in each update (update_from_output): what the previous
        update's verdicts left for the Scheduler to take is dropped here, so
        it never outlives the update that made it.
        """
        self._failed_prefix = {}
        self._cache_limits = {}
        if not output:
            return
        for record in output.finalize():
            # By purpose: one request can be sent, loaded and sync-loaded in
            # one step, each with its own blocks and workers.
            if record.purpose == RecordPurpose.SYNC_LOAD:
                self._sync_records.append(record)
                continue
            table = {RecordPurpose.SEND: self._sends, RecordPurpose.RECHECK: self._rechecking}.get(
                record.purpose, self._recvs)
            for rid in record.requests:
                pending = table.get(rid)
                if pending is not None:
                    pending.records.append(record)
            for rid, data in record.received.items():
                # Connector-owned carriers: the first worker passes on its
                # connector's copy (KVChecksumWorker.forwards_received); a
                # repeated copy changes nothing.
                pending = self._recvs.get(rid)
                if pending is not None and pending.awaiting_connector:
                    pending.awaiting_connector = False
                    self._decode_expected(pending, rid, bytes(data), "connector message")
            for rid in record.read_after_release:
                self._count_read_after_release(rid)

    # -- producer ----------------------------------------------------------

    def request_finished(self, request: Request,
                         kv_transfer_params: dict[str, Any] | None) -> dict[str, Any] | None:
        """The kv_transfer_params to return for a finished producer request.

        `kv_transfer_params` are the connector's for the request; returned as
        they are, or with the checksums added when the connector carries
        them there. Only a normal finish (stop, length) sends checksums, and
        stats["sent"] counts the payloads actually handed to the carrier: a
        connector that returns no params has nothing to transfer for the
        request (counted as "not_carried").
        """
        pending = self._sends.pop(request.request_id, None)
        if pending is None or request.status.name not in NORMAL_FINISHES:
            return kv_transfer_params
        carrier = self.connector.kv_checksum_carrier(request, False)
        in_params = carrier is KVChecksumCarrier.KV_TRANSFER_PARAMS and kv_transfer_params is not None
        if not in_params and carrier is not KVChecksumCarrier.CONNECTOR:
            self._not_carried(request.request_id, carrier, kv_transfer_params)
            return kv_transfer_params
        if pending.clashes_with is not None:
            self.stats["not_sent"] += 1
            self._metrics[metrics.labelled(metrics.NOT_SENT, "duplicate_request_id")] += 1
            logger.error("KV checksums: %s", clash_message("producer", request.request_id, pending.clashes_with))
            return kv_transfer_params
        result = clip_payload(self._sum_own(request.request_id, pending), request, self.layouts)
        if result.payload is not None:
            try:
                result = ProducerSum(bind_payload(result.payload, request))
            except Exception as exc:
                logger.exception("KV checksums: binding the checksums of request %s to its tokens raised.",
                                 request.request_id)
                result = ProducerSum(None, f"binding them to the request's tokens raised {type(exc).__name__}")
        if result.payload is None:
            self.stats["not_sent"] += 1
            self._metrics[metrics.labelled(metrics.NOT_SENT, "sum_failed")] += 1
            logger.warning("KV checksums of request %s are not sent: %s", request.request_id, result.reason)
            return kv_transfer_params
        if in_params:
            kv_transfer_params = {**kv_transfer_params, KV_TRANSFER_PARAMS_KEY: result.payload.encode()}
        elif not self.connector.send_kv_checksums(request, result.payload.to_bytes()):
            # E.g. nothing of the request is pushed (no blocks to send).
            self._not_carried(request.request_id, carrier, kv_transfer_params)
            return kv_transfer_params
        self.stats["sent"] += 1
        self._metrics[metrics.SENT] += 1
        if self.recheck_sends:
            # The consumer may name the transfer by the router's id (Mooncake).
            transfer_id = incident.outside_id((request.kv_transfer_params or {}).get("transfer_id"))
            self._sent[request.request_id] = _Pending(pending.blocks, expected=result.payload,
                                                      carrier=getattr(carrier, "value", None),
                                                      remote=(transfer_id, None))
        return kv_transfer_params

    def recheck_before_free(self, request: Request, block_ids) -> bool:
        """The connector reports the request's transfer complete: hold its blocks for a re-check?

        True: the blocks are checksummed again in the next scheduled step,
        and the Scheduler frees them once take_rechecked returns the request.
        False: free them now (no checksums were sent for it, re-checks are
        off, or its blocks are no longer those the checksums were sent for).
        `block_ids`: the request's blocks now, per KV cache group.
        """
        rid = request.request_id
        sent = self._sent.pop(rid, None)
        if sent is None:
            return False
        try:
            now = request_blocks(block_ids, self.layouts, 0, sent.blocks.num_tokens, self.null_block_id)
        except Exception:
            logger.exception("KV checksums: reading the blocks of request %s at its transfer's completion "
                             "raised; its KV is not re-checked.", rid)
            now = None
        if now != sent.blocks.groups:
            self._producer_result(rid, sent, RecheckResult(
                RecheckStatus.NOT_RECHECKED, reason="the request's blocks are not those its checksums were sent for"),
                "blocks_moved")
            return False
        sent.records = []
        self._rechecking[rid] = sent
        self._step.reqs_to_recheck[rid] = sent.blocks
        return True

    def take_rechecked(self, scheduled: KVChecksumScheduled | None) -> list[str]:
        """Judge the re-checks of the step whose output is being processed; their requests' blocks may be freed.

        Call in update_from_output after collect, with the step's own
        kv_checksum_scheduled. Every request the step re-checked is
        returned, whatever the result: a re-check never keeps blocks longer
        than one step.
        """
        if scheduled is None or not scheduled.reqs_to_recheck:
            return []
        done = []
        for rid in scheduled.reqs_to_recheck:
            sent = self._rechecking.pop(rid, None)
            if sent is None:
                continue
            done.append(rid)
            try:
                again = self._sum_own(rid, sent)
                result = recheck(sent.expected, again.payload, again.reason)
            except Exception as exc:
                logger.exception("KV checksums: re-checking the KV of request %s raised; it is not re-checked.", rid)
                result = RecheckResult(RecheckStatus.NOT_RECHECKED, reason=f"comparing raised {type(exc).__name__}")
            self._producer_result(rid, sent, result, "sum_failed")
        return done

    def _sum_own(self, rid: str, pending: _Pending) -> ProducerSum:
        """This producer's workers' records of a request, summed over the blocks they were asked for."""
        scheduled = {g: (b.start, len(b.block_ids)) for g, b in pending.blocks.groups.items()}
        return sum_producer(pending.records, rid, self.num_workers, scheduled, pending.blocks.num_tokens,
                            self.tp_size)

    def _own_sizes(self) -> dict[str, Any]:
        """This side's TP and PP sizes and block sizes, as its incident lines name them."""
        return {"tp_size": self.tp_size, "pp_size": self.num_workers // max(self.tp_size, 1),
                "block_sizes": {layout.group_id: layout.block_size for layout in self.layouts}}

    def _producer_result(self, rid: str, sent: _Pending, result: RecheckResult, not_rechecked_reason: str) -> None:
        """Count, log and write the incident line of one producer re-check."""
        if result.status is RecheckStatus.CHANGED:
            self._metrics[metrics.PRODUCER_CHANGED] += 1
            self._metrics[metrics.PRODUCER_CHANGED_BLOCKS] += result.num_changed_blocks
            where = "; ".join(f"group {g} blocks {format_positions(p)}" for g, p in sorted(result.changed.items()))
            logger.error("KV checksums: the KV of producer request %s changed before its transfer completed (%s): "
                         "the consumer's copy differs from the checksums sent with it, so its check fails. The KV "
                         "was written while the connector (%s) held it for the transfer: a kernel writing past its "
                         "own blocks, or blocks freed and reused before the transfer ended.",
                         rid, where, self.connector_name)
        elif result.status is RecheckStatus.INTACT:
            self._metrics[metrics.PRODUCER_INTACT] += 1
        else:
            self._metrics[metrics.labelled(metrics.PRODUCER_NOT_RECHECKED, not_rechecked_reason)] += 1
            logger.debug("KV checksums: the KV of producer request %s is not re-checked: %s.", rid, result.reason)
        incident.emit(incident.producer_record(
            request_id=rid, transfer_id=sent.remote[0], result=result.status.value, groups=result.changed,
            engine_id=self.engine_id, connector=self.connector_name, carrier=sent.carrier, **self._own_sizes(),
            reason=result.reason, now=time.time()))

    def _count_read_after_release(self, rid: str) -> None:
        """A consumer read request `rid`'s KV after this producer's connector
        released its blocks: count and log it once, however many workers
        report it."""
        if rid in self._read_after_release:
            return
        self._read_after_release[rid] = None
        while len(self._read_after_release) > MAX_READS_AFTER_RELEASE_KEPT:
            del self._read_after_release[next(iter(self._read_after_release))]
        self._metrics[metrics.PRODUCER_READ_AFTER_RELEASE] += 1
        logger.error("KV checksums: a consumer read the KV of producer request %s after the connector (%s) had "
                     "released its blocks (its lease expired first), so that load may hold other requests' KV; "
                     "its check fails if the blocks were reused. Give the connector's lease (kv_lease_duration "
                     "in kv_connector_extra_config for NIXL) more than the consumer's longest stall.",
                     rid, self.connector_name)
        incident.emit(incident.producer_record(
            request_id=rid, transfer_id=None, result=incident.READ_AFTER_RELEASE, groups={},
            engine_id=self.engine_id, connector=self.connector_name, carrier=None, **self._own_sizes(),
            reason="read after the connector released the blocks", now=time.time()))

    def release_send(self, req_id: str) -> None:
        """The Scheduler freed the request's blocks: nothing of them is left to re-check."""
        self._live_sends.remove(req_id)
        self._sent.pop(req_id, None)
        self._rechecking.pop(req_id, None)
        self._step.reqs_to_recheck.pop(req_id, None)

    def _not_carried(self, req_id: str, carrier, kv_transfer_params) -> None:
        self.stats["not_carried"] += 1
        self._metrics[metrics.labelled(metrics.NOT_SENT, "not_carried")] += 1
        logger.debug("KV checksums of request %s are not sent: its connector carries nothing for it "
                     "(carrier %s, kv_transfer_params %s).", req_id,
                     getattr(carrier, "value", carrier), "absent" if kv_transfer_params is None else "present")

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
        for rid in already_failed:
            # The connector failed the load (reported now or earlier): over,
            # never compared, whether or not it is also reported finished.
            if rid in self._recvs:
                self._drop_recv(rid)
                self._metrics[metrics.labelled(metrics.NOT_COMPARED, "load_failed")] += 1
        for rid in finished_recving or ():
            pending = self._drop_recv(rid)
            if pending is None:
                continue
            verdict = self._judge(rid, pending)
            if verdict is None:
                continue
            self._note_groups_left_out(rid, pending)
            self._note_tp_left_out(verdict)
            if verdict.status is CheckStatus.VERIFIED:
                continue
            if self.fail_closed:
                failed[rid] = client_reason(verdict)
                self._failed_prefix[rid] = (self._verified_prefix(pending, verdict), pending.blocks.num_tokens)
        return failed

    def recompute_from(self, req_id: str) -> int:
        """Where vLLM recomputes a load this update failed (verify_finished_loads), in tokens.

        Called by the Scheduler under kv_load_failure_policy "recompute" for
        each such load it rolls back, before the request is scheduled again.
        The request keeps its local prefix-cache hit and the loaded blocks
        before the first bad one (_verified_prefix), or nothing (0: the whole
        prompt, vLLM's own rollback of a failed load). Counts the rollback
        and the loaded tokens it drops.
        """
        kept, load_end = self._failed_prefix.get(req_id, (None, 0))
        scope = "whole_prompt" if kept is None else "from_first_bad_block"
        self._metrics[metrics.labelled(metrics.LOADS_RECOMPUTED, scope)] += 1
        self._metrics[metrics.RECOMPUTED_TOKENS] += max(load_end - (kept or 0), 0)
        return kept or 0

    def _verified_prefix(self, pending: _Pending, verdict: LoadVerdict) -> int | None:
        """The tokens of a failed load's request that compared equal or were never loaded, or None.

        Tokens [0, first bad block): the local prefix-cache hit and the
        loaded blocks before the first one that mismatched. Only where that
        prefix is known good in every group: one KV cache group, of
        attention (a Mamba state is not per block; a sliding window's blocks
        before the window are not transferred), mismatched, every loaded
        block compared (a payload that covers fewer blocks compares less
        than was loaded, and what it left out is not verified). Anything else,
        and an unverified load: None, the whole prompt is recomputed.
        """
        if verdict.status is not CheckStatus.MISMATCH or self.num_kv_cache_groups != 1:
            return None
        gid, blocks = next(iter(pending.blocks.groups.items()))  # a mismatch compared the one group
        layout = self._layout(gid)
        group = verdict.groups.get(gid)
        if layout.is_state or layout.window_blocks > 0 or group is None or not group.mismatched_blocks:
            return None
        if group.compared_blocks != len(blocks.block_ids):
            return None
        first = min(group.mismatched_blocks)
        if not blocks.start <= first < blocks.start + len(blocks.block_ids):
            return None
        return first * layout.block_size

    def _first_bad_token(self, verdict: LoadVerdict) -> int:
        """The first token of the first mismatched block over the groups (0 for a Mamba state group).

        What follows it in the request (later blocks, and decode attends to
        it) depends on bad KV; a state group's whole state is bad.
        """
        first = []
        for gid, positions in verdict.mismatched_blocks.items():
            layout = self._layout(gid)
            first.append(0 if layout.is_state or not positions else min(positions) * layout.block_size)
        return min(first, default=0)

    def take_cache_limits(self) -> dict[str, int]:
        """Requests that use KV which failed its check (fail-open), each with the token from which
        their blocks must never be in the prefix cache.

        Called by the Scheduler after this update's verdicts
        (verify_sync_loads, verify_finished_loads). Its request uses such
        KV; no other request may hit it, nor any block computed after it
        (whose KV attended to it). The Scheduler sets the request's
        max_cached_tokens and evicts its blocks from there on (blocks_from).
        """
        limits, self._cache_limits = self._cache_limits, {}
        self.export_guard.taint(limits)
        return limits

    def blocks_from(self, num_tokens: int, block_ids) -> set[int]:
        """A request's block ids (per KV cache group) that hold tokens at or past num_tokens."""
        out: set[int] = set()
        for layout in self.layouts:
            if layout.group_id < len(block_ids):
                ids = block_ids[layout.group_id]
                out.update(i for i in ids[num_tokens // layout.block_size:] if i != self.null_block_id)
        return out

    def _judge(self, rid: str, pending: _Pending) -> LoadVerdict | None:
        """Compare one finished load, count and log its verdict, write the
        incident line of a mismatch, keep a mismatch used under fail-open
        out of the prefix cache, and let the connector drop offloaded KV
        that failed.

        None: an offloaded load none of whose groups the workers keep entries
        for (fixed at startup): not checked, and never failed, since every
        load like it would fail (and, retried, load the same blocks again).
        """
        try:
            if pending.blocks.offloaded:
                verdict = compare_offloaded(
                    pending.records, rid, self.num_workers,
                    {g: (b.start, len(b.block_ids)) for g, b in pending.blocks.groups.items()},
                    pending.blocks.num_tokens, pending.block_hashes)
            else:
                scheduled = {g: (b.start, len(b.block_ids), self._layout(g).block_size, self._layout(g).is_state,
                                 self._layout(g).window_blocks > 0) for g, b in pending.blocks.groups.items()}
                verdict = compare_load(pending.expected, pending.records, rid, self.num_workers, scheduled,
                                       pending.blocks.num_tokens, missing_reason=pending.missing_reason,
                                       missing_key=pending.missing_key, producer_tp_size=pending.producer_tp_size,
                                       own=None if pending.expected is None else request_content(pending.request))
        except Exception as exc:
            # The payload comes from the client: whatever comparing one load
            # raises must not escape update_from_output and stop the engine
            # core. The load is unverified, and the other loads go on.
            logger.exception("Comparing the KV checksums of request %s raised %s: %s; the load is "
                             "unverified. Please report this with the request's kv_transfer_params.",
                             rid, type(exc).__name__, exc)
            verdict = LoadVerdict(req_id=rid, status=CheckStatus.UNVERIFIED,
                                  reason_key=UnverifiedReason.COMPARISON_ERROR,
                                  reason=f"comparing raised {type(exc).__name__}: {exc}",
                                  source=OFFLOADED_SOURCE if pending.blocks.offloaded else "producer")
        if pending.blocks.offloaded and verdict.reason_key is UnverifiedReason.NO_GROUPS:
            self._metrics[metrics.labelled(metrics.OFFLOADED_NOT_CHECKED, "no_groups")] += 1
            if "offloaded_no_groups" not in self._warned:
                self._warned.add("offloaded_no_groups")
                logger.warning("KV checksums: loads of offloaded KV (e.g. request %r) are not checked: the workers "
                               "keep no checksum entries for the loaded KV cache groups (see the workers' startup "
                               "log for why). Logged once.", rid)
            return None
        self.stats[verdict.status.value] += 1
        if pending.blocks.offloaded:
            self.stats[f"offloaded_{verdict.status.value}"] += 1
        self._count(verdict)
        self._log(verdict)
        if verdict.status is CheckStatus.MISMATCH:
            self._incident(pending, verdict)
        if verdict.status is CheckStatus.MISMATCH and not self.fail_closed and not pending.ended:
            # Fail-open: its request uses the bad KV, and keeps it to itself
            # (take_cache_limits). Asynchronous and synchronous loads alike.
            self._cache_limits[rid] = self._first_bad_token(verdict)
        if pending.blocks.offloaded and verdict.status is not CheckStatus.VERIFIED:
            self._offloaded_failed(pending, verdict)
        return verdict

    def _incident(self, pending: _Pending, verdict: LoadVerdict) -> None:
        """Write the mismatch's incident line (incident.py): what a join with the producer's log needs."""
        expected = pending.expected
        incident.emit(incident.incident_record(
            request_id=verdict.req_id, verdict=verdict.status.value, source=verdict.source, cause=verdict.cause,
            groups=verdict.mismatched_blocks, remote_request_id=pending.remote[0],
            remote_engine_id=pending.remote[1], engine_id=self.engine_id, connector=self.connector_name,
            carrier=pending.carrier, **self._own_sizes(),
            producer_tp_size=None if expected is None else expected.producer_tp_size,
            producer_block_sizes=None if expected is None else {g: e.block_size for g, e in expected.groups.items()},
            now=time.time()))

    def _failed_positions(self, pending: _Pending, verdict: LoadVerdict) -> dict[int, tuple[int, ...]] | None:
        """The block positions of an offloaded load that failed, per group, or None to keep them.

        A mismatch, under either policy: the stored value is bad, so a retry
        or another request with the same prefix must not load (or hit) it
        again. An unverified load under fail-closed: its blocks cannot be
        trusted and are not used, so every loaded position counts as failed;
        otherwise the retry would load them again and fail again.
        """
        if verdict.status is CheckStatus.MISMATCH:
            return verdict.mismatched_blocks
        if self.fail_closed:
            return {g: tuple(range(b.start, b.start + len(b.block_ids))) for g, b in pending.blocks.groups.items()}
        return None

    def _offloaded_failed(self, pending: _Pending, verdict: LoadVerdict) -> None:
        """Let the connector drop the offloaded KV that failed its check (_failed_positions)."""
        bad = self._failed_positions(pending, verdict)
        if bad is None:
            return
        request = pending.request
        try:
            self.connector.on_kv_checksum_failure(request, bad)
        except Exception:
            logger.exception("KV checksums: %s.on_kv_checksum_failure raised for request %s (group -> block "
                             "positions %s); the offloaded KV that failed may be loaded again.",
                             type(self.connector).__name__, verdict.req_id, bad)

    def _count(self, verdict: LoadVerdict) -> None:
        prefix = metrics.OFFLOADED if verdict.source == OFFLOADED_SOURCE else ""
        if verdict.status is CheckStatus.VERIFIED:
            self._metrics[prefix + metrics.VERIFIED] += 1
        elif verdict.status is CheckStatus.MISMATCH:
            self._metrics[prefix + metrics.MISMATCHED] += 1
            if not prefix:
                self._metrics[metrics.labelled(metrics.MISMATCH_CAUSES, verdict.cause)] += 1
            self._metrics[prefix + metrics.MISMATCHED_BLOCKS] += sum(
                len(b) for b in verdict.mismatched_blocks.values())
        else:
            # One reason per load: the load's own, else its first group's.
            keys = verdict.reason_keys
            reason = keys[0].value if keys else UnverifiedReason.COMPARISON_ERROR.value
            self._metrics[metrics.labelled(prefix + metrics.UNVERIFIED, reason)] += 1

    def _note_groups_left_out(self, req_id: str, pending: _Pending) -> None:
        """Count and log the groups the block rule left out on both sides.

        A group whose blocks hold a null block after a non-null one is not
        checksummed; when neither side has it, it is absent from the verdict,
        so say so here rather than let it vanish.
        """
        if pending.expected is None:
            return
        left_out = [layout.group_id for layout in self.layouts
                    if layout.group_id not in pending.blocks.groups
                    and layout.group_id not in pending.expected.groups]
        if left_out:
            self.stats["groups_left_out"] += len(left_out)
            logger.debug("KV checksums of request %r: KV cache groups %s are not compared: on both sides a "
                         "null block follows a non-null one in their loaded blocks.", req_id, left_out)

    def _note_tp_left_out(self, verdict: LoadVerdict) -> None:
        """Warn once that state groups are not compared between different TP sizes."""
        if not verdict.left_out_tp:
            return
        self.stats["groups_left_out_tp"] += len(verdict.left_out_tp)
        if "left_out_tp" not in self._warned:
            self._warned.add("left_out_tp")
            logger.warning(
                "KV checksums: KV cache groups %s are not compared for request %r and other loads between "
                "different TP sizes: their layers do not describe how TP splits their state "
                "(MambaBase.get_state_splits), so their checksums differ with the TP size. The other groups "
                "are compared. Logged once.", list(verdict.left_out_tp), verdict.req_id)

    def forget(self, req_id: str) -> None:
        """The request ended (or its load failed): drop what is kept for it."""
        self._sends.pop(req_id, None)
        if self._step.reqs_loaded.pop(req_id, None) is not None:
            # Not sent to the workers yet: no records will come for it.
            loads = self._sync[self._step.step]
            self._release(loads.pop(req_id))
            if not loads:
                del self._sync[self._step.step]
        for loads in self._sync.values():
            if req_id in loads:
                # Its step ran: judged with that step's records (its blocks,
                # cached and now free, leave the prefix cache if it failed),
                # but there is no request left to fail.
                loads[req_id].ended = True
        if self._drop_recv(req_id) is not None:
            self._metrics[metrics.labelled(metrics.NOT_COMPARED, "request_ended")] += 1
        self._step.reqs_to_send.pop(req_id, None)

    def _drop_recv(self, req_id: str) -> _Pending | None:
        """Stop waiting for the request's load, here and on every worker.

        The workers are told to forget it in the next step, whatever the
        reason (ended, failed, compared): a worker whose connector never
        reports the load finished must not keep its blocks forever. A load
        that started in this step and is not sent yet is not sent at all.
        """
        pending = self._recvs.pop(req_id, None)
        self._live_loads.remove(req_id)
        if pending is not None:
            self._step.reqs_to_recv.pop(req_id, None)
            self._step.reqs_to_forget.add(req_id)
        return pending

    def _layout(self, group_id: int) -> GroupLayout:
        return next(layout for layout in self.layouts if layout.group_id == group_id)

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
