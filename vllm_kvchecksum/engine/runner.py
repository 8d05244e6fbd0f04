"""The model runners' side of KV checksums: creating the worker, each step.

Both vLLM model runners call these: V1 (GPUModelRunner and its KV connector
mixin, which the CPU backend's runner inherits) and V2 (ActiveKVConnector).
The worker keeps the blocks of the loads in flight across steps (see
worker.py); checksum_step keeps that table in step with the scheduler's.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from vllm_kvchecksum.core.records import KVChecksumOutput, KVChecksumScheduled, RecordPurpose
from vllm_kvchecksum.engine.scheduler import kv_checksum_enabled
from vllm_kvchecksum.engine.worker import KVChecksumWorker

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger("vllm.kv_checksum")

# hf_config attributes that give some layers, or the global attention, their
# own KV head count: the model-wide count then does not describe every layer.
_SEPARATE_KV_HEAD_COUNTS = ("num_global_key_value_heads", "global_num_key_value_heads",
                            "num_key_value_heads_per_layer", "num_kv_heads_per_layer",
                            "swa_num_key_value_heads", "num_swa_key_value_heads")


def uniform_model_kv_heads(vllm_config: VllmConfig) -> int | None:
    """The model's KV head count when every attention layer has it, else None.

    It tells sharded from replicated heads when a rank holds one KV head:
    valid only with no per-layer override, no separate global count, and a
    draft model (if any) with the same count.
    """
    model_config = vllm_config.model_config
    arch = model_config.model_arch_config
    total = arch.total_num_kv_heads
    for override in arch.per_layer_overrides or ():
        if "total_num_kv_heads" in override:
            return None
    hf = model_config.hf_text_config
    if any(getattr(hf, name, None) is not None for name in _SEPARATE_KV_HEAD_COUNTS):
        return None
    spec = vllm_config.speculative_config
    draft = getattr(spec, "draft_model_config", None) if spec is not None else None
    if draft is not None and draft is not model_config:
        try:
            if draft.get_total_num_kv_heads() != total:
                return None
        except Exception:  # a draft without a readable head count: do not guess
            return None
    return total


def create_kv_checksum_worker(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                              kv_caches: dict[str, torch.Tensor]) -> KVChecksumWorker | None:
    """The worker's KVChecksumWorker, or None when KV checksums are off.

    Call once the KV cache is allocated and registered with the connector.
    Compiles the kernel for every layer shape before returning.
    """
    if not kv_checksum_enabled(vllm_config):
        return None
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    tp, pp = get_tp_group(), get_pp_group()
    worker = KVChecksumWorker(kv_cache_config, kv_caches, tp_rank=tp.rank_in_group, tp_size=tp.world_size,
                              pp_rank=pp.rank_in_group, pp_size=pp.world_size,
                              model_kv_heads=uniform_model_kv_heads(vllm_config))
    worker.warm_up()
    return worker


# checksum_step's `loaded` when the caller did not checksum the step's
# synchronous loads itself.
_NOT_YET = object()


def checksum_loaded(worker: KVChecksumWorker | None,
                    scheduled: KVChecksumScheduled | None) -> KVChecksumOutput | None:
    """Queue the checksums of the step's synchronous loads of offloaded KV.

    Call after the forward and BEFORE the connector's wait_for_save: a save
    in the same step may refill the entries of blocks a synchronous load
    wrote (another request can hit them in the prefix cache at once), and
    the entries must be read as the load left them. Pass the result to
    checksum_step as `loaded`. Takes the step's tainted blocks too, before
    that save fills their entries (export_guard.py).
    """
    if worker is not None and scheduled is not None and scheduled.tainted_blocks is not None:
        worker.tainted_blocks = scheduled.tainted_blocks
    if worker is None or scheduled is None or not scheduled.reqs_loaded:
        return None
    return worker.compute(scheduled.reqs_loaded, replica_zero_only=False, purpose=RecordPurpose.SYNC_LOAD)


def checksum_step(worker: KVChecksumWorker | None, scheduled: KVChecksumScheduled | None,
                  finished_recving: set[str] | None, *, sends: bool = True,
                  recvs: bool = True, received: dict[str, bytes] | None = None,
                  read_after_release=None, loaded=_NOT_YET) -> KVChecksumOutput | None:
    """Queue this step's checksums; call after the step's forward, once per
    scheduler output, in order (scheduled may be None: nothing new).

    sends: the producer requests whose prompt KV the step finished, and
      the re-checks of completed transfers (pass False when a drafter still
      writes KV; call again with recvs=False after it). recvs: update the worker's pending loads from `scheduled`
      and checksum those that this worker's connector reports finished in
      this step (`finished_recving`). Pass recvs=False on a second call for
      the same scheduler output, so its loads are not added again.
    received: the checksums this worker's connector delivered with its loads
      (KVConnectorTransferResults.kv_checksums; connector-owned carriers).
    read_after_release: producer requests whose KV this worker's connector
      says a consumer read after the blocks were released
      (KVConnectorTransferResults.kv_read_after_release).
    loaded: what checksum_loaded returned for this step, when the caller ran
      it before wait_for_save (the model runners do); by default the step's
      synchronous loads are checksummed here.
    """
    if worker is None:
        return None
    outputs = []
    if sends and scheduled is not None and scheduled.reqs_to_send:
        outputs.append(worker.compute(scheduled.reqs_to_send, replica_zero_only=True, purpose=RecordPurpose.SEND))
    if sends and scheduled is not None and scheduled.reqs_to_recheck:
        # Held blocks of finished requests: nothing in the step writes them.
        outputs.append(worker.compute(scheduled.reqs_to_recheck, replica_zero_only=True,
                                      purpose=RecordPurpose.RECHECK))
    if recvs:
        if loaded is _NOT_YET:
            loaded = checksum_loaded(worker, scheduled)
        outputs.append(_step_loads(worker, scheduled, finished_recving, received, loaded))
    outputs.append(worker.report_read_after_release(read_after_release))
    return KVChecksumOutput.aggregate(outputs)


def _step_loads(worker: KVChecksumWorker, scheduled: KVChecksumScheduled | None,
                finished_recving: set[str] | None, received: dict[str, bytes] | None,
                loaded_now: KVChecksumOutput | None) -> KVChecksumOutput | None:
    """Forget, then add, then checksum the finished loads.

    Forget before add: a request id in both had its old load dropped by the
    scheduler before its new one started. Add before checksumming: a load
    can finish in the step it starts.
    """
    if scheduled is not None:
        worker.forget_loads(scheduled.reqs_to_forget)
        worker.expect_loads(scheduled.reqs_to_recv)
    if not finished_recving and not received:
        return loaded_now
    return KVChecksumOutput.aggregate([loaded_now, worker.compute_finished_loads(finished_recving or (), received)])
