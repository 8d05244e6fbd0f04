"""A load checksummed through each model runner's own KV connector path
reaches the scheduler and is verified there (and a corrupted one is caught)."""

import logging

import pytest
from pd_harness import make_request, make_side, prefill, prompt_of, runner_step

PROMPT = 77


@pytest.fixture
def logs(caplog):
    logger = logging.getLogger("vllm.kv_checksum")
    logger.addHandler(caplog.handler)
    yield caplog
    logger.removeHandler(caplog.handler)


def stats(side):
    return dict(side.scheduler.kv_checksum.stats)


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_load_checksummed_through_each_model_runner_reaches_the_scheduler(runner, logs):
    P = make_side("kv_producer", tp=2)
    C = make_side("kv_consumer", tp=2, fail_closed=True, policy="recompute")
    preq, params = prefill(P, prompt_of(PROMPT))
    req = make_request(preq.prompt_token_ids, params=dict(params))
    C.scheduler.add_request(req)
    runner_step(C, runner)
    C.write_tokens(req.request_id, 0, req.num_computed_tokens, source=P, source_id=preq.request_id)
    runner_step(C, runner, finished_recving={req.request_id})
    assert stats(C) == {"verified": 1}, logs.text
    out, _ = runner_step(C, runner)
    assert out.num_scheduled_tokens.get(req.request_id) == 1
    # The same path catches a corrupted load.
    preq, params = prefill(P, prompt_of(PROMPT, seed=9))
    req = make_request(preq.prompt_token_ids, params=dict(params))
    C.scheduler.add_request(req)
    runner_step(C, runner)
    C.write_tokens(req.request_id, 0, req.num_computed_tokens, source=P, source_id=preq.request_id)
    C.corrupt(req.request_id, position=1, worker=0)
    runner_step(C, runner, finished_recving={req.request_id})
    assert stats(C) == {"verified": 1, "mismatch": 1}
