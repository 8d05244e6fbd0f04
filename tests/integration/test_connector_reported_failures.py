"""Loads the connector itself reports bad are vLLM's to handle, not compared.

A load the connector reports with invalid blocks (or failed) goes through
vLLM's own load-failure path first; the checksum comparison skips it, so it
is neither a mismatch nor counted, and it leaves nothing pending. Also: a
producer request preempted during its prefill still sends checksums that
verify (the step that finishes the prompt after the re-prefill is the one
checksummed).
"""

from __future__ import annotations

import pytest
from pd_harness import forward_of, load, make_request, make_side, prefill, prompt_of, stats
from vllm.v1.request import RequestStatus

PROMPT = 77



@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_load_with_invalid_blocks_is_left_to_vllm(policy):
    P = make_side("kv_producer")
    C = make_side("kv_consumer", fail_closed=True, policy=policy)
    preq, params = prefill(P, prompt_of(PROMPT))
    req = make_request(preq.prompt_token_ids, params=dict(params))
    C.scheduler.add_request(req)
    C.step()
    assert req.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    C.write_tokens(req.request_id, 0, req.num_computed_tokens, source=P, source_id=preq.request_id)
    # Block 3 was not written correctly, and the connector says so.
    C.corrupt(req.request_id, position=3)
    bad_block = C.scheduler.kv_cache_manager.get_block_ids(req.request_id)[0][3]
    out = C.scheduler.schedule()
    merged = C.run_workers(out, {req.request_id})
    merged.kv_connector_output.invalid_block_ids = {bad_block}
    outputs = C.update(out, merged)
    # Not compared: no verdict, nothing kept for it.
    assert stats(C) == {}
    assert not C.scheduler.kv_checksum._recvs
    if policy == "fail":
        assert outputs[req.request_id].finish_reason.name == "ERROR"
        assert not (outputs[req.request_id].stop_reason or "").startswith("kv_checksum")
    else:
        # vLLM keeps the valid prefix (blocks 0-2) and recomputes the rest.
        assert req.num_computed_tokens == 3 * C.block_size
    # The next load on this consumer still verifies.
    preq, params = prefill(P, prompt_of(PROMPT, seed=4))
    load(C, P, preq, params)
    assert stats(C) == {"verified": 1}


def test_preempted_producer_still_sends_checksums_that_verify():
    P = make_side("kv_producer", fail_closed=True)
    C = make_side("kv_consumer", fail_closed=True)
    long_prompt = prompt_of(2 * PROMPT, seed=2)
    req = make_request(long_prompt, remote_decode=True)
    P.scheduler.add_request(req)
    P.scheduler.max_num_scheduled_tokens = 64  # a chunked prefill
    forward = forward_of(P, req)
    P.step(forward=forward)
    assert 0 < req.num_computed_tokens < len(long_prompt), req.num_computed_tokens
    # Preempted mid-prefill (as under memory pressure), then prefilled again.
    P.scheduler.running.remove(req)  # the caller pops it, as schedule() does
    P.scheduler._preempt_request(req, 0.0)
    assert req.status is RequestStatus.PREEMPTED and req.num_computed_tokens == 0
    params = None
    for _ in range(8):
        _, outputs = P.step(forward=forward)
        if req.request_id in outputs and outputs[req.request_id].kv_transfer_params is not None:
            params = outputs[req.request_id].kv_transfer_params
            break
    assert params is not None and "kv_checksums" in params
    assert stats(P) == {"sent": 1}
    load(C, P, req, params)
    assert stats(C) == {"verified": 1}
