"""An instance that offloads KV to a host store and one that loads it back.

The sides are pd_harness's: real vLLM Schedulers and real KVChecksumWorkers
over CPU KV caches. The connector is HostOffloadConnector, a small real
KVConnectorBase_V1 (loaded through kv_connector_module_path) whose scheduler
half answers the vLLM Scheduler from a host store shared by the instances
(`STORE`): a prefix hit is the run of the request's block hashes found
there, loaded asynchronously. Its worker half is what the test does, as a
connector's worker would:
- `offload`: save_block_checksums for the request's full blocks (the
  checksum worker's contract), then copy each block's KV and its entry to
  the store, one value per (block hash, worker);
- `perform_loads`: copy the values of the loads the scheduler started into
  the loading instance's blocks and their entries into its checksum
  worker's tensor, before the load is reported finished.
A test corrupts the store between the two (`STORE` is plain host memory).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from pd_harness import Side, forward_of, layer_name, make_request, make_side
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               SupportsHMA)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from vllm_kvchecksum.engine.offload import BlockChecksumRun


@dataclass
class StoredValue:
    """One worker's copy of one block position: its KV per layer, and its
    entry per group (groups the worker keeps entries for)."""

    kv: dict[str, torch.Tensor] = field(default_factory=dict)
    entries: dict[int, int] = field(default_factory=dict)


# block hash -> worker index -> value; shared by every instance of a test.
STORE: dict[bytes, dict[int, StoredValue]] = {}


@pytest.fixture(autouse=True)
def empty_store():
    """An empty STORE for each test (a test module imports it to use it)."""
    STORE.clear()
    yield
    STORE.clear()


def corrupt_store_kv(hashes, position: int, worker: int = 0):
    """Flip one bit of the stored KV of block `position` (its first layer in sorted order)."""
    value = STORE[hashes[position]][worker]
    layer = sorted(value.kv)[0]
    value.kv[layer].view(torch.uint8)[0, 1, 2] ^= 0x08


@dataclass
class PendingLoad:
    block_ids: list[list[int]]  # per group
    first: int  # the first block position loaded
    num_blocks: int


class HostOffloadConnector(KVConnectorBase_V1, SupportsHMA):
    """The scheduler half of a host-store offloading connector (see module doc)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        self.pending_loads: dict[str, PendingLoad] = {}
        self.failures: list[tuple[str, dict]] = []
        self.sources = {CacheHitSource.HOST}
        # False: loads are synchronous (done in the step that schedules
        # them, before its forward: `perform_loads` in the step's forward).
        self.load_async = True
        self._local: dict[str, int] = {}

    # -- scheduler ---------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        start = num_computed_tokens // self.block_size
        # Leave the prompt's last token to compute.
        last = (request.num_prompt_tokens - 1) // self.block_size
        hits = 0
        while start + hits < min(last, len(request.block_hashes)) and request.block_hashes[start + hits] in STORE:
            hits += 1
        if not hits:
            return 0, False
        self._local[request.request_id] = num_computed_tokens
        return (start + hits) * self.block_size - num_computed_tokens, self.load_async

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        if num_external_tokens:
            first = self._local.pop(request.request_id, 0) // self.block_size
            self.pending_loads[request.request_id] = PendingLoad(
                [list(ids) for ids in blocks.get_block_ids()], first, num_external_tokens // self.block_size)

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()

    def can_carry_kv_checksums(self) -> bool:
        return True

    def get_kv_checksum_sources(self, request):
        return set(self.sources)

    def request_finished_all_groups(self, request, block_ids):
        return False, None

    def on_kv_checksum_failure(self, request, mismatches):
        # Drop what failed, as a store would.
        self.failures.append((request.request_id, {g: tuple(p) for g, p in mismatches.items()}))
        for positions in mismatches.values():
            for p in positions:
                STORE.pop(request.block_hashes[p], None)

    # -- worker (the test performs it) ---------------------------------------

    def start_load_kv(self, forward_context, **kwargs): pass
    def wait_for_layer_load(self, layer_name): pass
    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs): pass
    def wait_for_save(self): pass


MODULE = "offload_harness"


def host_connector(side: Side) -> HostOffloadConnector:
    """The side's HostOffloadConnector: its connector, or the first such child of its MultiConnector."""
    connector = side.scheduler.connector
    children = getattr(connector, "_connectors", [connector])
    return next(c for c in children if isinstance(c, HostOffloadConnector))


def make_offload_side(role: str = "kv_both", *, tp: int = 1, covered=(0,), multi: int = 0, **kw) -> Side:
    """A side with HostOffloadConnector; each worker keeps entries for `covered` groups.

    multi: wrap it in a MultiConnector, with that many more HostOffloadConnectors after it."""
    if multi:
        child = dict(kv_connector="HostOffloadConnector", kv_connector_module_path=MODULE, kv_role=role)
        side = make_side(role, tp, connector="MultiConnector", connector_extra={"connectors": [child] * (1 + multi)},
                         **kw)
    else:
        side = make_side(role, tp, connector="HostOffloadConnector", connector_module_path=MODULE, **kw)
    for w in side.workers:
        w.checksums.init_block_checksums(covered)
    return side


def offload(side: Side, request_id: str, *, block_hashes=None) -> list[bytes]:
    """Save the request's full prompt blocks' entries, then store its blocks.

    block_hashes: the hashes to store them under (default the request's own;
    a test passes others to store a value for another prefix)."""
    req = side.scheduler.requests[request_id]
    hashes = list(block_hashes or req.block_hashes)
    num_full = req.num_prompt_tokens // side.block_size
    for gid, (layers, _) in enumerate(side.groups):
        ids = side.scheduler.kv_cache_manager.get_block_ids(request_id)[gid][:num_full]
        run = BlockChecksumRun(gid, 0, ids, req.block_hashes[:num_full])
        for index, w in enumerate(side.workers):
            w.checksums.save_block_checksums([run])
            for pos, block_id in enumerate(ids):
                value = STORE.setdefault(hashes[pos], {}).setdefault(index, StoredValue())
                value.kv.update({layer_name(l): w.caches[layer_name(l)][block_id].clone()
                                 for l in layers if l in w.layers})
                if gid in w.checksums.offload_groups:
                    value.entries[gid] = int(w.checksums.block_checksums[block_id])
    return hashes[:num_full]


def store_prompt(side: Side, prompt: list[int], *, block_hashes=None) -> list[bytes]:
    """Compute a prompt on `side`, offload its full blocks, finish it; the hashes stored."""
    req = make_request(prompt, block_size=side.block_size, max_tokens=2)
    side.scheduler.add_request(req)
    forward = forward_of(side, req)
    stored = None
    for _ in range(8):
        side.step(forward=forward)
        if stored is None and req.num_computed_tokens >= req.num_prompt_tokens:
            stored = offload(side, req.request_id, block_hashes=block_hashes)
        if req.is_finished():
            return stored
    raise AssertionError("the storing request did not finish")


def perform_loads(side: Side) -> list[str]:
    """Copy the store's values into the blocks of the loads started; their ids."""
    connector = host_connector(side)
    done = []
    for req_id, load in connector.pending_loads.items():
        req = side.scheduler.requests[req_id]
        for gid, (layers, _) in enumerate(side.groups):
            for pos in range(load.first, load.first + load.num_blocks):
                block_id = load.block_ids[gid][pos]
                values = STORE.get(req.block_hashes[pos], {})
                for index, w in enumerate(side.workers):
                    value = values.get(index)
                    if value is None:
                        continue
                    for name, kv in value.kv.items():
                        if name in w.caches:
                            w.caches[name][block_id].copy_(kv)
                    if gid in value.entries:
                        w.checksums.block_checksums[block_id] = value.entries[gid]
        done.append(req_id)
    connector.pending_loads.clear()
    return done


@dataclass
class Loaded:
    request: object
    outputs: dict
    next_scheduled: int
    failures: list = field(default_factory=list)


def load_prompt(side: Side, prompt: list[int], *, tamper=None, max_tokens: int = 2) -> Loaded:
    """Load a prompt's KV back from the store on `side`: schedule, load, check, run."""
    req = make_request(prompt, block_size=side.block_size, max_tokens=max_tokens)
    side.scheduler.add_request(req)
    side.step()
    assert req.status.name == "WAITING_FOR_REMOTE_KVS", req.status
    done = perform_loads(side)
    if tamper is not None:
        tamper(req)
    _, outputs = side.step(finished_recving=set(done))
    out, _ = side.step(forward=forward_of(side, req))
    return Loaded(req, outputs, out.num_scheduled_tokens.get(req.request_id, 0), list(host_connector(side).failures))


def loading_forward(side: Side, req):
    """The forward of a step that loads synchronously: the connector's loads
    first (perform_loads), then what the step computes of `req`."""
    computed = forward_of(side, req)

    def forward(out):
        perform_loads(side)
        computed(out)

    return forward


def load_prompt_sync(side: Side, prompt: list[int], *, max_tokens: int = 2):
    """Load a prompt's KV synchronously: the step that schedules it loads it
    (before its forward) and uses it; the request, and that step's engine
    outputs and scheduler output."""
    host_connector(side).load_async = False
    req = make_request(prompt, block_size=side.block_size, max_tokens=max_tokens)
    side.scheduler.add_request(req)
    out, outputs = side.step(forward=loading_forward(side, req))
    return req, outputs, out
