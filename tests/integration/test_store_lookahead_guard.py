"""The two guards the series gained on vLLM 0.34.0's Mooncake store.

1. MooncakeStoreScheduler.register_finished_lookahead_save: 0.34's store saves
   the "lookahead" blocks of a request that has just finished (after its final
   block-hash update), when the request has already left the scheduler. That
   save is cut to the request's exportable tokens
   (vllm_kvchecksum.engine.export_guard.exportable_tokens: nothing from the
   first token that failed a KV checksum check on, nor from a load still
   waiting for its verdict), and nothing is pinned or queued when nothing is
   left. The per-step cut (_keep_failed_kv_out) never sees this save: it only
   cuts the saves of requests the store still knows as unfinished.
2. MooncakeStoreWorker._register_kv_checksums: only RankLocalStoreLayout
   appends each block's checksum entry to its value; any other store layout
   (TP-sharded keys, store_tp_size) is refused at startup with an error that
   names it and what to do, instead of storing values without entries.

The scheduler is made with object.__new__ and only the state the method reads
(as tests/integration/test_export_guard.py does for _keep_failed_kv_out); the
request, its block hashes, the tracker, the coordinator, the GPU block pool,
the store layouts and the KV checksum worker are vLLM's and the series' own
classes. The Mooncake store client is a stand-in (no mooncake_master here; the
whole store path runs in tests/e2e/test_mooncake_store.py). vLLM 0.32.0's
store has neither method: the module skips there.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

STORE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store"
scheduler_mod = pytest.importorskip(f"{STORE}.scheduler", reason="vLLM has no Mooncake store connector")
if not hasattr(scheduler_mod.MooncakeStoreScheduler, "register_finished_lookahead_save"):
    pytest.skip("this vLLM's Mooncake store saves no lookahead blocks at finish "
                "(MooncakeStoreScheduler.register_finished_lookahead_save is new in vLLM 0.34.0)",
                allow_module_level=True)

from pd_harness import layer_name  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from vllm_kvchecksum.engine.export_guard import hold_exports  # noqa: E402

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator import (  # noqa: E402
    MooncakeStoreCoordinator)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (  # noqa: E402
    ChunkedTokenDatabase, RequestTracker)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.layout import (  # noqa: E402
    HeadMajorStoreLayout, KeyMetadata, RankLocalStoreLayout)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import MooncakeStoreWorker  # noqa: E402

BS = 16  # block size = hash block size
LOOKAHEAD = 2  # num_hash_lookahead_tokens: each block's hash waits for 2 tokens past it
PROMPT = 6 * BS  # 96 tokens, 6 blocks
SAVED = 2 * BS  # what the request's earlier saves stored: its first 2 blocks
BLOCKS = [11, 12, 13, 14, 15, 16]  # the request's block table (one KV cache group)
FULL = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)


# -- guard 1: a finished request's lookahead save stops at its exportable tokens --

def _finished_request() -> Request:
    """A request whose 96-token prompt was computed and which finished after 2
    output tokens: its block hashes, with 2 lookahead tokens, now reach the
    prompt's end (the final hash update), so its 6th block became savable."""
    init_none_hash(sha256)
    prompt = [(i * 31) % 500 + 10 for i in range(PROMPT)]
    sp = SamplingParams(max_tokens=2)
    request = Request(request_id="r", prompt_token_ids=prompt, sampling_params=sp, pooling_params=None,
                      mm_features=None, block_hasher=get_request_block_hasher(BS, sha256, LOOKAHEAD))
    assert len(request.block_hashes) == (PROMPT - LOOKAHEAD) // BS == 5
    request.append_output_token_ids([7, 8])
    request.num_computed_tokens = PROMPT + 1  # the last output token is never computed
    assert len(request.block_hashes) == 6
    return request


def _store(request: Request):
    """MooncakeStoreScheduler, kv_both with lookahead hashes: only the state
    register_finished_lookahead_save (and the _trim_to_exportable and
    _reference_save_blocks it calls) reads. Returns (store, pool, calls), calls
    the lists of requests each _reference_save_blocks call got."""
    store = object.__new__(scheduler_mod.MooncakeStoreScheduler)
    store.kv_role, store.save_decode_cache, store.enable_kv_events = "kv_both", False, False
    store._block_size = store._hash_block_size = BS
    store._store_group_ids = [0]
    store._boundary_state_group_ids = frozenset()
    store._store_coord = MooncakeStoreCoordinator([KVCacheGroupSpec([layer_name(0)], FULL)], BS, BS,
                                                  num_hash_lookahead_tokens=LOOKAHEAD)
    store._gpu_block_pool = pool = BlockPool(num_gpu_blocks=32, enable_caching=True, hash_block_size=BS)
    store._num_workers, store._next_store_job_id, store._pinned_saves = 1, 0, {}
    store._unfinished_requests = {}  # finished: the store no longer knows it as running
    store._finished_lookahead_metas = {}
    store._request_trackers = {"r": RequestTracker(
        req_id="r", token_len=PROMPT, allocated_block_ids=(list(BLOCKS),), num_saved_tokens=SAVED,
        token_ids=list(request.all_token_ids[:PROMPT]), prefill_end_tokens=PROMPT)}
    calls = []
    real = store._reference_save_blocks

    def reference_save_blocks(requests):
        calls.append(list(requests))
        real(requests)

    store._reference_save_blocks = reference_save_blocks
    return store, pool, calls


@pytest.mark.parametrize("limit,held_from,saved", [
    (None, None, PROMPT),  # no limit: the save as built, the prompt's blocks 3 to 6
    (PROMPT, None, PROMPT),  # a limit at the save's end leaves it whole
    (4 * BS, None, 4 * BS),  # a limit on a block boundary: blocks from it on left out
    (4 * BS + 6, None, 4 * BS),  # a limit inside a block: that partial block is left out too
    (None, 3 * BS + 2, 3 * BS),  # exports held for a sync load's verdict: cut at the hold
    (5 * BS, 4 * BS + 1, 4 * BS),  # both: the lower one
])
def test_a_finished_requests_lookahead_save_stops_at_its_exportable_tokens(limit, held_from, saved):
    request = _finished_request()
    request.max_cached_tokens = limit
    if held_from is not None:
        hold_exports(request, held_from)
    store, pool, calls = _store(request)

    store.register_finished_lookahead_save(request, (list(BLOCKS),))

    req_meta = store._finished_lookahead_metas["r"]
    assert req_meta.can_save and req_meta.token_len_chunk == saved
    assert req_meta.token_ids_start == SAVED
    assert req_meta.token_ids == request.all_token_ids[SAVED:saved]  # what the workers key the puts by
    # A lookahead save publishes no partial tail and carries no boundary puts.
    assert not req_meta.publish_partial_tail and not req_meta.boundary_puts
    # Pinned: one store job holding a reference to each of the request's blocks.
    assert calls == [[req_meta]]
    assert store._pinned_saves == {req_meta.store_job_id: (BLOCKS, 1)}
    assert [pool.blocks[b].ref_cnt for b in BLOCKS] == [1] * len(BLOCKS)


@pytest.mark.parametrize("limit,held_from", [
    (0, None),  # its first block failed its check
    (BS - 1, None),  # no whole block before the limit
    (None, 0),  # the whole prompt was loaded synchronously, its verdict pending
])
def test_a_finished_request_with_nothing_exportable_saves_nothing(limit, held_from):
    request = _finished_request()
    request.max_cached_tokens = limit
    if held_from is not None:
        hold_exports(request, held_from)
    store, pool, calls = _store(request)
    free_before = pool.get_num_free_blocks()

    store.register_finished_lookahead_save(request, (list(BLOCKS),))

    assert store._finished_lookahead_metas == {}  # nothing queued for the next step's metadata
    assert calls == []  # _reference_save_blocks never called
    assert store._pinned_saves == {} and store._next_store_job_id == 0  # no store job
    assert [pool.blocks[b].ref_cnt for b in BLOCKS] == [0] * len(BLOCKS)  # no block pinned
    assert pool.get_num_free_blocks() == free_before


def test_the_per_step_cut_does_not_see_a_finished_requests_save():
    """Why the save is cut when registered: the next step's metadata build
    (_keep_failed_kv_out) only cuts saves of requests the store still knows as
    unfinished, and a finished request is gone by then."""
    request = _finished_request()
    store, _, _ = _store(request)
    store.register_finished_lookahead_save(request, (list(BLOCKS),))
    req_meta = store._finished_lookahead_metas["r"]
    request.max_cached_tokens = 0  # (were it tainted only now)
    store._keep_failed_kv_out(SimpleNamespace(requests=[req_meta]))
    assert req_meta.can_save and req_meta.token_len_chunk == PROMPT


# -- guard 2: the worker refuses a store layout that does not carry the entries --

class _Store:
    """Stand-in for the MooncakeDistributedStore client: register_buffer only."""

    def __init__(self):
        self.buffers = []

    def register_buffer(self, addr: int, nbytes: int) -> int:
        self.buffers.append((addr, nbytes))
        return 0


def _checksum_worker():
    from kv_setup import build_caches

    from vllm_kvchecksum.engine.worker import KVChecksumWorker

    config, caches = build_caches([KVCacheGroupSpec([layer_name(0)], FULL)], num_blocks=8)
    return config, KVChecksumWorker(config, caches, tp_rank=0, tp_size=1, model_kv_heads=2)


def _worker(*layouts):
    """MooncakeStoreWorker with KV checksums on: only what _register_kv_checksums reads."""
    config, checksums = _checksum_worker()
    worker = object.__new__(MooncakeStoreWorker)
    worker._kv_checksum_worker, worker._kv_cache_config, worker.store = checksums, config, _Store()
    worker.token_dbs = [ChunkedTokenDatabase(layout.metadata, BS, BS, store_layout=layout) for layout in layouts]
    return worker, checksums


def _rank_local(group_id: int = 0) -> RankLocalStoreLayout:
    return RankLocalStoreLayout(KeyMetadata("m", 0, 0, 0, 0, group_id), BS, BS)


def _tp_sharded(group_id: int = 0) -> HeadMajorStoreLayout:
    """A group's layout under store_tp_size=2 on a TP=1 instance (keys sharded over 2 store ranks)."""
    return HeadMajorStoreLayout(KeyMetadata("m", 0, 0, 0, 0, group_id, store_namespace="@store_tp:2"), BS, BS,
                                local_tp_size=1, store_tp_size=2, tp_rank=0, layer_specs=(FULL,))


def test_rank_local_layouts_get_the_checksum_entries():
    layouts = (_rank_local(0), _rank_local(1))
    worker, checksums = _worker(*layouts)
    worker._register_kv_checksums()
    entries = checksums.block_checksums
    assert entries is not None and entries.dtype == torch.int64 and entries.numel() == 8
    assert worker.store.buffers == [(entries.data_ptr(), entries.nbytes)]
    assert [layout.checksum_entry_addr for layout in layouts] == [entries.data_ptr()] * 2


@pytest.mark.parametrize("first_rank_local", [False, True])
def test_a_tp_sharded_layout_is_refused(first_rank_local):
    layouts = (_rank_local(0), _tp_sharded(1)) if first_rank_local else (_tp_sharded(0),)
    worker, _ = _worker(*layouts)
    with pytest.raises(RuntimeError) as failed:
        worker._register_kv_checksums()
    message = str(failed.value)
    assert "KV checksums need rank-local store keys, not HeadMajorStoreLayout" in message
    assert "enable_kv_checksum=false or drop store_tp_size" in message
    assert getattr(layouts[-1], "checksum_entry_addr", None) is None  # no entries handed to it
