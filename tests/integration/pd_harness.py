"""A producer and a consumer vLLM instance, minus the model, for checksum tests.

Each side is a real vLLM Scheduler (patched, with NixlConnector's scheduler
half) and one real KVChecksumWorker per (PP, TP) worker over CPU KV caches
from vLLM's allocate_kv_cache. What the test stands in for:
- the forward: the producer's prompt KV is written into its blocks from a
  deterministic per-(layer, head, token) content function;
- the transfer: the consumer's loaded blocks get the producer's KV, copied
  slice by slice from the producer's worker caches (any TP/PP on each side);
- the model runner: each step, every worker runs the real runner glue
  (checksum_step) and the real KVOutputAggregator merges their outputs.
The scheduler holds only the first worker's layers, as in vLLM.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import itertools
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch
from kv_setup import build_caches
from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                         VllmConfig)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from vllm_kvchecksum.engine.metrics import GAUGES
from vllm_kvchecksum.engine.runner import checksum_step
from vllm_kvchecksum.engine.worker import KVChecksumWorker

NUM_LAYERS = 4
NUM_HEADS = 4
HEAD_SIZE = 8
NUM_BLOCKS = 96
EOS = 7
_ids = itertools.count()
init_none_hash(sha256)


# The connectors the verified-loads cases run with, by mode. Pull carries the
# checksums in kv_transfer_params; the others in their own messages
# (KVChecksumCarrier.CONNECTOR).
CONNECTORS = {"pull": "NixlConnector", "push": "NixlPushConnector", "mooncake": "MooncakeConnector"}


def mode_of(side: Side) -> str:
    """The side's CONNECTORS mode; a wrapper (MultiConnector, the fault
    connector) has its first wrapped connector's."""
    kv = side.scheduler.vllm_config.kv_transfer_config
    name = kv.kv_connector
    wrapped = (kv.kv_connector_extra_config or {}).get("connectors")
    if wrapped:
        name = wrapped[0]["kv_connector"]
    return next(mode for mode, connector in CONNECTORS.items() if connector == name)


def connector_carried(producer: Side, out, request_id: str) -> bytes | None:
    """The checksums the producer's scheduler ships for a finished request
    in its connector metadata (connector-owned carriers), or None."""
    meta = out.kv_connector_metadata
    if mode_of(producer) == "push":
        return meta.push_finished_kv_checksums.get(request_id)
    if mode_of(producer) == "mooncake":
        return meta.kv_checksums.get(request_id)
    raise AssertionError(f"{mode_of(producer)} carries no checksums in its metadata")


def scheduler_connector(kind: str = "NixlConnector", **extra):
    """A real connector of `kind`, scheduler role (extra: its extra config)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    config = make_config("kv_both", 1, 1, 16, connector=kind, connector_extra=extra or None)
    return KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER,
                                               KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[]))


def carrier_request(**params):
    """What kv_checksum_carrier reads of a request: its id and kv_transfer_params."""
    from types import SimpleNamespace

    return SimpleNamespace(request_id="r", kv_transfer_params=params or None)


def series_lacks(mode: str) -> str | None:
    """Why `mode`'s cases cannot run, or None.

    Only under `make check-series` (KVCS_VLLM_TREE set), which runs these
    tests on every prefix of the series: before the patch that gives a
    connector its carrier, its cases are skipped there. Anywhere else they
    always run, so a lost carrier fails them.
    """
    import os

    if mode == "pull" or not os.environ.get("KVCS_VLLM_TREE"):
        return None
    if scheduler_connector(CONNECTORS[mode]).can_carry_kv_checksums():
        return None
    return f"{CONNECTORS[mode]} carries no KV checksums at this prefix of the series"


def carrier_maker(mode: str, maker=None):
    """The side factory (default make_side) for a carrier mode's cases
    (the `make` fixtures): skipped where series_lacks says so."""
    if (reason := series_lacks(mode)) is not None:
        pytest.skip(reason)
    return functools.partial(maker or make_side, connector=CONNECTORS[mode])


def series_lacks_first_bad_block_rollback() -> bool:
    """Only under `make check-series`: whether this prefix of the series is
    before the patch that recomputes a failed load from its first bad block
    (before it, vLLM recomputes the whole prompt). Anywhere else False."""
    import os

    return bool(os.environ.get("KVCS_VLLM_TREE")) and "max_cached_tokens" not in inspect.getsource(Request.__init__)


def series_lacks_producer_tp_size() -> bool:
    """Only under `make check-series`: whether this prefix of the series is
    before the patch that lets connectors say the producer's TP size.
    Anywhere else False, so a lost hook fails the tests that need it."""
    import os

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    return bool(os.environ.get("KVCS_VLLM_TREE")) and not hasattr(KVConnectorBase_V1,
                                                                 "get_kv_checksum_producer_tp_size")


def layer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def content(layer: int, head: int, token: int, cell_bytes: int) -> torch.Tensor:
    """The KV bytes of one token of one head of one layer (what a forward writes)."""
    gen = torch.Generator().manual_seed(((layer * 977 + head) * 100_003 + token) % (2**63))
    return torch.randint(0, 256, (cell_bytes,), dtype=torch.uint8, generator=gen)


@dataclass
class Worker:
    pp_rank: int
    tp_rank: int
    layers: list[int]
    first_head: int
    caches: dict[str, torch.Tensor]
    checksums: KVChecksumWorker


@dataclass
class Side:
    """One instance: scheduler + workers."""

    scheduler: Scheduler
    workers: list[Worker]
    block_size: int
    groups: list[tuple[list[int], object]]  # (layer numbers, spec) per group
    aggregator: KVOutputAggregator = field(default=None)
    # Sum of the kv_checksum_stats of every SchedulerStats the steps returned
    # (their counts), and the last value of each gauge reported.
    reported_metrics: Counter = field(default_factory=Counter)
    reported_gauges: dict = field(default_factory=dict)

    def __post_init__(self):
        self.aggregator = KVOutputAggregator(len(self.workers))

    # -- what the model and the connector would do -------------------------

    def cell_bytes(self) -> int:
        return 2 * HEAD_SIZE * 2  # K and V, bf16

    def write_tokens(self, request_id: str, first_token: int, end_token: int,
                     source: Side | None = None, source_id: str | None = None,
                     workers=None) -> None:
        """Write the KV of tokens [first_token, end_token) into the request's blocks.

        From the content function (a forward), or copied from `source`'s
        blocks of request `source_id` (a transfer). The slots after
        end_token in its block get junk, which must not matter. workers:
        only these workers' caches (default: all).
        """
        for gid, (layers, _) in enumerate(self.groups):
            ids = self.scheduler.kv_cache_manager.get_block_ids(request_id)[gid]
            src_ids = source.scheduler.kv_cache_manager.get_block_ids(source_id)[gid] if source else None
            for w in self.workers if workers is None else workers:
                for layer in layers:
                    if layer not in w.layers:
                        continue
                    cache = w.caches[layer_name(layer)]
                    for t in range(first_token, end_token):
                        pos, slot = divmod(t, self.block_size)
                        if ids[pos] == 0:
                            continue
                        for h in range(cache.shape[1]):
                            g_head = w.first_head + h
                            data = (source.read(layer, g_head, t, src_ids) if source
                                    else content(layer, g_head, t, self.cell_bytes()))
                            cache[ids[pos], h, slot].view(torch.uint8).copy_(data)
                    pos, slot = divmod(end_token, self.block_size)
                    if slot and pos < len(ids) and ids[pos]:
                        cache[ids[pos], :, slot:].view(torch.uint8).fill_(0x5A)

    def read(self, layer: int, head: int, token: int, block_ids) -> torch.Tensor:
        pos, slot = divmod(token, self.block_size)
        for w in self.workers:
            if layer in w.layers:
                cache = w.caches[layer_name(layer)]
                local = head - w.first_head
                if 0 <= local < cache.shape[1]:
                    return cache[block_ids[pos], local, slot].view(torch.uint8).clone()
        raise AssertionError(f"no worker holds layer {layer} head {head}")

    def corrupt(self, request_id: str, group: int = 0, position: int = 0, worker: int = -1) -> None:
        """Flip one bit of one loaded block on one worker."""
        ids = self.scheduler.kv_cache_manager.get_block_ids(request_id)[group]
        w = self.workers[worker]
        layer = next(l for l in self.groups[group][0] if l in w.layers)
        w.caches[layer_name(layer)][ids[position], 0, 0].view(torch.uint8)[3] ^= 0x10

    # -- one engine step ---------------------------------------------------

    def step(self, finished_recving=frozenset(), forward=None, *, failed_recving=frozenset(), finished_on=None,
             received=None, finished_sending=frozenset(), read_after_release=None):
        """One engine step: schedule, `forward(scheduler_output)` writes the
        step's KV, every worker checksums and reports, the scheduler updates.

        finished_recving: the loads every worker's connector reports finished;
        finished_on: instead, worker index -> the loads that worker reports.
        failed_recving: of those, the ones the connector reports failed.
        received: the checksums every worker's connector delivers (by
        request id; connector-owned carriers). finished_sending: the
        producer requests whose transfer every worker's connector reports
        complete. read_after_release: worker index -> the producer requests
        that worker's connector reports read after it released them."""
        out = self.scheduler.schedule()
        if forward is not None:
            forward(out)
        merged = self.run_workers(out, finished_recving, failed_recving=failed_recving, finished_on=finished_on,
                                  received=received, finished_sending=finished_sending,
                                  read_after_release=read_after_release)
        return out, self.update(out, merged)

    def run_workers(self, out, finished_recving=frozenset(), *, failed_recving=frozenset(), finished_on=None,
                    received=None, finished_sending=frozenset(), read_after_release=None):
        """The workers' half of a step for scheduler output `out` (see step):
        their outputs, merged by the real KVOutputAggregator."""
        runner_outputs = []
        for i, w in enumerate(self.workers):
            done = set(finished_on.get(i, ())) if finished_on is not None else set(finished_recving)
            late = (read_after_release or {}).get(i)
            if late:  # (the argument comes with the read-after-release patch of the series)
                checksums = checksum_step(w.checksums, out.kv_checksum_scheduled, done, received=received,
                                          read_after_release=late)
            else:
                checksums = checksum_step(w.checksums, out.kv_checksum_scheduled, done, received=received)
            kv_out = KVConnectorOutput(finished_recving=done or None, failed_recving=set(failed_recving) & done,
                                       finished_sending=set(finished_sending) or None, kv_checksums=checksums)
            runner_outputs.append(self.runner_output(out, kv_out))
        return self.aggregator.aggregate(runner_outputs, 0)

    def runner_output(self, out, kv_connector_output) -> ModelRunnerOutput:
        """One worker's output for scheduler output `out`, as a forward gives it."""
        reqs = list(out.num_scheduled_tokens)
        return model_runner_output(reqs, self.sampled_tokens(reqs), kv_connector_output)

    def sampled_tokens(self, req_ids) -> list[list[int]]:
        """A token for each request whose prompt is done; none for a partial prefill."""
        return [[11] if self._prompt_done(r) else [] for r in req_ids]

    def _prompt_done(self, request_id: str) -> bool:
        request = self.scheduler.requests.get(request_id)
        return request is None or request.num_computed_tokens >= request.num_prompt_tokens

    def update(self, out, merged) -> dict:
        """The scheduler's update from the workers' merged output; the engine
        outputs by request id."""
        engine_outputs = self.scheduler.update_from_output(out, merged)
        for eco in engine_outputs.values():
            # The KV checksum counts the step reports to vLLM's stat loggers.
            # (getattr: the series' prefixes before the metrics patch lack the field.)
            counts = getattr(eco.scheduler_stats, "kv_checksum_stats", None)
            if counts:
                # Gauges are the state now (the last value counts); the rest add up.
                gauges = {k: v for k, v in counts.items() if k in GAUGE_KEYS}
                self.reported_gauges.update(gauges)
                self.reported_metrics.update({k: v for k, v in counts.items() if k not in gauges})
        return {o.request_id: o for eco in engine_outputs.values() for o in eco.outputs}


GAUGE_KEYS = frozenset(GAUGES)


def stats(side: Side) -> dict:
    """The side's checksum counters (verified, mismatch, sent, ...)."""
    return dict(side.scheduler.kv_checksum.stats)


def make_config(role: str, tp: int, pp: int, block_size: int, *, enable: bool = True, fail_closed: bool = False,
                policy: str = "fail", connector: str = "NixlConnector",
                connector_extra: dict | None = None, connector_module_path: str | None = None,
                max_num_batched_tokens: int = 2048, producer_recheck: bool = False) -> VllmConfig:
    """A real VllmConfig of one side. connector_extra with "connectors" makes
    it a MultiConnector, unless connector_module_path names another wrapper.
    producer_recheck: kv_checksum_producer_recheck (passed only when set:
    the series' prefixes before it lack the key)."""
    if connector_module_path is None and (connector == "MultiConnector" or (connector_extra or {}).get("connectors")):
        connector = "MultiConnector"
    model_config = ModelConfig(model="facebook/opt-125m", dtype="bfloat16", seed=0, max_model_len=2048)
    kv = KVTransferConfig(kv_connector=connector, kv_connector_module_path=connector_module_path, kv_role=role,
                          kv_buffer_device="cpu", enable_kv_checksum=enable, kv_checksum_fail_closed=fail_closed,
                          kv_load_failure_policy=policy, kv_connector_extra_config=connector_extra or {},
                          **({"kv_checksum_producer_recheck": True} if producer_recheck else {}))
    return settle_layout(VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens,
                                         max_model_len=2048,
                                         enable_chunked_prefill=True, is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
        parallel_config=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                       distributed_executor_backend="mp"),
        kv_transfer_config=kv, device_config=DeviceConfig("cpu")))


def make_side(role: str, tp: int = 1, pp: int = 1, block_size: int = 16, *, sliding_window: int | None = None,
              merged_sliding_window: int | None = None, heads: int = NUM_HEADS, batch_queue: bool = False,
              **config_kw) -> Side:
    """One instance. sliding_window: layers 1 and 3 form a SlidingWindowSpec
    group (the hybrid KV cache manager). merged_sliding_window: the hybrid
    manager is off, so vLLM merges every layer into one FullAttentionSpec
    group carrying that sliding_window (Gemma-2 style with
    --disable-hybrid-kv-cache-manager). batch_queue: vLLM's AsyncScheduler,
    the one its engine runs with async scheduling (the default), so a test
    can schedule step N+1 before step N's update as the batch queue does."""
    vllm_config = make_config(role, tp, pp, block_size, **config_kw)
    groups = [(list(range(NUM_LAYERS)) if sliding_window is None else [0, 2], None)]
    if sliding_window is not None:
        groups.append(([1, 3], sliding_window))
    if merged_sliding_window is not None:
        vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = True
    stage_layers = [list(range(NUM_LAYERS))[s * NUM_LAYERS // pp:(s + 1) * NUM_LAYERS // pp] for s in range(pp)]
    local_heads = max(1, heads // tp)

    def spec(window):
        if window is None:
            return FullAttentionSpec(block_size=block_size, num_kv_heads=local_heads, head_size=HEAD_SIZE,
                                     dtype=torch.bfloat16, sliding_window=merged_sliding_window)
        return SlidingWindowSpec(block_size=block_size, num_kv_heads=local_heads, head_size=HEAD_SIZE,
                                 dtype=torch.bfloat16, sliding_window=window)

    workers = []
    for p, t in itertools.product(range(pp), range(tp)):
        kv_groups = [KVCacheGroupSpec([layer_name(l) for l in layers if l in stage_layers[p]], spec(window))
                     for layers, window in groups]
        config, caches = build_caches(kv_groups, NUM_BLOCKS, seed=p * 10 + t)
        replicas = max(1, tp // heads)
        first_head = (t // replicas) * local_heads
        checksums = KVChecksumWorker(config, caches, tp_rank=t, tp_size=tp, pp_rank=p, pp_size=pp,
                                     model_kv_heads=heads)
        workers.append(Worker(p, t, stage_layers[p], first_head, caches, checksums))
    # The scheduler's config lists the first worker's layers only.
    sched_groups = [KVCacheGroupSpec([layer_name(l) for l in layers if l in stage_layers[0]], spec(window))
                    for layers, window in groups]
    sched_config = settle_hash_block_size(
        KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=sched_groups), vllm_config)
    vllm_config.cache_config.num_gpu_blocks = NUM_BLOCKS
    if batch_queue:
        vllm_config.scheduler_config.async_scheduling = True
    scheduler_cls = AsyncScheduler if batch_queue else Scheduler
    scheduler = scheduler_cls(vllm_config=vllm_config, kv_cache_config=sched_config, log_stats=True,
                              structured_output_manager=StructuredOutputManager(vllm_config), block_size=block_size)
    side = Side(scheduler, workers, block_size, [(layers, w) for layers, w in groups])
    side.remote_ids = {}
    return side


def with_block_hole(side: Side, monkeypatch) -> None:
    """Give the side's second KV cache group a null block after a real one
    (position 3 of requests with 5 or more blocks), as a block table can
    show mid-window: the block rule leaves that group out on both sides."""
    real = side.scheduler.kv_cache_manager.get_block_ids

    def get_block_ids(request_id):
        ids = real(request_id)
        if len(ids[1]) >= 5:
            ids = (ids[0], ids[1][:3] + [0] + ids[1][4:])
        return ids

    monkeypatch.setattr(side.scheduler.kv_cache_manager, "get_block_ids", get_block_ids)


def make_request(prompt: list[int], *, remote_decode: bool = False, params: dict | None = None,
                 block_size: int = 16, max_tokens: int = 4) -> Request:
    n = next(_ids)
    sp = SamplingParams(max_tokens=1 if remote_decode else max_tokens)
    sp.update_from_generation_config({}, EOS)
    req = Request(request_id=f"req-{n}", prompt_token_ids=list(prompt), sampling_params=sp, pooling_params=None,
                  mm_features=None, block_hasher=get_request_block_hasher(block_size, sha256))
    req.kv_transfer_params = dict(do_remote_decode=True, do_remote_prefill=False) if remote_decode else params
    return req


def prompt_of(num_tokens: int, seed: int = 0) -> list[int]:
    return [(i * 31 + seed * 7) % 500 + 10 for i in range(num_tokens)]


def forward_of(side: Side, req: Request):
    """What the step's forward writes for `req`: the KV of its scheduled tokens
    (forward(out, workers=...) writes only those workers' caches)."""

    def forward(out, workers=None):
        if req.request_id in out.num_scheduled_tokens:
            end = req.num_computed_tokens
            side.write_tokens(req.request_id, end - out.num_scheduled_tokens[req.request_id], end,
                              **({} if workers is None else {"workers": workers}))

    return forward


def run_local(side: Side, prompt: list[int]) -> Request:
    """A request computed locally to its end (e.g. to seed a prefix-cache hit)."""
    req = make_request(prompt, block_size=side.block_size, max_tokens=1)
    side.scheduler.add_request(req)
    forward = forward_of(side, req)
    for _ in range(8):
        side.step(forward=forward)
        if req.is_finished():
            return req
    raise AssertionError("the local request did not finish")


def prefill(producer: Side, prompt: list[int]) -> tuple[Request, dict]:
    """A producer request run to its end; returns it and its kv_transfer_params.

    With a connector-owned carrier the params hold no checksums: the
    producer's scheduler ships them in the next step's connector metadata.
    That step runs here, and its checksums (bytes) are put under
    "kv_checksums" in the returned params, where `load` takes them to hand
    to the consumer's workers as their connector would: a test drops or
    changes them the same way in every mode.
    """
    mode = mode_of(producer)
    req = make_request(prompt, remote_decode=True, block_size=producer.block_size)
    if mode == "mooncake":
        # The router's transfer id, on both legs.
        req.kv_transfer_params["transfer_id"] = f"xfer-{req.request_id}"
    producer.scheduler.add_request(req)
    forward = forward_of(producer, req)
    for _ in range(8):
        _, outputs = producer.step(forward=forward)
        if mode == "mooncake" and req.request_id in outputs and req.is_finished():
            # Mooncake returns no params: the consumer's come from the
            # router, sent at the same time as the producer's.
            assert outputs[req.request_id].kv_transfer_params is None
            outputs[req.request_id].kv_transfer_params = dict(
                do_remote_prefill=True, do_remote_decode=False,
                remote_engine_id=producer.scheduler.vllm_config.kv_transfer_config.engine_id,
                remote_bootstrap_addr="http://127.0.0.1:9", transfer_id=req.kv_transfer_params["transfer_id"])
        if req.request_id in outputs and outputs[req.request_id].kv_transfer_params is not None:
            params = dict(outputs[req.request_id].kv_transfer_params)
            if mode != "pull":
                assert "kv_checksums" not in params
                out, _ = producer.step()
                carried = connector_carried(producer, out, req.request_id)
                if carried is not None:
                    params["kv_checksums"] = carried
            return req, params
    raise AssertionError("the producer request did not finish with kv_transfer_params")


@dataclass
class LoadResult:
    request: Request
    outputs: dict            # engine outputs of the step that verified the load
    next_scheduled: int      # tokens scheduled for the request in the step after (0: not scheduled)
    num_local: int


def load(consumer: Side, producer: Side, producer_req: Request, params: dict, *,
         tamper=None, num_local: int = 0, prompt: list[int] | None = None) -> LoadResult:
    """The consumer loads a producer request's KV: schedule, transfer, verify, run.

    num_local: the consumer's local prefix-cache hit, in tokens (what the
    transfer does not write). prompt: the consumer request's prompt, when
    the producer's was truncated (a hybrid model's producer stops one token
    short); default the producer request's. With a connector-owned carrier, the checksums
    under params["kv_checksums"] (see prefill) reach every consumer worker
    with the finished load, as its connector reports them."""
    params = dict(params)
    received = None
    if mode_of(consumer) != "pull":
        carried = params.pop("kv_checksums", None)
        received = None if carried is None else {}
    req = make_request(prompt or producer_req.prompt_token_ids, params=params, block_size=consumer.block_size)
    if received is not None:
        received[req.request_id] = carried
    consumer.scheduler.add_request(req)
    out, _ = consumer.step()
    assert req.status.name == "WAITING_FOR_REMOTE_KVS", req.status
    consumer.write_tokens(req.request_id, num_local, req.num_computed_tokens, source=producer,
                          source_id=producer_req.request_id)
    if tamper is not None:
        tamper(req)
    _, outputs = consumer.step(finished_recving={req.request_id}, received=received)
    out, _ = consumer.step()
    return LoadResult(req, outputs, out.num_scheduled_tokens.get(req.request_id, 0), num_local)


# -- the model runners' own KV connector paths --------------------------------

class ReportingConnector:
    """The worker half of a connector whose transfers the test performs.

    Only for the runner tests: the model runner code under test (V1's KV
    connector mixin, V2's ActiveKVConnector) calls the connector's worker
    API; this one reports the loads the test says finished. Built on
    KVConnectorBase_V1 so the runners see a real connector type.
    """

    def __new__(cls, vllm_config, kv_cache_config):
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorRole,
                                                                       KVConnectorTransferResults)

        class _Reporting(KVConnectorBase_V1):
            finished: set[str] = set()
            received: dict[str, bytes] = {}
            read_after_release: set[str] = set()

            def start_load_kv(self, forward_context, **kwargs): pass
            def wait_for_layer_load(self, layer_name): pass
            def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs): pass
            def wait_for_save(self): pass
            def get_num_new_matched_tokens(self, request, num_computed_tokens): return 0, False
            def update_state_after_alloc(self, request, blocks, num_external_tokens): pass
            def build_connector_meta(self, scheduler_output): return None

            def get_transfer_results(self, finished_req_ids):
                done, self.finished = self.finished, set()
                received, self.received = self.received, {}
                results = KVConnectorTransferResults(finished_recving=done)
                if received:  # (the field comes with the NIXL push patch of the series)
                    results.kv_checksums = received
                late, self.read_after_release = self.read_after_release, set()
                if late:  # (and this one with the read-after-release patch)
                    results.kv_read_after_release = late
                return results

        return _Reporting(vllm_config, KVConnectorRole.WORKER, kv_cache_config)


def model_runner_output(req_ids: list[str], sampled_token_ids, kv_connector_output=None) -> ModelRunnerOutput:
    """A ModelRunnerOutput of these requests, on this vLLM's fields (0.34
    dropped req_id_to_index)."""
    kwargs = dict(req_ids=req_ids, sampled_token_ids=sampled_token_ids, logprobs=None,
                  prompt_logprobs_dict={}, pooler_output=None, kv_connector_output=kv_connector_output)
    if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:
        kwargs["req_id_to_index"] = {r: j for j, r in enumerate(req_ids)}
    return ModelRunnerOutput(**kwargs)


def settle_layout(vllm_config: VllmConfig) -> VllmConfig:
    """The KV cache layout, as vLLM 0.34's engine core resolves it before
    any connector is built (these caches are block-first: LBNHC, the old
    NHD); 0.32 has no such field to settle."""
    cache = vllm_config.cache_config
    if hasattr(cache, "kv_cache_layout") and cache.kv_cache_layout is None:
        cache.kv_cache_layout = "LBNHC"
    return vllm_config


def settle_hash_block_size(kv_cache_config: KVCacheConfig, vllm_config: VllmConfig) -> KVCacheConfig:
    """hash_block_size, as vLLM 0.34's engine core sets it on every
    KVCacheConfig (resolve_kv_cache_block_sizes); 0.32 has no such field."""
    if getattr(kv_cache_config, "hash_block_size", 0) is None:
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        kv_cache_config.hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)[1]
    return kv_cache_config


def _has_model_runner_v1() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm.v1.worker.kv_connector_model_runner_mixin") is not None


# The model runners whose KV connector path this vLLM has: "v1"
# (KVConnectorModelRunnerMixin, gone in vLLM 0.34) and "v2" (ActiveKVConnector).
MODEL_RUNNERS = ("v1", "v2") if _has_model_runner_v1() else ("v2",)
# The one tests use when the runner is not what they test.
DEFAULT_RUNNER = MODEL_RUNNERS[0]


def _active_kv_connector(vllm_config, caches, *, registered: bool):
    """Model Runner V2's ActiveKVConnector over the current KV connector.

    It registers `caches` with the connector, as a runner does once at
    start-up; registered: the caller's connector holds its caches already
    (registered once by the test, as at start-up), so not again."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

    if not registered:
        return ActiveKVConnector(vllm_config, caches)
    conn = get_kv_transfer_group()
    own = conn.__dict__.get("register_kv_caches")
    conn.register_kv_caches = lambda *_: None
    try:
        return ActiveKVConnector(vllm_config, caches)
    finally:
        if own is None:
            del conn.register_kv_caches
        else:
            conn.register_kv_caches = own


def runner_step(side: Side, runner: str, finished_recving=frozenset(), *, connector=None, received=None,
                read_after_release=frozenset()):
    """Like Side.step, with each worker's output made by a model runner's own
    connector path without a forward: "v1" (KVConnectorModelRunnerMixin,
    also the CPU backend's) or "v2" (ActiveKVConnector).

    connector: the workers' KV connector, used as it is; by default a
    ReportingConnector per worker that reports `finished_recving` (and the
    checksums `received`, as a connector-owned carrier delivers them)."""
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector
    if runner == "v1":
        from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

    out = side.scheduler.schedule()
    runner_outputs = []
    for w in side.workers:
        worker_connector = connector
        if worker_connector is None:
            worker_connector = ReportingConnector(side.scheduler.vllm_config, side.scheduler.kv_cache_config)
            worker_connector.finished = set(finished_recving)
            worker_connector.received = dict(received or {})
            worker_connector.read_after_release = set(read_after_release)
        kv_transfer_state._KV_CONNECTOR_AGENT = worker_connector
        try:
            if runner == "v1":
                result = KVConnectorModelRunnerMixin.kv_connector_no_forward(
                    out, side.scheduler.vllm_config, w.checksums)
            else:
                active = _active_kv_connector(side.scheduler.vllm_config, w.caches,
                                              registered=connector is not None)
                active.kv_checksum_worker = w.checksums
                result = active.no_forward(out)
        finally:
            kv_transfer_state._KV_CONNECTOR_AGENT = None
        # Requests the step runs get a sampled token, as a forward would give
        # (on a copy: an empty result is vLLM's shared EMPTY_MODEL_RUNNER_OUTPUT).
        result = copy.copy(result)
        reqs = list(out.num_scheduled_tokens)
        result.req_ids = reqs
        if hasattr(result, "req_id_to_index"):  # vLLM 0.32; 0.34 looks requests up by req_ids
            result.req_id_to_index = {r: i for i, r in enumerate(reqs)}
        result.sampled_token_ids = side.sampled_tokens(reqs)
        runner_outputs.append(result)
    merged = side.aggregator.aggregate(runner_outputs, 0)
    return out, side.update(out, merged)
