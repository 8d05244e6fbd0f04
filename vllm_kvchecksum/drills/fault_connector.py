"""KVChecksumFaultConnector: a KV connector for operators' drills.

It wraps one real connector (NixlConnector in practice) the way vLLM's
MultiConnector wraps its children, and on the consumer corrupts the KV a
load just wrote, after the load finishes and before the KV checksum worker
checksums it. A drill then shows whether the checksums report the damage
where they should: a mismatch at the corrupted block positions, a verified
load when only bytes past the prompt changed, an unverified load when the
checksums were lost on the way. The fault kinds themselves are the pure
functions of vllm_kvchecksum.drills.faults, its settings and control file are
fault_settings, its JSON records fault_records; this module decides when and
where to apply them. Loaded through kv_connector_module_path, it needs no vLLM patch
(docs/fault-drills.md has the configuration).

Scheduler side (engine core): each load that starts draws, once, whether it
gets a fault and which (update_state_after_alloc); "drop_checksums" is
applied there, the other kinds become a plan naming the load's blocks per
KV cache group (the checksum code's own block rule), sent to the workers
with the step's connector metadata. Worker side: when the wrapped connector
reports a planned load finished (get_transfer_results), TP rank 0 of PP
stage 0 injects the fault into its KV cache tensors, logs it and appends a
JSON record.

Never use this connector in production: it corrupts KV on purpose.
"""

from __future__ import annotations

import collections
import logging
import os
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, KVConnectorTransferResults
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector, MultiKVConnectorMetadata

from vllm_kvchecksum.drills import faults
from vllm_kvchecksum.core.blocks import request_blocks
from vllm_kvchecksum.engine.carrier import KV_TRANSFER_PARAMS_KEY
from vllm_kvchecksum.drills.kv_witness import head_digests, state_block_digests
from vllm_kvchecksum.drills.fault_records import RECORD_FIELDS, _RecordLog, describe_record, expect_of, injection_record
from vllm_kvchecksum.drills.fault_settings import (DROP_CHECKSUMS, KNOWN_KINDS, LOGGER_NAME, MAX_STALL_S,
                                                   ControlFile, FaultSettings, check_connectors, parse_fault_settings,
                                                   parse_kinds)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from vllm_kvchecksum.core.blocks import GroupLayout

__all__ = ["KVChecksumFaultConnector", "FaultConnectorMetadata", "FaultPlan", "FaultDecision", "FaultSettings",
           "FaultDecider", "ControlFile", "WitnessPlan", "parse_fault_settings", "parse_kinds", "checksummed_layers", "witnessed_layers", "expect_of",
           "injection_record", "describe_record", "DROP_CHECKSUMS", "KNOWN_KINDS", "LOGGER_NAME", "RECORD_FIELDS"]

logger = logging.getLogger(LOGGER_NAME)

# misplace_block copies a block of another recent load: how many loads back.
RECENT_LOADS = 8


# ----------------------------------------------------------------- decisions

class FaultDecision(NamedTuple):
    """One load's fault: its kind, and the seed of the worker's choices."""

    kind: str
    seed: int


class FaultDecider:
    """Draws, once per load, whether it gets a fault and which.

    One random.Random(seed) across loads: the same seed and the same
    sequence of loads (and control-file settings) give the same decisions.
    """

    def __init__(self, seed: int, control: ControlFile):
        self._rng = random.Random(seed)
        self.control = control

    def decide(self) -> FaultDecision | None:
        kinds, rate = self.control.settings()
        # Drawn for every load, so a load's draw does not depend on whether
        # the loads before it were faulted.
        if self._rng.random() >= rate or not kinds:
            return None
        return FaultDecision(self._rng.choice(kinds), self._rng.getrandbits(63))


class FaultPlan(NamedTuple):
    """What the workers inject into one load.

    groups: KV cache group id -> (block position of block_ids[0], the
    load's block ids), exactly the blocks the checksum scheduler compares.
    """

    kind: str
    seed: int
    num_tokens: int
    groups: dict[int, tuple[int, tuple[int, ...]]]


class WitnessPlan(NamedTuple):
    """The blocks one transfer's ground truth digests (kv_witness).

    groups: as FaultPlan's. remote_request_id: for a load, the producer's
    request id its kv_transfer_params name (to find the producer's digests).
    """

    num_tokens: int
    groups: dict[int, tuple[int, tuple[int, ...]]]
    remote_request_id: str | None = None


@dataclass
class FaultConnectorMetadata(MultiKVConnectorMetadata):
    """MultiConnector's metadata plus the plans of loads started this step.

    Each plan is sent once, in the step its load starts; a worker keeps it
    until its connector reports the load finished or failed, or the request
    ends.
    """

    fault_plans: dict[str, FaultPlan] = field(default_factory=dict)
    # Ground truth (witness_path): loads started this step, and the
    # producer requests whose prompt KV this step finishes.
    witness_loads: dict[str, WitnessPlan] = field(default_factory=dict)
    witness_sends: dict[str, WitnessPlan] = field(default_factory=dict)
    # target "sends": finished producer requests whose held blocks get their
    # fault at the start of this step (their checksums were taken in an
    # earlier step).
    send_fault_plans: dict[str, FaultPlan] = field(default_factory=dict)
    # Seconds the workers stall before this step's transfers are posted.
    stall_s: float = 0.0


@dataclass
class _PendingPlan:
    """A load decided in update_state_after_alloc, planned in build_connector_meta."""

    request: Request
    decision: FaultDecision
    num_external_tokens: int


def _parallel_ranks() -> tuple[int, int]:
    """(TP rank, PP rank) of this worker; (0, 0) when vLLM's parallel state
    is not initialised (tests, single-process use)."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank(), get_pp_group().rank_in_group
    except Exception:  # AssertionError: the groups are not initialised
        return 0, 0


def _tp_size() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_world_size()
    except Exception:
        return 1


def checksummed_layers(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                       kv_caches: Mapping[str, torch.Tensor], tp_rank: int, tp_size: int) -> dict[int, list[str]]:
    """Per KV cache group this worker checksums, the layers it checksums.

    The KVChecksumWorker's own plan (_worker_plans), so a fault never lands in
    a group the checksums skip (compressed or host-resident caches, ...):
    its record would promise a mismatch nobody reports. Mamba state groups
    are left out too: the drill's faults are per token, a state is not.
    """
    plans = _worker_plans(vllm_config, kv_cache_config, kv_caches, tp_rank, tp_size)
    return {gid: [c.name for c in plan.caches] for gid, plan in plans.items()
            if plan.skip_reason is None and plan.caches and not plan.state}


def witnessed_layers(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                     kv_caches: Mapping[str, torch.Tensor], tp_rank: int, tp_size: int
                     ) -> tuple[dict[int, dict[str, int]], dict[int, dict[str, int]]]:
    """What this worker's ground truth digests, from the checksum worker's own plan:
    (per attention group, each layer's first global KV head on this rank;
    per Mamba state group, the bytes of each layer's page the checksums
    cover, the states the connector transfers)."""
    from vllm_kvchecksum.engine.group_plan import layer_spec
    from vllm_kvchecksum.engine.mamba_plan import covered_state_bytes

    plans = _worker_plans(vllm_config, kv_cache_config, kv_caches, tp_rank, tp_size)
    heads, states = {}, {}
    for gid, plan in plans.items():
        if plan.skip_reason is not None or not plan.caches:
            continue
        if plan.state:
            group_spec = kv_cache_config.kv_cache_groups[gid].kv_cache_spec
            states[gid] = {c.name: sum(covered_state_bytes(layer_spec(group_spec, c.name))) for c in plan.caches}
        else:
            heads[gid] = {c.name: c.first_head for c in plan.caches}
    return heads, states


def _worker_plans(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, kv_caches: Mapping[str, torch.Tensor],
                  tp_rank: int, tp_size: int):
    """The KVChecksumWorker's own group plans (group_plan.plan_groups), with
    the same inputs as runner.create_kv_checksum_worker."""
    from vllm_kvchecksum.engine.group_plan import TPPosition, plan_groups
    from vllm_kvchecksum.engine.runner import uniform_model_kv_heads

    try:
        model_kv_heads = uniform_model_kv_heads(vllm_config)
    except Exception:  # no readable model config: replication is then decided from the caches alone
        model_kv_heads = None
    return plan_groups(kv_cache_config, dict(kv_caches), TPPosition(tp_rank, tp_size, model_kv_heads), "torch")


# ----------------------------------------------------------------- connector

class KVChecksumFaultConnector(MultiConnector):
    """A drill connector: one wrapped connector, plus faults in loaded KV.

    MultiConnector with exactly one child does all the forwarding (loads,
    saves, handshakes, the checksum carrier hooks); this class adds the
    fault decisions on the scheduler and the injections on the workers.
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        # Validated before MultiConnector builds the child, so a bad config
        # fails with a message naming the key rather than an assert.
        check_connectors(extra)
        self.settings = parse_fault_settings(extra)
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._records = _RecordLog(self.settings.log_path)
        # Scheduler side.
        self._control = ControlFile(self.settings.control_path, self.settings.kinds, self.settings.rate,
                                    self.settings.stall_rate)
        self._decider = FaultDecider(self.settings.seed, self._control)
        self._decided: dict[str, _PendingPlan] = {}
        self._layouts: list[GroupLayout] | None = None
        # Ground truth and stalls: loads started since the last metadata.
        self._witness_records = _RecordLog(self.settings.witness_path)
        self._started: dict[str, tuple[Request, int]] = {}
        # Loads witnessed started, until their request ends: whether a step
        # reported them finished (or failed) yet, for the request's
        # "request_ended" line; and the requests that ended with theirs not
        # reported yet, until it is known whether the step that ends them
        # reports it (_load_ended).
        self._loads_open: dict[str, bool] = {}
        self._ended_open: dict[str, Request] = {}
        self._stall_rng = random.Random(self.settings.seed ^ 0x5EED)
        self._producer_reqs: dict[str, Request] = {}
        # target "sends": the planned fault of each producer request whose
        # prompt KV is checksummed, until it finishes; then, if its blocks
        # are held for the transfer, until the next metadata carries it.
        self._send_candidates: dict[str, FaultPlan] = {}
        self._send_faults: dict[str, FaultPlan] = {}
        # Worker side.
        self._plans: dict[str, FaultPlan] = {}
        # Loads whose connector-delivered checksums this worker dropped
        # (drop_checksums), until the load finishes.
        self._dropped: set[str] = set()
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._ranks: tuple[int, int] = (0, 0)
        self._layers: dict[int, list[str]] = {}
        # What the ground truth digests (witnessed_layers): per attention
        # group, layer -> first global KV head here; per Mamba state group,
        # layer -> bytes of its page.
        self._witness_heads: dict[int, dict[str, int]] = {}
        self._state_layers: dict[int, dict[str, int]] = {}
        self._recent: collections.deque[tuple[str, int, tuple[int, ...]]] = collections.deque(maxlen=RECENT_LOADS)
        self._witness_loads: dict[str, WitnessPlan] = {}
        self._witness_sends: dict[str, WitnessPlan] = {}
        # The loads digested in this step, until its load errors are asked for.
        self._witnessed_now: dict[str, WitnessPlan] = {}
        if role == KVConnectorRole.SCHEDULER:
            self._log_startup(vllm_config)

    def _log_startup(self, vllm_config: VllmConfig) -> None:
        s = self.settings
        logger.warning("KV checksum drill connector active: it CORRUPTS loaded KV on purpose (kinds %s, rate %s, "
                       "seed %d, control file %s, log %s). Never use it in production.",
                       list(s.kinds), s.rate, s.seed, s.control_path, s.log_path)
        if not vllm_config.kv_transfer_config.enable_kv_checksum:
            logger.warning("KV checksum drill: enable_kv_checksum is off, so no checksum will see the faults.")

    @classmethod
    def _get_connector_classes_and_configs(cls, vllm_config: VllmConfig):
        # Also reached through classmethods (get_required_kvcache_layout,
        # build_prom_metrics) before any instance exists.
        check_connectors(vllm_config.kv_transfer_config.kv_connector_extra_config)
        return super()._get_connector_classes_and_configs(vllm_config)

    if hasattr(MultiConnector, "kv_cache_access"):  # vLLM 0.34: asked while the config is built

        @classmethod
        def kv_cache_access(cls, kv_transfer_config):
            check_connectors(kv_transfer_config.kv_connector_extra_config)
            return super().kv_cache_access(kv_transfer_config)

    def _write(self, record: dict[str, Any]) -> None:
        logger.warning("%s", describe_record(record))
        self._records.write(record)

    # ==============================
    # Scheduler-side methods
    # ==============================

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        """Keep the scheduler's cache manager (for the full block ids of a
        load and the null block id), and hand it to the child.

        Called once by the Scheduler after it built its KVCacheManager;
        MultiConnector's version only forwards it to the children.
        """
        self._kv_cache_manager = kv_cache_manager
        super().bind_kv_cache_manager(kv_cache_manager)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        """Forward to the child, then decide the load's fault, once.

        Called by the Scheduler after allocating a request's blocks; with
        num_external_tokens > 0 a load of that many tokens starts (a second
        call after the load, with 0, is not a load). drop_checksums is
        applied here, before the checksum scheduler's add_recv (called right
        after this hook) reads the request's kv_transfer_params; the other
        kinds are planned in build_connector_meta, in the same step.
        """
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if num_external_tokens <= 0:
            return
        if self.settings.witness_path is not None or self._control.stall_rate() > 0:
            self._started[request.request_id] = (request, num_external_tokens)
        if self.settings.target != "loads":
            return
        try:
            decision = self._decider.decide()
            if decision is None:
                return
            if decision.kind == DROP_CHECKSUMS and not self._carried_by_connector(request):
                self._drop_checksums(request)
            else:
                # drop_checksums of a connector-owned carrier: the workers
                # drop what their connector delivers (a plan like the others).
                self._decided[request.request_id] = _PendingPlan(request, decision, num_external_tokens)
        except Exception:
            # A drill must never take the engine down.
            logger.exception("KV checksum drill: deciding the fault of request %s failed; no fault.",
                             request.request_id)

    def _drop_checksums(self, request: Request) -> None:
        """Carrier loss: the request's kv_transfer_params lose the checksums.

        Runs after the child read the params (NIXL does in
        update_state_after_alloc); a copy replaces them, so whoever else
        holds the original dict is not changed.
        """
        params = request.kv_transfer_params
        skipped = self._unchecked_reason(request)
        if skipped is None and (not params or KV_TRANSFER_PARAMS_KEY not in params):
            skipped = f"the request carries no {KV_TRANSFER_PARAMS_KEY!r} in its kv_transfer_params"
        if skipped is None:
            request.kv_transfer_params = {k: v for k, v in params.items() if k != KV_TRANSFER_PARAMS_KEY}
        self._write(injection_record(request_id=request.request_id, kind=DROP_CHECKSUMS, side="scheduler",
                                     skipped=skipped, now=time.time(), pid=os.getpid()))

    def _carried_by_connector(self, request: Request) -> bool:
        from vllm_kvchecksum.engine.carrier import KVChecksumCarrier

        return self.kv_checksum_carrier(request, True) is KVChecksumCarrier.CONNECTOR

    def _unchecked_reason(self, request: Request) -> str | None:
        """Why the checksums give this load no verdict, or None.

        The checksum scheduler's add_recv skips a load its connector carries
        no checksums for (e.g. NIXL's bidirectional transfers); a fault there
        would prove nothing, so it is recorded as skipped instead.
        """
        if self.kv_checksum_carrier(request, True) is None:
            return "the wrapped connector carries no KV checksums for this load, so none will be compared"
        return None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> FaultConnectorMetadata:
        """The child's metadata, plus the plans of the loads started in this
        step (sent once, then forgotten here).

        Called by the Scheduler at the end of schedule(), after every
        update_state_after_alloc of the step.
        """
        child = super().build_connector_meta(scheduler_output)
        # Requests that ended outside an update since the last one, other
        # than by an abort (written at once): no step reported their loads
        # finished, so none was judged.
        self._write_ended(finished=set())
        plans = {}
        decided, self._decided = self._decided, {}
        for req_id, pending in decided.items():
            try:
                plan, skipped = self._plan(pending)
            except Exception as exc:
                logger.exception("KV checksum drill: planning the fault of request %s failed.", req_id)
                plan, skipped = None, f"planning raised {type(exc).__name__}: {exc}"
            if plan is not None:
                plans[req_id] = plan
            else:
                self._write(injection_record(request_id=req_id, kind=pending.decision.kind, side="scheduler",
                                             skipped=skipped, now=time.time(), pid=os.getpid()))
        witness_loads, stall_s = self._witness_started()
        finishing = self._sends_finishing(scheduler_output)
        witness_sends = {}
        if self.settings.witness_path is not None:
            witness_sends = {rid: WitnessPlan(n, groups) for rid, (n, groups) in finishing.items()}
        if self.settings.target == "sends":
            self._plan_send_faults(finishing)
        send_faults, self._send_faults = self._send_faults, {}
        return FaultConnectorMetadata(metadata=child.metadata, extra_async_saves=child.extra_async_saves,
                                      fault_plans=plans, witness_loads=witness_loads,
                                      witness_sends=witness_sends, send_fault_plans=send_faults, stall_s=stall_s)

    def _witness_started(self) -> tuple[dict[str, WitnessPlan], float]:
        """The loads started since the last step: their ground-truth plans
        (one "load_started" line each), and the stall the step gets."""
        started, self._started = self._started, {}
        plans, stall_s = {}, 0.0
        stall_rate = self._control.stall_rate() if started else 0.0
        for req_id, (request, num_external_tokens) in started.items():
            try:
                if stall_rate > 0 and self._stall_rng.random() < stall_rate:
                    stall_s = self.settings.stall_s
                if self.settings.witness_path is None:
                    continue
                loaded, skipped = self._load_groups(request, num_external_tokens)
                remote = (request.kv_transfer_params or {}).get("remote_request_id")
                remote = remote if isinstance(remote, str) else None
                if loaded is not None:
                    plans[req_id] = WitnessPlan(loaded[0], loaded[1], remote)
                    self._loads_open[req_id] = False
                self._witness_records.write({"side": "scheduler", "event": "load_started", "request_id": req_id,
                                             "remote_request_id": remote, "skipped": skipped,
                                             "num_tokens": loaded[0] if loaded else None, "stall_s": stall_s,
                                             "time": time.time(), "pid": os.getpid()})
            except Exception:
                logger.exception("KV checksum drill: the ground truth of request %s's load failed.", req_id)
        return plans, stall_s

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int):
        """The child's answer; with witness_path or target "sends", P/D
        producer requests are kept (until they finish) to find the step that
        finishes their prompt."""
        if (self.settings.witness_path is not None or self.settings.target == "sends") \
                and (request.kv_transfer_params or {}).get("do_remote_decode"):
            self._producer_reqs[request.request_id] = request
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def _plan_send_faults(self, finishing: dict[str, tuple[int, dict[int, tuple[int, tuple[int, ...]]]]]) -> None:
        """Decide, once per producer request whose prompt KV this step
        checksums, whether it gets a fault once it has finished (request_finished)."""
        for req_id, (num_tokens, groups) in finishing.items():
            try:
                decision = self._decider.decide()
                if decision is None:
                    continue
                if decision.kind == DROP_CHECKSUMS:
                    self._write(injection_record(request_id=req_id, kind=DROP_CHECKSUMS, side="scheduler",
                                                 skipped="drop_checksums does not apply to a producer's sends",
                                                 now=time.time(), pid=os.getpid()))
                    continue
                self._send_candidates[req_id] = FaultPlan(decision.kind, decision.seed, num_tokens, groups)
            except Exception:
                logger.exception("KV checksum drill: deciding the fault of producer request %s failed; no fault.",
                                 req_id)

    def request_finished(self, request: Request, blocks: list[int]) -> tuple[bool, dict[str, Any] | None]:
        result = super().request_finished(request, blocks)
        self._send_finished(request, result[0])
        self._load_ended(request)
        return result

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        result = super().request_finished_all_groups(request, block_ids)
        self._send_finished(request, result[0])
        self._load_ended(request)
        return result

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Forward to the child; note the witnessed loads the step reports
        finished (or failed), and write the lines of the requests that ended
        in this update before the connector heard of it (_load_ended)."""
        super().update_connector_output(connector_output)
        finished = {*(connector_output.finished_recving or ()), *(connector_output.failed_recving or ())}
        for req_id in finished:
            if req_id in self._loads_open:
                self._loads_open[req_id] = True
        self._write_ended(finished)

    def _load_ended(self, request: Request) -> None:
        """The request of a witnessed load ended: one "request_ended" line
        saying whether a step reported its load finished (or failed) before it
        ended. The scheduler judges a step's finished loads before it tells
        the connector, and may end a request there (its check failed under
        fail-closed): such a request waits for that step's update_connector_output.
        One aborted (its client hung up: between steps) with its load not
        reported is written false at once, even if the next update reports
        the load: its request ended before the checksum scheduler could judge
        the load (counted as not_compared{request_ended}), so nobody used that
        KV. Any other end outside an update is written false at the next
        build_connector_meta. The soak excuses a victim only on this line of
        its own (kvcs_soak/truth.py)."""
        finished = self._loads_open.pop(request.request_id, None)
        if finished is None:
            return
        if finished:
            self._write_ended_line(request, True)
        elif getattr(request.status, "name", None) == "FINISHED_ABORTED":
            # Aborted (its client hung up) between steps, never inside an
            # update: the checksum scheduler dropped the load unjudged, even
            # when the next update reports it finished (the batch queue full,
            # no step scheduled before that update).
            self._write_ended_line(request, False)
        else:
            self._ended_open[request.request_id] = request

    def _write_ended(self, finished: set[str]) -> None:
        ended, self._ended_open = self._ended_open, {}
        for req_id, request in ended.items():
            self._write_ended_line(request, req_id in finished)

    def _write_ended_line(self, request: Request, load_finished: bool) -> None:
        try:
            self._witness_records.write({"side": "scheduler", "event": "request_ended",
                                         "request_id": request.request_id, "load_finished": load_finished,
                                         "status": getattr(request.status, "name", str(request.status)),
                                         "time": time.time(), "pid": os.getpid()})
        except Exception:
            logger.exception("KV checksum drill: the ground truth of request %s's end failed.", request.request_id)

    def _send_finished(self, request: Request, delay_free: bool) -> None:
        """A producer request finished: its planned send fault goes to the
        workers with the next metadata, only if the connector holds its
        blocks for the transfer (else they are freed now, and may be
        another request's by the time the fault would land)."""
        plan = self._send_candidates.pop(request.request_id, None)
        if plan is None:
            return
        from vllm_kvchecksum.engine.scheduler import NORMAL_FINISHES

        # Only these finishes send checksums (KVChecksumScheduler.request_finished).
        if delay_free and request.status.name in NORMAL_FINISHES:
            self._send_faults[request.request_id] = plan
        else:
            self._write(injection_record(request_id=request.request_id, kind=plan.kind, side="scheduler",
                                         skipped="the connector does not hold the request's blocks for a transfer",
                                         now=time.time(), pid=os.getpid()))

    def _sends_finishing(self, scheduler_output: SchedulerOutput
                         ) -> dict[str, tuple[int, dict[int, tuple[int, tuple[int, ...]]]]]:
        """The P/D producer requests whose prompt KV this step finishes
        (their scheduled tokens cross num_prompt_tokens), with the blocks
        holding the prompt's tokens by the checksum scheduler's rule:
        (num_tokens, group -> (first position, block ids)). Their checksums
        (and digests) are taken after this step's forward.

        Read here from the request and the cache manager: the Scheduler
        advances num_computed_tokens after this hook, and builds the
        checksum scheduler's sends after it too.
        """
        if not self._producer_reqs:
            return {}
        plans = {}
        for req_id, request in list(self._producer_reqs.items()):
            if request.is_finished():
                del self._producer_reqs[req_id]
                continue
            scheduled = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            computed, prompt = request.num_computed_tokens, request.num_prompt_tokens
            if not scheduled or not computed < prompt <= computed + scheduled:
                continue
            try:
                groups = request_blocks(self._kv_cache_manager.get_block_ids(req_id), self._transfer_layouts(), 0,
                                        prompt, self._null_block_id())
                plans[req_id] = (prompt, {g: (b.start, tuple(b.block_ids)) for g, b in groups.items()})
            except Exception:
                logger.exception("KV checksum drill: the prompt blocks of producer request %s could not be read "
                                 "(no ground truth, no send fault for it).", req_id)
        return plans

    def _load_groups(self, request: Request, num_external_tokens: int
                     ) -> tuple[tuple[int, dict[int, tuple[int, tuple[int, ...]]]] | None, str | None]:
        """((num_tokens, group -> (first position, block ids)), None) of an
        async load, by the checksum scheduler's own rule; or (None, why not).

        Built in build_connector_meta, not in update_state_after_alloc: the
        Scheduler sets request.num_computed_tokens (local prefix hit + loaded
        tokens) only after that hook, and add_recv is called with exactly
        these numbers: num_local_tokens = num_computed_tokens -
        num_external_tokens and num_tokens = num_computed_tokens
        (vllm/v1/core/sched/scheduler.py, the load_kv_async branch), and the
        request's full block ids from the cache manager, which do not change
        while the load waits.
        """
        from vllm.v1.request import RequestStatus

        if request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            # Only async loads are checksummed (add_recv); a sync load would
            # never be reported in finished_recving.
            return None, f"not an asynchronous load (request status {request.status.name})"
        reason = self._unchecked_reason(request)
        if reason is not None:
            return None, reason
        if self._kv_cache_manager is None:
            return None, "the connector has no KV cache manager (bind_kv_cache_manager was not called)"
        num_tokens = request.num_computed_tokens
        num_local = num_tokens - num_external_tokens
        groups = request_blocks(self._kv_cache_manager.get_block_ids(request.request_id), self._transfer_layouts(),
                                num_local, num_tokens, self._null_block_id())
        if not groups:
            return None, "the load has no checksummed blocks"
        return (num_tokens, {g: (b.start, tuple(b.block_ids)) for g, b in groups.items()}), None

    def _transfer_layouts(self) -> list[GroupLayout]:
        """The checksum scheduler's transfer groups (built once, on first use)."""
        if self._layouts is None:
            from vllm_kvchecksum.engine.scheduler import transfer_layouts

            self._layouts = transfer_layouts(self._vllm_config, self._kv_cache_config)
        return self._layouts

    def _null_block_id(self) -> int:
        # The same null block id the Scheduler gives the checksum scheduler:
        # BlockPool takes block 0 off its free queue as its null block when
        # it is built, so it is 0 in practice; read it, do not assume it.
        return self._kv_cache_manager.block_pool.null_block.block_id

    def _plan(self, pending: _PendingPlan) -> tuple[FaultPlan | None, str | None]:
        """The load's blocks per group, by the checksum scheduler's own rule (_load_groups)."""
        loaded, skipped = self._load_groups(pending.request, pending.num_external_tokens)
        if loaded is None:
            return None, skipped
        return FaultPlan(pending.decision.kind, pending.decision.seed, *loaded), None

    # ==============================
    # Worker-side methods
    # ==============================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        """Forward to the child; keep the caches (the very tensors the KV
        checksum worker reads) and this worker's ranks.

        Called once per worker after the KV cache is allocated, when vLLM's
        parallel state is set up.
        """
        super().register_kv_caches(kv_caches)
        self._kv_caches = dict(kv_caches)
        self._ranks = _parallel_ranks()
        if self.injects:
            try:
                self._layers = checksummed_layers(self._vllm_config, self._kv_cache_config, kv_caches,
                                                  self._ranks[0], _tp_size())
            except Exception:
                logger.exception("KV checksum drill: cannot tell which KV cache groups are checksummed; no faults "
                                 "will be injected on this worker.")
        if self.witnesses:
            try:
                self._witness_heads, self._state_layers = witnessed_layers(
                    self._vllm_config, self._kv_cache_config, kv_caches, self._ranks[0], _tp_size())
            except Exception:
                logger.exception("KV checksum drill: cannot tell which KV cache groups are checksummed; this "
                                 "worker digests nothing for the ground truth.")

    @property
    def injects(self) -> bool:
        """Whether this worker injects: TP rank 0 of PP stage 0 only, so one
        fault hits one copy of the KV (under PP only stage-0 layers)."""
        return bool(self._kv_caches) and self._ranks == (0, 0)

    @property
    def witnesses(self) -> bool:
        """Whether this worker digests transfers for the ground truth: every
        TP rank of PP stage 0 (each digests its own heads, keyed by global
        head, so the two sides' TP sizes may differ); stage-0 layers only."""
        return self.settings.witness_path is not None and bool(self._kv_caches) and self._ranks[1] == 0

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Keep the step's new plans; the child gets its own metadata.

        Called by the model runner before each step's forward.
        """
        if isinstance(connector_metadata, FaultConnectorMetadata):
            # Every worker drops the checksums its connector delivers (any
            # one copy reaches the scheduler); one worker injects the rest.
            self._plans.update({rid: plan for rid, plan in connector_metadata.fault_plans.items()
                                if self.injects or plan.kind == DROP_CHECKSUMS})
            if self.witnesses:
                self._witness_loads.update(connector_metadata.witness_loads)
                self._witness_sends = dict(connector_metadata.witness_sends)
            if self.injects:
                # Held blocks of finished producer requests, checksummed in an
                # earlier step: nothing of this step writes them.
                for req_id, plan in sorted(connector_metadata.send_fault_plans.items()):
                    self._inject(req_id, plan)
            if connector_metadata.stall_s > 0:
                # A slow consumer: the step's transfers are posted late, and
                # no heartbeat renews a producer's lease meanwhile.
                time.sleep(min(connector_metadata.stall_s, MAX_STALL_S))
        super().bind_connector_metadata(connector_metadata)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """The child's results; the planned loads among its finished ones get
        their fault now.

        Order: the model runner calls this after the step's forward and
        feeds its finished_recving straight to the KV checksum worker
        (checksum_step in _get_kv_connector_output of
        vllm/v1/worker/kv_connector_model_runner_mixin.py, and in
        ActiveKVConnector.post_forward for the V2 runner), in the same
        step and on the same stream: the checksums see the injected fault,
        and so does every later forward using the KV.
        """
        results = super().get_transfer_results(finished_req_ids)
        try:
            # Plans of ended requests go first: their blocks may be reused.
            for req_id in (finished_req_ids or set()) | results.failed_recving:
                self._plans.pop(req_id, None)
                self._dropped.discard(req_id)
            for req_id in list(results.kv_checksums):
                plan = self._plans.get(req_id)
                if plan is not None and plan.kind == DROP_CHECKSUMS:
                    del results.kv_checksums[req_id]
                    self._dropped.add(req_id)
            for req_id in sorted(results.finished_recving):
                plan = self._plans.pop(req_id, None)
                if plan is None:
                    continue
                if plan.kind == DROP_CHECKSUMS:
                    self._record_drop(req_id)
                else:
                    self._inject(req_id, plan)
        except Exception:
            logger.exception("KV checksum drill: handling finished loads failed; no fault injected.")
        if self._witness_loads or self._witness_sends:
            try:
                self._witness(results, finished_req_ids or set())
            except Exception:
                logger.exception("KV checksum drill: digesting this step's transfers failed.")
        return results

    # -- ground truth ----------------------------------------------------------

    def _witness(self, results: KVConnectorTransferResults, finished_req_ids: set[str]) -> None:
        """Digest the loads finished now (after any fault) and the sends
        this step's forward finished; one witness line each."""
        for req_id in finished_req_ids:
            # Ended: its blocks may already hold another request's KV.
            self._witness_loads.pop(req_id, None)
        for req_id in sorted(results.failed_recving):
            if self._witness_loads.pop(req_id, None) is not None:
                self._witness_write("load_failed", req_id, None, {})
        self._witnessed_now = {}
        for req_id in sorted(results.finished_recving - results.failed_recving):
            plan = self._witness_loads.pop(req_id, None)
            if plan is not None:
                self._witness_write("load", req_id, plan, self._digests(plan))
                self._witnessed_now[req_id] = plan
        sends, self._witness_sends = self._witness_sends, {}
        for req_id, plan in sorted(sends.items()):
            self._witness_write("send", req_id, plan, self._digests(plan))

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The children's blocks whose load failed; a load digested in this
        step that wrote one of them is a failed load, not a received one.

        Called by the model runner right after get_transfer_results, in the
        same step (some connectors, e.g. Mooncake, report a failed load as
        finished and name its bad blocks here). A load not reported finished
        yet whose blocks are named is a failed load too: Mooncake's receiver
        thread queues the bad blocks and the finished load apart, so the
        blocks may come a step earlier, and vLLM then fails the request on
        them alone."""
        invalid = super().get_block_ids_with_load_errors()
        witnessed, self._witnessed_now = self._witnessed_now, {}
        if invalid and (witnessed or self._witness_loads):
            try:
                for req_id, plan in sorted({**self._witness_loads, **witnessed}.items()):
                    if any(b in invalid for _, ids in plan.groups.values() for b in ids):
                        self._witness_loads.pop(req_id, None)
                        self._witness_write("load_failed", req_id, plan, {})
            except Exception:
                logger.exception("KV checksum drill: recording this step's failed loads failed.")
        return invalid

    def _digests(self, plan: WitnessPlan) -> dict[str, dict[str, str]]:
        """group -> digest key -> digest: "position:hHEAD" per global KV head
        of attention KV; "position:tpSIZE.RANK" for a Mamba state block
        (a rank's shard of the state: comparable only at equal TP sizes)."""
        out = {}
        for group, (first, block_ids) in sorted(plan.groups.items()):
            state = self._state_layers.get(group)
            if state:
                pages = {name: (self._kv_caches[name], covered) for name, covered in state.items()}
                shard = f"tp{_tp_size()}.{self._ranks[0]}"
                out[str(group)] = {f"{p}:{shard}": d for p, d in state_block_digests(pages, block_ids, first).items()}
                continue
            heads = self._witness_heads.get(group)
            if not heads or not block_ids or first * self._block_size(group) >= plan.num_tokens:
                continue
            caches = {name: self._kv_caches[name] for name in heads}
            out[str(group)] = head_digests(caches, heads, block_ids, first, plan.num_tokens, self._block_size(group))
        return out

    def _witness_write(self, side: str, req_id: str, plan: WitnessPlan | None, digests) -> None:
        self._witness_records.write({
            "side": side, "request_id": req_id, "remote_request_id": plan.remote_request_id if plan else None,
            "num_tokens": plan.num_tokens if plan else None, "digests": digests, "tp_rank": self._ranks[0],
            "tp_size": _tp_size(), "time": time.time(), "pid": os.getpid()})

    # -- injection -----------------------------------------------------------

    def _group_caches(self, group_id: int) -> dict[str, torch.Tensor]:
        """This worker's checksummed [blocks, heads, tokens, cell] caches of a group."""
        return {name: self._kv_caches[name] for name in self._layers.get(group_id, ())}

    def _block_size(self, group_id: int) -> int:
        return self._kv_cache_config.kv_cache_groups[group_id].kv_cache_spec.block_size

    def _holds_tokens(self, plan: FaultPlan, group_id: int) -> bool:
        first, block_ids = plan.groups[group_id]
        return bool(block_ids) and first * self._block_size(group_id) < plan.num_tokens

    def _inject(self, req_id: str, plan: FaultPlan) -> None:
        """Inject one planned fault; log and record it, or why it was skipped."""
        rng = random.Random(plan.seed)
        group = None
        try:
            candidates = [g for g in sorted(plan.groups) if self._group_caches(g) and self._holds_tokens(plan, g)]
            if not candidates:
                raise ValueError("no KV cache group of the load has loaded blocks holding tokens and is "
                                 "checksummed on this worker")
            group = rng.choice(candidates)
            first, block_ids = plan.groups[group]
            caches = self._group_caches(group)
            choices = {}
            if plan.kind == "misplace_block":
                choices["source_block_id"] = self._misplace_source(req_id, group, block_ids, rng)
            if self.settings.position is not None and faults.takes_position(plan.kind):
                choices["position"] = self.settings.position
            injected = faults.inject(plan.kind, caches, block_ids, num_tokens=plan.num_tokens,
                                     block_size=self._block_size(group), rng=rng, first_position=first,
                                     layout="HND", **choices)
        except ValueError as exc:
            # The kind does not fit this load (change_tail on a full last
            # block, swap_blocks with one block, ...): no fault.
            self._write(self._record(req_id, plan.kind, group, None, skipped=str(exc)))
            return
        except Exception as exc:
            logger.exception("KV checksum drill: injecting %s into request %s raised; no fault recorded as "
                             "injected.", plan.kind, req_id)
            self._records.write(self._record(req_id, plan.kind, group, None,
                                             skipped=f"injection raised {type(exc).__name__}: {exc}"))
            return
        finally:
            if group is not None:
                self._recent.append((req_id, group, tuple(plan.groups[group][1])))
        for injection in injected:
            self._write(self._record(req_id, plan.kind, group, injection))

    def _record_drop(self, req_id: str) -> None:
        """drop_checksums of a connector-owned carrier, on its load's finish:
        recorded once (by TP rank 0 of PP stage 0)."""
        dropped = req_id in self._dropped
        self._dropped.discard(req_id)
        if self._ranks == (0, 0):
            self._write(self._record(req_id, DROP_CHECKSUMS, None, None, skipped=None if dropped else
                                     "the wrapped connector delivered no KV checksums with this load"))

    def _record(self, req_id, kind, group, injection, skipped=None) -> dict[str, Any]:
        return injection_record(request_id=req_id, kind=kind, side="worker", group=group, injection=injection,
                                skipped=skipped, tp_rank=self._ranks[0], pp_rank=self._ranks[1],
                                now=time.time(), pid=os.getpid())

    def _misplace_source(self, req_id: str, group: int, block_ids: Sequence[int], rng: random.Random) -> int:
        """A block to copy over one of the load's: one of another recent
        load's blocks of the group (another request's KV), else any block
        that is not the load's."""
        own = set(block_ids)
        num_blocks = self._kv_cache_config.num_blocks
        recent = sorted({b for rid, g, ids in self._recent if rid != req_id and g == group for b in ids
                         if b not in own and 0 <= b < num_blocks})
        if recent:
            return rng.choice(recent)
        others = [b for b in range(num_blocks) if b not in own]
        if not others:
            raise ValueError("every block of the KV cache belongs to the load: no other block to misplace")
        return rng.choice(others)

