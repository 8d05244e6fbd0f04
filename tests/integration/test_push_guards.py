"""NIXL push's checksum carrier in the cases test_push_carrier does not cover.

- P scheduler (the real NixlPushConnector scheduler of pd_harness): a
  request's checksums cross to the workers once, with its own finished
  blocks; a request finishing later ships only its own.
- D worker (the push worker of test_push_carrier: built without __init__,
  every push-worker method under test the real one): how many notifs
  complete a load when the producer's TP size is larger than, or equal to,
  the consumer's (one per producer rank writing to this rank); and notifs
  for loads this worker does not track are dropped as they are drained,
  their checksums never held.
"""

from __future__ import annotations

import pytest
from pd_harness import forward_of, make_request, make_side, prompt_of
from test_push_carrier import PUSH, payload_bytes, stub_worker, transfer_results
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata

from vllm_kvchecksum.core.payload import KVChecksumPayload


# -- P scheduler -----------------------------------------------------------------

def test_each_finished_request_ships_its_own_checksums_once():
    P = make_side("kv_producer", connector=PUSH, fail_closed=True)
    shipped: list[dict] = []  # per step that shipped finished blocks: request id -> checksums

    def run(req):
        P.scheduler.add_request(req)
        forward = forward_of(P, req)
        for _ in range(6):
            out, _ = P.step(forward=forward)
            meta = out.kv_connector_metadata
            assert isinstance(meta, NixlConnectorMetadata)
            if meta.push_finished_blocks:
                assert set(meta.push_finished_kv_checksums) <= set(meta.push_finished_blocks)
                shipped.append(dict(meta.push_finished_kv_checksums))
            if req.is_finished() and shipped and req.request_id in shipped[-1]:
                return
        raise AssertionError(f"{req.request_id}'s checksums were never shipped")

    first = make_request(prompt_of(40, seed=1), remote_decode=True)
    second = make_request(prompt_of(56, seed=2), remote_decode=True)
    run(first)
    run(second)
    assert [set(s) for s in shipped] == [{first.request_id}, {second.request_id}]
    assert KVChecksumPayload.from_bytes(shipped[0][first.request_id]).num_tokens == 40
    assert KVChecksumPayload.from_bytes(shipped[1][second.request_id]).num_tokens == 56
    assert P.scheduler.connector.connector_scheduler._newly_finished_kv_checksums == {}


# -- D worker: notifs per load ---------------------------------------------------

def producer_notif(producer_tp: int, payload: bytes | None) -> bytes:
    """The completion notif a rank of a producer of TP size producer_tp sends for load "d"."""
    producer = stub_worker(world_size=producer_tp)
    if payload is not None:
        producer._push_kv_checksums["p"] = payload
    return producer._completion_notif("p", "d")


@pytest.mark.parametrize("with_checksums", [True, False], ids=["checksums", "plain"])
@pytest.mark.parametrize("producer_tp,consumer_tp,pp_size", [(2, 2, 1), (4, 2, 1), (1, 2, 1), (2, 2, 2), (8, 2, 1)])
def test_a_load_completes_on_one_notif_per_producer_rank_writing_here(producer_tp, consumer_tp, pp_size,
                                                                      with_checksums):
    """Producer TP > consumer TP: producer_tp // consumer_tp ranks write to
    each consumer rank (each sends its notif); equal or smaller: one. Times
    the producer's PP stages."""
    consumer = stub_worker(world_size=consumer_tp)
    consumer._recving_metadata["d"] = type("Meta", (), {"pp_size": pp_size})()
    expected = pp_size * max(1, producer_tp // consumer_tp)
    payload = payload_bytes(3) if with_checksums else None
    for n in range(1, expected + 1):
        consumer._pending_completion_notifs.put(producer_notif(producer_tp, payload))
        results = transfer_results(consumer)
        if n < expected:
            assert results.finished_recving == set() and results.kv_checksums == {}, n
    assert results.finished_recving == {"d"}
    assert results.kv_checksums == ({"d": payload} if with_checksums else {})
    assert consumer._recving_metadata == {} and consumer._received_kv_checksums == {}
    assert not consumer.consumer_notification_counts_by_req


# -- D worker: notifs of loads not tracked here ----------------------------------

def test_notifs_of_loads_not_tracked_here_are_dropped_as_they_are_drained():
    """A late notif (its load expired), or one a peer sends for a load this
    worker never started: its checksums are not kept even between the drain
    and the end of get_transfer_results, and a load in flight still takes
    its own."""
    consumer = stub_worker()
    consumer._recving_metadata["d"] = type("Meta", (), {"pp_size": 1})()
    for i in range(50):
        producer = stub_worker()
        producer._push_kv_checksums["p"] = payload_bytes(100 + i)
        consumer._pending_completion_notifs.put(producer._completion_notif("p", f"gone-{i}"))
    consumer._pending_completion_notifs.put(producer_notif(1, payload_bytes(7)))
    consumer._get_new_notifs()  # the drain get_transfer_results starts with
    assert consumer._received_kv_checksums == {"d": payload_bytes(7)}
    assert consumer.xfer_stats.data["num_notifications_after_expiry"] == [1] * 50
    results = transfer_results(consumer)
    assert results.finished_recving == {"d"} and results.kv_checksums == {"d": payload_bytes(7)}
    assert consumer._received_kv_checksums == {}
