"""Mooncake P2P carries KV checksums on the transfer's response, hop by hop.

- P scheduler: the real MooncakeConnector scheduler (pd_harness side, real
  vLLM Scheduler and checksum scheduler) ships a length-capped request's
  checksums in the metadata of the step after it finished, once; an aborted
  or stopped request (Mooncake sends only length-capped ones) ships none.
- P worker: record_send_reqs puts them on the SendBlockMeta before it is
  made ready; send_kv_to_decode adds them to the response of the ok
  requests only, and the field is absent from the msgpack bytes otherwise
  (an old peer's decoder reads the new response, and the new decoder an
  old one).
- D worker: process_pulling_result + get_transfer_results report them with
  the finished load (first copy kept when several producer workers answer),
  none for a failed pull, none when oversize.
- Real path: a real bootstrap server and two real MooncakeConnectorWorkers,
  each with a real mooncake TransferEngine (TCP on loopback) over the
  harness sides' CPU KV caches. The consumer's real load (scheduler
  metadata -> V1 runner glue -> bootstrap query -> ZMQ request to the
  producer's real sender listener -> real batch_transfer_sync_write ->
  response -> process_pulling_result -> get_transfer_results) delivers the
  producer's checksums, and the consumer's checksum worker verifies the
  bytes Mooncake wrote.

What is stubbed, and why:
- The distributed-state getters (TP rank/world size, PP group) and get_ip
  (-> 127.0.0.1) while a worker is built and registers: there is no
  torch.distributed group in a test process, and loopback keeps it local.
  On CPU torch, torch.accelerator.current_device_index (which raises there)
  returns 0, in case the worker asks for it.
  The producer's bootstrap_server_address names the test's bootstrap server,
  so the worker launches none of its own.
- In the worker unit tests the SendBlockMetas / PullReqMetas / responses
  are made by the test; the transfers are real, except one test that makes
  _send_blocks return an error (a failed transfer cannot be provoked safely
  on loopback).
- No model forward: the producer's blocks hold the caches' seeded random
  bytes, which its checksum worker sums as it would a forward's KV.

The scheduler tests and the msgpack compatibility test run without
mooncake; the rest skip, with the reason, if `mooncake.engine` cannot be
imported. The bug test (xfail, strict) is described in its reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from dataclasses import dataclass
from unittest.mock import MagicMock, patch

import msgspec
import pytest
import torch
import pd_harness
from pd_harness import Side, forward_of, make_request, make_side, prompt_of, runner_step, stats
from vllm.config import set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector as mc
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (MooncakeConnector,
                                                                                     MooncakeConnectorMetadata,
                                                                                     MooncakeConnectorWorker,
                                                                                     MooncakeXferMetadata,
                                                                                     MooncakeXferResponse,
                                                                                     MooncakeXferResponseStatus,
                                                                                     PullReqMeta, SendBlockMeta)
from vllm.v1.request import RequestStatus

from vllm_kvchecksum.engine.carrier import KVChecksumCarrier
from vllm_kvchecksum.core.payload import MAX_PACKED_BYTES, KVChecksumPayload

try:
    from mooncake.engine import TransferEngine  # noqa: F401
    MOONCAKE_MISSING = None
except ImportError as exc:  # pragma: no cover - depends on the machine
    MOONCAKE_MISSING = f"mooncake.engine cannot be imported ({exc})"

MOONCAKE = "MooncakeConnector"
BLOCK = 32  # the CPU attention backend takes multiples of 32 only (the worker checks)
_ids = itertools.count()


def uid(prefix: str) -> str:
    return f"{prefix}-{next(_ids)}"


def payload_bytes(seed: int = 1) -> bytes:
    import numpy as np

    from vllm_kvchecksum.core.payload import PayloadGroup

    values = np.arange(3, dtype=np.uint64) * 1_000_003 + seed
    return KVChecksumPayload(num_tokens=70, producer_tp_size=1,
                             groups={0: PayloadGroup(fingerprint=3, block_size=BLOCK, start=0, values=values)}
                             ).to_bytes()


# -- P scheduler ---------------------------------------------------------------

def producer_request(side: Side, prompt, *, max_tokens: int = 1):
    req = make_request(prompt, remote_decode=True, block_size=side.block_size)
    req.max_tokens = max_tokens
    # The router's transfer id (Mooncake returns no kv_transfer_params).
    req.kv_transfer_params["transfer_id"] = f"xfer-{req.request_id}"
    side.scheduler.add_request(req)
    return req


def test_carrier_is_the_connector_for_mooncake_transfers():
    P = make_side("kv_producer", connector=MOONCAKE)
    c = P.scheduler.connector
    assert c.can_carry_kv_checksums()

    def req(**params):
        return make_request(prompt_of(4), params=params)

    CONNECTOR = KVChecksumCarrier.CONNECTOR
    assert c.kv_checksum_carrier(req(do_remote_decode=True, transfer_id="t"), False) is CONNECTOR
    assert c.kv_checksum_carrier(req(do_remote_prefill=True, transfer_id="t"), True) is CONNECTOR
    # No transfer id: Mooncake moves nothing for it.
    assert c.kv_checksum_carrier(req(do_remote_decode=True), False) is None
    assert c.kv_checksum_carrier(req(do_remote_prefill=True), True) is None
    # Not a producer request / a bidirectional load.
    assert c.kv_checksum_carrier(req(transfer_id="t"), False) is None
    assert c.kv_checksum_carrier(req(do_remote_prefill=True, do_remote_decode=True, transfer_id="t"), True) is None


def test_startup_line_names_the_carrier():
    from vllm_kvchecksum.engine.scheduler import _carrier_name

    assert _carrier_name(make_side("kv_consumer", connector=MOONCAKE).scheduler.connector) == "connector"


def test_producer_scheduler_ships_checksums_in_the_next_metadata_once():
    """Real MooncakeConnector scheduler + real checksum scheduler (pd_harness)."""
    P = make_side("kv_producer", connector=MOONCAKE)
    req = producer_request(P, prompt_of(77))
    forward = forward_of(P, req)
    metas = []
    for _ in range(4):
        out, outputs = P.step(forward=forward)
        metas.append(out.kv_connector_metadata)
        if req.is_finished():
            break
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert outputs[req.request_id].kv_transfer_params is None
    # Built before the request finished: only the empty entry of update_state_after_alloc.
    assert all(isinstance(m, MooncakeConnectorMetadata) and not m.kv_checksums for m in metas)
    assert metas[0].reqs_to_send == {req.request_id: (req.kv_transfer_params["transfer_id"], [])}

    out, _ = P.step()
    meta = out.kv_connector_metadata
    transfer_id, blocks = meta.reqs_to_send[req.request_id]
    assert transfer_id == req.kv_transfer_params["transfer_id"] and any(blocks)
    assert set(meta.kv_checksums) == {req.request_id}
    payload = KVChecksumPayload.from_bytes(meta.kv_checksums[req.request_id])
    assert payload.num_tokens == 77 and set(payload.groups) == {0}
    assert stats(P) == {"sent": 1}
    assert P.scheduler.connector.connector_scheduler._kv_checksums == {}
    # Shipped once.
    out, _ = P.step()
    assert out.kv_connector_metadata.kv_checksums == {}


def test_aborted_producer_request_keeps_and_ships_nothing():
    P = make_side("kv_producer", connector=MOONCAKE)
    req = producer_request(P, prompt_of(77), max_tokens=4)  # still running after its prompt's step
    P.step(forward=forward_of(P, req))
    assert not req.is_finished()
    P.scheduler.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    out, _ = P.step()
    meta = out.kv_connector_metadata
    assert meta.kv_checksums == {} and req.request_id not in meta.reqs_to_send
    assert req.kv_transfer_params["transfer_id"] in meta.reqs_not_processed
    connector = P.scheduler.connector
    assert connector.connector_scheduler._kv_checksums == {}
    assert connector.send_kv_checksums(req, b"x") is False
    assert connector.connector_scheduler._kv_checksums == {}
    assert "sent" not in stats(P)


def test_stopped_producer_request_is_not_sent_so_ships_no_checksums():
    """FINISHED_STOPPED is a normal finish for the checksums, but Mooncake
    sends only length-capped requests: send_kv_checksums says False."""
    P = make_side("kv_producer", connector=MOONCAKE)
    req = producer_request(P, prompt_of(77), max_tokens=4)
    req.sampling_params.stop_token_ids = [11]  # the token the harness samples
    P.step(forward=forward_of(P, req))
    assert req.status == RequestStatus.FINISHED_STOPPED
    out, _ = P.step()
    assert out.kv_connector_metadata.kv_checksums == {}
    assert P.scheduler.connector.connector_scheduler._kv_checksums == {}
    assert stats(P) == {"not_carried": 1}
    assert P.scheduler.connector.send_kv_checksums(req, b"x") is False


def test_send_kv_checksums_refuses_a_request_with_nothing_to_send():
    P = make_side("kv_producer", connector=MOONCAKE)
    sched = P.scheduler.connector.connector_scheduler
    req = make_request(prompt_of(16), remote_decode=True)
    assert P.scheduler.connector.send_kv_checksums(req, b"x") is False
    # Registered by update_state_after_alloc, no blocks yet.
    sched._reqs_need_send[req.request_id] = (req, [])
    assert P.scheduler.connector.send_kv_checksums(req, b"x") is False
    sched._reqs_need_send[req.request_id] = (req, [[]])
    assert P.scheduler.connector.send_kv_checksums(req, b"x") is False
    assert sched._kv_checksums == {}
    sched._reqs_need_send[req.request_id] = (req, [[3, 4]])
    assert P.scheduler.connector.send_kv_checksums(req, b"x") is True
    assert sched._kv_checksums == {req.request_id: b"x"}


# -- real workers ----------------------------------------------------------------

@contextlib.contextmanager
def single_rank_env(vllm_config):
    """What a worker needs from a running engine's distributed state."""
    pp_group = MagicMock(rank_in_group=0)
    # CPU torch has no accelerator: current_device_index() raises there
    # (the worker asks for it unless it checks current_platform.is_cpu()).
    device = (contextlib.nullcontext() if torch.accelerator.is_available()
              else patch.object(torch.accelerator, "current_device_index", return_value=0))
    with (set_current_vllm_config(vllm_config), device,
          patch.object(mc, "get_ip", return_value="127.0.0.1"),
          patch.object(mc, "get_tensor_model_parallel_rank", return_value=0),
          patch.object(mc, "get_tensor_model_parallel_world_size", return_value=1),
          patch.object(mc, "get_pp_group", return_value=pp_group)):
        yield


def real_connector(side: Side) -> MooncakeConnector:
    """The worker half of a real MooncakeConnector (real TransferEngine),
    registered over the side's worker caches, as the model runner does."""
    config = side.scheduler.vllm_config
    with single_rank_env(config):
        connector = MooncakeConnector(config, mc.KVConnectorRole.WORKER, side.scheduler.kv_cache_config)
        connector.register_kv_caches(side.workers[0].caches)
    return connector


@dataclass
class Pair:
    server: object
    P: Side
    C: Side
    p_conn: MooncakeConnector
    c_conn: MooncakeConnector

    @property
    def producer(self) -> MooncakeConnectorWorker:
        return self.p_conn.connector_worker

    @property
    def consumer(self) -> MooncakeConnectorWorker:
        return self.c_conn.connector_worker

    @property
    def bootstrap_addr(self) -> str:
        return f"http://127.0.0.1:{self.server.port}"


@pytest.fixture(scope="module")
def pair():
    if MOONCAKE_MISSING:
        pytest.skip(MOONCAKE_MISSING)
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_utils import MooncakeBootstrapServer

    server = MooncakeBootstrapServer("127.0.0.1", 0)
    server.start()
    P = make_side("kv_producer", block_size=BLOCK, connector=MOONCAKE, connector_extra={
        "mooncake_protocol": "tcp", "bootstrap_server_address": f"127.0.0.1:{server.port}"})
    C = make_side("kv_consumer", block_size=BLOCK, connector=MOONCAKE, connector_extra={"mooncake_protocol": "tcp"})
    p_conn = real_connector(P)
    c_conn = real_connector(C)
    try:
        yield Pair(server, P, C, p_conn, c_conn)
    finally:
        for w in (c_conn.connector_worker, p_conn.connector_worker):
            # shutdown() terminates the ZMQ context, which blocks while a
            # socket is open: the sender listener's socket closes only when
            # its task ends, so end the loops' tasks first.
            for loop in (getattr(w, "sender_loop", None), getattr(w, "receiver_loop", None)):
                if loop is not None and loop.is_running():
                    on_loop(loop, _cancel_other_tasks())
            w.shutdown()
        server.shutdown()


async def _cancel_other_tasks():
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def on_loop(loop, coro, timeout: float = 30):
    """Run `coro` on a worker's own event loop thread, as the worker does."""
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)


class CaptureSocket:
    """Stands in for the sender's ZMQ ROUTER socket in the unit tests."""

    def __init__(self):
        self.sent: list[tuple[bytes, bytes]] = []

    async def send_multipart(self, parts):
        self.sent.append(tuple(parts))


def consumer_xfer_meta(w: MooncakeConnectorWorker, req_blocks, **overrides) -> MooncakeXferMetadata:
    """The request a consumer worker sends (as receive_kv_from_single_worker builds it)."""
    fields = dict(
        remote_hostname=w.hostname, remote_port=w.rpc_port, remote_tp_size=w.tp_size, remote_tp_rank=w.tp_rank,
        remote_pp_size=w.pp_size, req_blocks=req_blocks, kv_caches_base_addr=w.kv_caches_base_addr,
        block_lens=w.block_len_per_layer, kv_block_lens=w.kv_block_len_per_layer,
        registered_layer_names=w.registered_layer_names, registered_layer_indices=w.registered_layer_indices,
        registered_group_indices=w.registered_group_indices,
        registered_shared_group_ids=[list(g) for g in w.region_shared_groups],
        registered_row_offsets=w.region_row_offsets)
    fields.update(overrides)
    return MooncakeXferMetadata(**fields)


def ready_send_meta(w: MooncakeConnectorWorker, blocks, checksums: bytes | None) -> SendBlockMeta:
    """A finished producer request whose blocks can be sent (record_send_reqs' result)."""
    transfer_id = uid("t")
    meta = SendBlockMeta(p_req_id=uid("p"), transfer_id=transfer_id, local_block_ids=blocks, ready=asyncio.Event(),
                         kv_checksums=checksums)
    meta.ready.set()

    async def add():  # the sender loop owns reqs_need_send
        w.reqs_need_send[transfer_id] = meta

    on_loop(w.sender_loop, add())
    return meta


def send(pair: Pair, meta: MooncakeXferMetadata) -> list[bytes]:
    """The producer worker's real send_kv_to_decode, on its sender loop; the responses' bytes."""
    sock = CaptureSocket()
    on_loop(pair.producer.sender_loop, pair.producer.send_kv_to_decode(b"consumer", sock, meta))
    assert sock.sent and all(identity == b"consumer" for identity, _ in sock.sent)
    return [data for _, data in sock.sent]


def block_bytes(side: Side, block_id: int) -> list[bytes]:
    return [bytes(cache[block_id].contiguous().view(torch.uint8).numpy()) for _, cache in
            sorted(side.workers[0].caches.items())]


# -- P worker: record_send_reqs ---------------------------------------------------

def test_record_send_reqs_attaches_checksums_before_ready(pair):
    w = pair.producer
    with_sums, without = uid("p"), uid("p")
    tids = {with_sums: uid("t"), without: uid("t")}
    first = MooncakeConnectorMetadata()  # update_state_after_alloc's empty entries
    first.reqs_to_send = {rid: (tid, []) for rid, tid in tids.items()}
    on_loop(w.sender_loop, w.record_send_reqs(first))
    metas = {rid: w.reqs_need_send[tid] for rid, tid in tids.items()}
    assert all(m.kv_checksums is None and not m.ready.is_set() for m in metas.values())

    seen_at_ready = {}

    class WatchedReady(asyncio.Event):
        def __init__(self, rid):
            super().__init__()
            self.rid = rid

        def set(self):
            seen_at_ready[self.rid] = metas[self.rid].kv_checksums
            super().set()

    for rid, m in metas.items():
        m.ready = WatchedReady(rid)
    checksums = payload_bytes(3)
    second = MooncakeConnectorMetadata()  # the step after request_finished
    second.reqs_to_send = {rid: (tid, [[5, 6]]) for rid, tid in tids.items()}
    second.kv_checksums = {with_sums: checksums}
    on_loop(w.sender_loop, w.record_send_reqs(second))
    assert seen_at_ready == {with_sums: checksums, without: None}
    assert metas[with_sums].kv_checksums == checksums and metas[with_sums].ready.is_set()
    assert metas[without].kv_checksums is None and metas[without].ready.is_set()
    for tid in tids.values():
        w.reqs_need_send.pop(tid, None)


# -- P worker: send_kv_to_decode --------------------------------------------------

def test_response_carries_checksums_of_ok_requests_only(pair):
    """One real transfer request for two consumer requests: one is sent (real
    batch_transfer_sync_write into the consumer's registered caches), one
    asks for more blocks than the producer has (err)."""
    A, B = payload_bytes(1), payload_bytes(2)
    ok_meta = ready_send_meta(pair.producer, [[80, 81]], A)
    err_meta = ready_send_meta(pair.producer, [[82]], B)
    d_ok, d_err = uid("d"), uid("d")
    meta = consumer_xfer_meta(pair.consumer, {d_ok: (ok_meta.transfer_id, [[90, 91]]),
                                              d_err: (err_meta.transfer_id, [[92, 93]])})
    (data,) = send(pair, meta)
    response = pair.consumer._xfer_resp_decoder.decode(data)
    assert response.status == MooncakeXferResponseStatus.FINISH
    assert response.ok_reqs == [d_ok] and response.err_reqs == [d_err]
    assert response.kv_checksums == {d_ok: A}
    # The bytes moved.
    assert block_bytes(pair.C, 90) == block_bytes(pair.P, 80)
    assert block_bytes(pair.C, 91) == block_bytes(pair.P, 81)


def test_response_omits_the_field_without_checksums(pair):
    send_meta = ready_send_meta(pair.producer, [[83]], None)
    d = uid("d")
    (data,) = send(pair, consumer_xfer_meta(pair.consumer, {d: (send_meta.transfer_id, [[94]])}))
    raw = msgspec.msgpack.decode(data)
    assert raw.get("ok_reqs") == [d]
    assert "kv_checksums" not in raw
    assert pair.consumer._xfer_resp_decoder.decode(data).kv_checksums is None


def test_failed_transfer_response_carries_no_checksums(pair):
    """_send_blocks is made to fail (the engine's return code): every ready
    request becomes an err request."""
    send_meta = ready_send_meta(pair.producer, [[84]], payload_bytes(4))
    d = uid("d")
    with patch.object(pair.producer, "_send_blocks", return_value=-1):
        (data,) = send(pair, consumer_xfer_meta(pair.consumer, {d: (send_meta.transfer_id, [[95]])}))
    raw = msgspec.msgpack.decode(data)
    assert raw["err_reqs"] == [d] and "ok_reqs" not in raw
    assert "kv_checksums" not in raw


def test_error_response_carries_no_checksums(pair):
    """A consumer TP rank the producer does not pair with: an ERROR response."""
    send_meta = ready_send_meta(pair.producer, [[85]], payload_bytes(5))
    d = uid("d")
    (data,) = send(pair, consumer_xfer_meta(pair.consumer, {d: (send_meta.transfer_id, [[95]])}, remote_tp_rank=1))
    raw = msgspec.msgpack.decode(data)
    assert raw["status"] == MooncakeXferResponseStatus.ERROR
    assert "kv_checksums" not in raw
    pair.producer.reqs_need_send.pop(send_meta.transfer_id, None)


class OldMooncakeXferResponse(msgspec.Struct, omit_defaults=True):
    """MooncakeXferResponse before the checksums (an older peer)."""

    status: MooncakeXferResponseStatus
    ok_reqs: list[str] | None = None
    err_reqs: list[str] | None = None
    err_msg: str | None = None


def test_mixed_versions_read_each_others_responses():
    encoder = msgspec.msgpack.Encoder()
    new = MooncakeXferResponse(status=MooncakeXferResponseStatus.FINISH, ok_reqs=["d"], kv_checksums={"d": b"xy"})
    old = msgspec.msgpack.Decoder(OldMooncakeXferResponse).decode(encoder.encode(new))
    assert old == OldMooncakeXferResponse(status=MooncakeXferResponseStatus.FINISH, ok_reqs=["d"])
    back = msgspec.msgpack.Decoder(MooncakeXferResponse).decode(encoder.encode(old))
    assert back == MooncakeXferResponse(status=MooncakeXferResponseStatus.FINISH, ok_reqs=["d"])
    assert back.kv_checksums is None
    # Absent: the same bytes an old peer sends.
    plain = MooncakeXferResponse(status=MooncakeXferResponseStatus.FINISH, ok_reqs=["d"])
    assert encoder.encode(plain) == encoder.encode(old)


# -- D worker: process_pulling_result + get_transfer_results -----------------------

def pull_meta(d: str, blocks=([7],), tasks: int = 1) -> PullReqMeta:
    return PullReqMeta(d_req_id=d, transfer_id=f"t-{d}", local_block_ids=[list(b) for b in blocks],
                       remote_engine_id="p-engine", remote_bootstrap_addr="http://127.0.0.1:9",
                       pull_tasks_count=tasks)


def receive(w: MooncakeConnectorWorker, metas: dict, **response):
    """A producer worker's response, through the msgpack bytes, handled on
    the consumer's receiver loop (where receive_kv_from_single_worker runs)."""
    data = w._encoder.encode(MooncakeXferResponse(status=MooncakeXferResponseStatus.FINISH, **response))
    decoded = w._xfer_resp_decoder.decode(data)

    async def handle():
        # Each producer worker's connection has its own copy of the metas
        # (receive_kv_from_single_worker; vLLM 0.34 pops from it).
        w.process_pulling_result(decoded, dict(metas))

    on_loop(w.receiver_loop, handle())


def test_checksums_are_reported_with_the_finished_load(pair):
    w = pair.consumer
    d = uid("d")
    metas = {d: pull_meta(d)}
    A = payload_bytes(6)
    receive(w, metas, ok_reqs=[d], kv_checksums={d: A})
    results = w.get_transfer_results()
    assert d in results.finished_recving and d not in results.failed_recving
    assert results.kv_checksums.get(d) == A
    # Reported once, nothing kept.
    assert d not in w._received_kv_checksums
    again = w.get_transfer_results()
    assert d not in again.finished_recving and d not in again.kv_checksums


@pytest.mark.parametrize("poll_between", [True, False], ids=["polled-between", "both-queued"])
def test_two_producer_workers_first_copy_kept(pair, poll_between):
    """Heterogeneous TP: two producer workers answer one load."""
    w = pair.consumer
    d = uid("d")
    metas = {d: pull_meta(d, tasks=2)}
    A, B = payload_bytes(7), payload_bytes(8)
    receive(w, metas, ok_reqs=[d], kv_checksums={d: A})
    if poll_between:
        results = w.get_transfer_results()
        # Not finished yet: kept for when it is.
        assert d not in results.finished_recving and d not in results.kv_checksums
    receive(w, metas, ok_reqs=[d], kv_checksums={d: B})
    results = w.get_transfer_results()
    assert d in results.finished_recving
    assert results.kv_checksums.get(d) == A
    assert d not in w._received_kv_checksums


def test_failed_pull_reports_no_checksums(pair):
    w = pair.consumer
    d = uid("d")
    metas = {d: pull_meta(d)}
    # Even a (faulty) producer naming the err request gets nothing through.
    receive(w, metas, err_reqs=[d], err_msg="P num blocks less than D", kv_checksums={d: payload_bytes(9)})
    results = w.get_transfer_results()
    assert d in results.finished_recving  # failed: reported with its invalid blocks
    assert w.get_block_ids_with_load_errors() == {7}
    assert d not in results.kv_checksums and d not in w._received_kv_checksums


def test_ok_after_another_worker_failed_reports_no_checksums(pair):
    w = pair.consumer
    d = uid("d")
    metas = {d: pull_meta(d, tasks=2)}
    receive(w, metas, err_reqs=[d], err_msg="transfer failed")
    receive(w, metas, ok_reqs=[d], kv_checksums={d: payload_bytes(10)})
    results = w.get_transfer_results()
    assert d in results.finished_recving and d not in results.kv_checksums
    w.get_block_ids_with_load_errors()


def test_oversize_checksums_are_dropped(pair):
    w = pair.consumer
    big, limit = uid("d"), uid("d")
    metas = {big: pull_meta(big), limit: pull_meta(limit)}
    at_limit = b"\x01" * MAX_PACKED_BYTES
    over = b"\x02" * (MAX_PACKED_BYTES + 1)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger(mc.__name__)
    logger.addHandler(handler)
    try:
        # Straight to process_pulling_result: 2 x 48 MiB through msgpack only slows the test.
        response = MooncakeXferResponse(status=MooncakeXferResponseStatus.FINISH, ok_reqs=[big, limit],
                                        kv_checksums={big: over, limit: at_limit})

        async def handle():
            w.process_pulling_result(response, metas)

        on_loop(w.receiver_loop, handle())
    finally:
        logger.removeHandler(handler)
    results = w.get_transfer_results()
    assert {big, limit} <= results.finished_recving
    # (No 48 MiB reprs in a failure report.)
    reported = set(results.kv_checksums)
    assert big not in reported
    at_limit_reported = results.kv_checksums.get(limit) is at_limit
    assert at_limit_reported
    assert any("Dropping the KV checksums" in r.getMessage() and big in r.getMessage() for r in records)


def test_checksums_of_an_empty_pull_are_not_kept(pair):
    """The producer sends them for every ok request, including one whose
    consumer pulls no blocks (_build_transfer_params passes it as ok); such
    a pull is never reported finished, so the consumer must not keep them."""
    w = pair.consumer
    d = uid("d")
    metas = {d: pull_meta(d, blocks=())}
    receive(w, metas, ok_reqs=[d], kv_checksums={d: payload_bytes(11)})
    results = w.get_transfer_results()
    assert d not in results.finished_recving
    try:
        assert d not in w._received_kv_checksums
    finally:
        w._received_kv_checksums.pop(d, None)


# -- the real path ---------------------------------------------------------------

def drain(pair: Pair) -> None:
    """Take what the unit tests' made-up requests left on the shared workers
    (finished sends and loads of ids no scheduler knows)."""
    for w in (pair.producer, pair.consumer):
        w.get_transfer_results()
        w.get_block_ids_with_load_errors()


def wait_for(condition, step, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        step()
        time.sleep(0.02)


@pytest.mark.parametrize("tamper", [False, True], ids=["intact", "producer-block-changed-after-checksum"])
def test_real_pull_delivers_checksums_and_the_consumer_verifies_the_moved_bytes(pair, tamper):
    """Everything real but the forward: both sides' scheduler steps run through
    the V1 runner glue (kv_connector_no_forward) with the real Mooncake
    connectors; the consumer's load goes through the bootstrap server, ZMQ to
    the producer's sender listener, a TCP batch_transfer_sync_write into
    the consumer's caches, and the response back. The response handled by
    process_pulling_result is observed (wrapped, not replaced).

    tamper: a producer block changes after the producer summed it and before
    the pull: the consumer must count a mismatch, so what it compares is
    the moved bytes against the producer's checksums."""
    drain(pair)
    P, C = pair.P, pair.C
    before_p, before_c = stats(P), stats(C)
    prompt = prompt_of(70, seed=next(_ids))
    preq = producer_request(P, prompt)
    shipped = None
    for _ in range(4):
        out, _ = runner_step(P, pd_harness.DEFAULT_RUNNER, connector=pair.p_conn)
        meta = out.kv_connector_metadata
        if preq.request_id in meta.kv_checksums:
            shipped = meta.kv_checksums[preq.request_id]
            transfer_id, p_blocks = meta.reqs_to_send[preq.request_id]
            break
    assert shipped is not None and preq.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert len(p_blocks[0]) == 3  # 70 tokens in 32-token blocks
    if tamper:
        next(iter(P.workers[0].caches.values()))[p_blocks[0][1]].view(torch.uint8).view(-1)[5] ^= 0x01

    params = dict(do_remote_prefill=True, do_remote_decode=False, remote_engine_id=pair.producer.engine_id,
                  remote_bootstrap_addr=pair.bootstrap_addr, transfer_id=transfer_id)
    creq = make_request(prompt, params=params, block_size=BLOCK)
    C.scheduler.add_request(creq)
    w = pair.consumer
    with patch.object(w, "process_pulling_result", wraps=w.process_pulling_result) as handled:
        out, _ = runner_step(C, pd_harness.DEFAULT_RUNNER, connector=pair.c_conn)
        assert creq.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        (pull,) = out.kv_connector_metadata.reqs_to_recv[pair.producer.engine_id].values()
        c_blocks = pull.local_block_ids
        wait_for(lambda: creq.status != RequestStatus.WAITING_FOR_REMOTE_KVS,
                 lambda: runner_step(C, pd_harness.DEFAULT_RUNNER, connector=pair.c_conn))
    (call,) = handled.call_args_list
    response = call.args[0]
    assert response.status == MooncakeXferResponseStatus.FINISH
    assert response.ok_reqs == [creq.request_id] and not response.err_reqs
    assert response.kv_checksums == {creq.request_id: shipped}
    assert creq.request_id not in w._received_kv_checksums

    # Mooncake wrote the producer's blocks into the consumer's.
    for p_block, c_block in zip(p_blocks[0], c_blocks[0], strict=True):
        assert block_bytes(C, c_block) == block_bytes(P, p_block)
    new_p = {k: v - before_p.get(k, 0) for k, v in stats(P).items() if v != before_p.get(k, 0)}
    new_c = {k: v - before_c.get(k, 0) for k, v in stats(C).items() if v != before_c.get(k, 0)}
    assert new_p == {"sent": 1}
    assert new_c == ({"mismatch": 1} if tamper else {"verified": 1})

    # The producer's worker reports the send finished; its scheduler frees the request.
    wait_for(lambda: preq.request_id not in P.scheduler.requests, lambda: runner_step(P, pd_harness.DEFAULT_RUNNER, connector=pair.p_conn))
