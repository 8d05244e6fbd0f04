"""What a producer sends when its request finishes, and what it counts.

Checksums go out only with a request that finished normally, only when the
connector returns kv_transfer_params to carry them, and stats["sent"]
counts exactly the payloads handed to the carrier.
"""

from __future__ import annotations

from pd_harness import forward_of, load, make_request, make_side, prefill, prompt_of, stats
from vllm.v1.request import RequestStatus

PROMPT = 77



def test_aborted_producer_request_sends_no_checksums():
    P = make_side("kv_producer")
    req = make_request(prompt_of(PROMPT), remote_decode=True)
    P.scheduler.add_request(req)
    write = forward_of(P, req)

    def forward_then_abort(out):
        # The client aborts while the step that finishes the prompt runs.
        write(out)
        P.scheduler.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)

    _, outputs = P.step(forward=forward_then_abort)
    params = outputs[req.request_id].kv_transfer_params if req.request_id in outputs else None
    assert not (params or {}).get("kv_checksums")
    assert stats(P) == {}
    assert not P.scheduler.kv_checksum._sends
    # The next request is sent as usual.
    _, params = prefill(P, prompt_of(PROMPT, seed=1))
    assert "kv_checksums" in params and stats(P) == {"sent": 1}


def test_only_payloads_handed_to_the_carrier_count_as_sent(monkeypatch):
    P = make_side("kv_producer")
    connector = P.scheduler.connector
    real = connector.request_finished_all_groups

    def carries_nothing(request, block_ids):
        # A connector that transfers nothing for this request returns no params.
        delay, _ = real(request, block_ids)
        return delay, None

    monkeypatch.setattr(connector, "request_finished_all_groups", carries_nothing)
    req = make_request(prompt_of(PROMPT), remote_decode=True)
    P.scheduler.add_request(req)
    _, outputs = P.step(forward=forward_of(P, req))
    assert outputs[req.request_id].kv_transfer_params is None
    assert stats(P) == {"not_carried": 1}
    assert "sent" not in stats(P)


def test_sent_checksums_ride_the_connectors_params_unchanged():
    P = make_side("kv_producer")
    C = make_side("kv_consumer", fail_closed=True)
    preq, params = prefill(P, prompt_of(PROMPT))
    assert stats(P) == {"sent": 1}
    assert {"remote_block_ids", "remote_engine_id", "kv_checksums"} <= set(params)
    load(C, P, preq, params)
    assert stats(C) == {"verified": 1}
