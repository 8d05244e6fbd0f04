"""MooncakeStoreConnector's KV checksum parts, piece by piece (the whole runs in
tests/e2e/test_mooncake_store.py on real engines and a real mooncake_master).

- when the store checks its loads, and the startup reason when it does not;
- the 8-byte entry region appended to every value's regions;
- which blocks' entries a save fills (every position the send thread may
  put, each once per block it holds).
"""

from __future__ import annotations

import logging

import pytest
import torch
from log_capture import capture_logger
from pd_harness import make_config
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor,
                                        SlidingWindowSpec)

from vllm_kvchecksum.engine.offload import BlockChecksumRun

kv_checksums = pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.kv_checksums",
    reason="the Mooncake store patch of the series is not applied")


def _config(**extra):
    return make_config("kv_both", 1, 1, 16, connector="MooncakeStoreConnector", connector_extra=extra or None)


def _kv_cache_config(*specs) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec([f"model.layers.{i}.attn"], s) for i, s in enumerate(specs)])


FULL = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
SWA = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16, sliding_window=32)


def test_full_attention_rank_local_keys_are_checked(caplog):
    with capture_logger(caplog, "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.kv_checksums"):
        assert kv_checksums.store_kv_checksums_enabled(_config(), _kv_cache_config(FULL), 16, log=True)
    assert "every load from the store is checked" in caplog.text


@pytest.mark.parametrize("extra,specs,hash_block_size,reason", [
    ({"store_tp_size": 2}, (FULL,), 16, "keys are TP-sharded"),
    ({"enable_store_tp_lcm": True}, (FULL,), 16, "keys are TP-sharded"),
    ({"custom_mem_pool": "NVLINK"}, (FULL,), 16, "custom_mem_pool"),
    ({}, (FULL, SWA), 16, "KV cache group 1 is SlidingWindowSpec, not full attention"),
    ({}, (FULL,), 8, "a key must hold one whole block"),
])
def test_other_setups_say_at_startup_that_loads_are_not_checked(extra, specs, hash_block_size, reason, caplog):
    config = _config(**extra)
    with capture_logger(caplog, "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.kv_checksums"):
        assert not kv_checksums.store_kv_checksums_enabled(config, _kv_cache_config(*specs), hash_block_size,
                                                           log=True)
    record = next(r for r in caplog.records if r.levelno == logging.WARNING and "Mooncake" in r.getMessage())
    assert "loads from the Mooncake store are NOT checked" in record.getMessage()
    assert reason in record.getMessage()


def test_checksums_off_means_no_entries():
    config = _config()
    config.kv_transfer_config.enable_kv_checksum = False
    assert not kv_checksums.store_kv_checksums_enabled(config, _kv_cache_config(FULL), 16)


def test_every_value_carries_its_blocks_entry_as_one_more_region():
    try:  # vLLM 0.34 moved the store layouts to store/layout.py
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.layout import (KeyMetadata,
                                                                                        RankLocalStoreLayout)
    except ImportError:
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (KeyMetadata,
                                                                                      RankLocalStoreLayout)

    layout = RankLocalStoreLayout(KeyMetadata("m", 0, 0, 0, 0), block_size=16, hash_block_size=16)
    layout.set_kv_caches_base_addr([1000, 50_000])
    layout.set_block_len([100, 100])
    addrs, sizes, bids = layout.prepare_values([(0, 16), (32, 48)], [7, 3, 5], [0, 0])
    plain = (addrs, sizes)
    assert plain == ([[1700, 50_700], [1500, 50_500]], [[100, 100], [100, 100]])
    layout.checksum_entry_addr = 9000
    addrs, sizes, bids = layout.prepare_values([(0, 16), (32, 48)], [7, 3, 5], [0, 0])
    assert bids == [7, 5]
    assert addrs == [a + [9000 + 8 * b] for a, b in zip(plain[0], bids)]
    assert sizes == [s + [8] for s in plain[1]]
    if hasattr(layout, "prepare_value_for_block"):  # vLLM 0.32 only
        assert layout.prepare_value_for_block(3) == ([1300, 50_300, 9024], [100, 100, 8])


def test_saves_fill_each_position_once_per_block_it_holds():
    runs = kv_checksums.SaveRuns([0, 2], block_size=16)
    hashes = [bytes([i]) * 32 for i in range(6)]
    # The first save of a request covers it from position 0 (the send
    # thread puts every block the store lacks, local prefix hits included).
    first = runs.runs("r", ([10, 11, 12, 13], [20, 21, 22, 23]), hashes, 3 * 16 + 5)
    assert first == [BlockChecksumRun(0, 0, [10, 11, 12], hashes[:3]),
                     BlockChecksumRun(2, 0, [20, 21, 22], hashes[:3])]
    # Later saves: only the new full blocks.
    assert runs.runs("r", ([10, 11, 12, 13, 14], [20, 21, 22, 23, 24]), hashes, 5 * 16) == [
        BlockChecksumRun(0, 3, [13, 14], hashes[3:5]), BlockChecksumRun(2, 3, [23, 24], hashes[3:5])]
    assert runs.runs("r", ([10, 11, 12, 13, 14], [20, 21, 22, 23, 24]), hashes, 5 * 16) == []
    # A position whose block changed (e.g. recomputed after a preemption) is filled again, from there.
    assert runs.runs("r", ([10, 91, 12, 13, 14], [20, 21, 22, 23, 24]), hashes, 5 * 16) == [
        BlockChecksumRun(0, 1, [91, 12, 13, 14], hashes[1:5])]
    runs.forget({"r"})
    assert runs.runs("r", ([10], [20]), hashes, 16) == [BlockChecksumRun(0, 0, [10], hashes[:1]),
                                                       BlockChecksumRun(2, 0, [20], hashes[:1])]


def test_the_store_worker_forgets_finished_and_preempted_requests_fills():
    """A preempted request may get a block id it had before, whose entry
    another request refilled since: its next save fills again from 0."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import MooncakeStoreWorker

    worker = object.__new__(MooncakeStoreWorker)  # only what get_finished reads
    worker._capacity_only, worker.can_put, worker.load_async, worker.tp_rank = False, False, False, 0
    worker._kv_checksum_runs = kv_checksums.SaveRuns([0], block_size=16)
    hashes = [bytes([i]) * 32 for i in range(3)]
    for req in ("preempted", "finished", "running"):
        worker._kv_checksum_runs.runs(req, ([1, 2],), hashes, 32)
    worker.get_finished({"finished"}, SimpleNamespace(preempted_req_ids={"preempted"}))
    assert worker._kv_checksum_runs.runs("preempted", ([1, 2],), hashes, 32) == [
        BlockChecksumRun(0, 0, [1, 2], hashes[:2])]
    assert worker._kv_checksum_runs.runs("finished", ([1, 2],), hashes, 32) == [
        BlockChecksumRun(0, 0, [1, 2], hashes[:2])]
    assert worker._kv_checksum_runs.runs("running", ([1, 2],), hashes, 32) == []
