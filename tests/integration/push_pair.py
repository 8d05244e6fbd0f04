"""Push workers built without __init__ (as vLLM's own NIXL push tests do: a
full worker needs a running engine's handshake), wired producer to consumer by
a stand-in for the NIXL agents' notification delivery. The methods the tests
call are the real ones."""

from __future__ import annotations

import queue
import threading
import time
from collections import defaultdict
from types import SimpleNamespace
from unittest.mock import MagicMock

import msgspec


def push_worker(engine_id: str):
    """A NixlPushConnectorWorker without __init__: the state its lease,
    registration and notification paths read."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

    w = object.__new__(NixlPushConnectorWorker)
    w.engine_id, w.world_size, w.tp_rank, w.pp_size = engine_id, 1, 0, 1
    w.xfer_stats = NixlKVConnectorStats()
    w.nixl_wrapper = MagicMock()
    w.transfer_topo = MagicMock()
    w.transfer_topo.tp_ratio.return_value = 1
    w.use_mla, w._has_mamba, w._is_hma_required, w.use_host_buffer = False, False, False, False
    w._reqs_to_send, w._reqs_to_process = {}, set()
    w.consumer_notification_counts_by_req = defaultdict(int)
    w.expected_consumer_notifications_by_req = {}
    w._recving_metadata, w._recving_transfers, w._recv_failures = {}, defaultdict(list), set()
    w._failed_recv_reqs, w._invalid_block_ids = queue.Queue(), queue.Queue()
    w._pending_recv_notifs, w._replicated_pcp_done_sending = {}, set()
    w._sending_transfers, w._send_failures = defaultdict(list), set()
    w._sending_transfers_lock, w._handshake_lock = threading.Lock(), threading.RLock()
    w._push_finished_blocks, w._push_kv_checksums, w._received_kv_checksums = {}, {}, {}
    w._pending_d_registrations = {}
    w._pending_completion_notifs, w._evict_finished_inbox = queue.Queue(), queue.Queue()
    w._push_writer_wake = threading.Event()
    w._engine_last_active, w._remote_agents, w.tp_mappings = {}, {}, {}
    # What dropping a remote engine's agents (_cleanup_remote_engine) clears.
    role = "kv_consumer" if engine_id.startswith("consumer") else "kv_producer"
    w.kv_transfer_config = SimpleNamespace(kv_role=role)
    w.dst_xfer_side_handles, w._engine_by_address, w._engine_clock_offset = {}, {}, {}
    w._failed_remote_engines, w._invalid_remote_engines = set(), set()
    w.kv_caches_base_addr, w.dst_num_blocks, w.dst_region_num_blocks = {}, {}, {}
    w.dst_region_group_ids, w.dst_uses_region_group_mapping, w.dst_region_mem_types = {}, {}, {}
    w._physical_blocks_per_logical_kv_block, w._hb_handshake_notif_only = 1, True
    w._ensure_handshake = MagicMock(return_value=None)  # the handshake is done
    w._log_failure = MagicMock()
    # The writer thread's inboxes and events (test_an_idle_producer_... runs it).
    w._reg_send_inbox, w._deferred_push_inbox = queue.Queue(), queue.Queue()
    w._finished_blocks_inbox = queue.Queue()
    w._push_writer_stop = threading.Event()
    _add_cleared_state(w)
    return w


def _add_cleared_state(w) -> None:
    """Every per-engine map or set `_cleanup_remote_engine` clears, empty,
    read from its source: vLLM adds such state between releases (0.34:
    _dst_pairs, draft_tp_mappings)."""
    import inspect
    import re

    source = inspect.getsource(type(w)._cleanup_remote_engine)
    for name, method in re.findall(r"self\.(\w+)\.(pop|discard)\(", source):
        if name not in w.__dict__:
            setattr(w, name, {} if method == "pop" else set())


def registration(request_id: str, block_ids, names: str | None = None) -> bytes:
    """A consumer's PUSH_REG; `names`: the producer request it names (its
    kv_transfer_params' remote_request_id), when the consumer knows one."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import PUSH_REG_NOTIF_PREFIX

    data = {
        "request_id": request_id, "decode_engine_id": "consumer", "decode_host": "127.0.0.1",
        "decode_port": 5602, "decode_tp_size": 1, "local_block_ids": block_ids,
        "remote_engine_id": "producer", "remote_host": "127.0.0.1", "remote_port": 5601,
        "remote_tp_size": 1}
    if names is not None:
        data["remote_request_id"] = names
    return PUSH_REG_NOTIF_PREFIX + msgspec.msgpack.encode(data)


def wired_pair():
    """A producer and a consumer push worker; what the producer sends to the
    consumer's agent lands in the consumer's forwarded-notif queue."""
    p, d = push_worker("producer"), push_worker("consumer")
    p._remote_agents = {"consumer": {(0, 0): "consumer-agent"}}
    p.tp_mappings = {"consumer": SimpleNamespace(all_source_ranks=[0])}
    p.nixl_wrapper.send_notif.side_effect = lambda agent, notif_msg: d._pending_completion_notifs.put(notif_msg)
    p._xfer_blocks_for_req = MagicMock()  # the WRITEs (NIXL transfers), recorded
    return p, d


def expire(p, request_id: str, block_ids=None) -> None:
    """The producer finished `request_id` (its blocks wait for a registration,
    unless None: a push started already); then its lease ran out."""
    if block_ids is not None:
        p._push_finished_blocks[request_id] = block_ids
    p._reqs_to_send[request_id] = time.perf_counter() - 1
    p._reqs_to_process.add(request_id)
    assert request_id in p.get_transfer_results().finished_sending
