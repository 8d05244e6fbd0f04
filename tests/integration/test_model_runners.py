"""A load checksummed through each model runner's own KV connector path
reaches the scheduler and is verified there (and a corrupted one is caught);
a producer with a drafter sends checksums from every PP rank."""

import pytest
import vllm.v1.worker.gpu_model_runner as gmr
from pd_harness import (ReportingConnector, forward_of, load, make_request, make_side, prefill, prompt_of,
                        runner_step, stats)
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.forward_context import set_forward_context

PROMPT = 77


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


class _PPRank:
    def __init__(self, is_last_rank: bool):
        self.is_last_rank = is_last_rank


def runner_for(side, worker, *, drafter: bool, monkeypatch):
    """A V1 GPUModelRunner as execute_model sees it on `worker`'s PP rank
    (no model: only the KV connector decisions are exercised)."""
    runner = object.__new__(gmr.GPUModelRunner)
    runner.speculative_config = object() if drafter else None
    runner.broadcast_pp_output = False
    runner.kv_checksum_worker = worker.checksums
    last = worker.pp_rank == max(w.pp_rank for w in side.workers)
    monkeypatch.setattr(gmr, "get_pp_group", lambda: _PPRank(last))
    return runner, last


def producer_forward_step(side, forward, monkeypatch, *, drafter=True):
    """One producer step through the V1 runner's forward path on every rank:
    the connector context around the forward, deferred finalization decided by
    the runner itself; a non-last PP rank returns right after the forward (as
    execute_model does), the last rank drafts and then finalizes."""
    out = side.scheduler.schedule()
    forward(out)
    runner_outputs = []
    for w in side.workers:
        runner, last = runner_for(side, w, drafter=drafter, monkeypatch=monkeypatch)
        kv_transfer_state._KV_CONNECTOR_AGENT = ReportingConnector(side.scheduler.vllm_config,
                                                                   side.scheduler.kv_cache_config)
        try:
            with set_forward_context(None, side.scheduler.vllm_config), \
                    runner.maybe_get_kv_connector_output(
                        out, defer_finalize=runner._defers_kv_connector_finalize(),
                        kv_checksum_worker=runner.kv_checksum_worker) as kv_output:
                pass  # the forward
            if last and drafter:
                runner.finalize_kv_connector(out, kv_output, runner.kv_checksum_worker)
        finally:
            kv_transfer_state._KV_CONNECTOR_AGENT = None
        runner_outputs.append(side.runner_output(out, kv_output))
    return side.update(out, side.aggregator.aggregate(runner_outputs, 0))


@pytest.mark.parametrize("pp", [1, 2])
def test_v1_runner_with_drafter_sends_checksums_from_every_pp_rank(pp, monkeypatch, logs):
    # With a drafter, only the rank that drafts defers its finalization: if a
    # non-last PP rank deferred, it would never checksum the prompt, the
    # producer's sum would miss it, and every load would be unverified.
    P = make_side("kv_producer", pp=pp)
    C = make_side("kv_consumer", pp=pp, fail_closed=True)
    preq = make_request(prompt_of(PROMPT), remote_decode=True)
    P.scheduler.add_request(preq)
    params = None
    for _ in range(4):
        outputs = producer_forward_step(P, forward_of(P, preq), monkeypatch)
        if preq.request_id in outputs and outputs[preq.request_id].kv_transfer_params is not None:
            params = outputs[preq.request_id].kv_transfer_params
            break
    assert params is not None and "kv_checksums" in params, logs.text
    assert stats(P) == {"sent": 1}
    load(C, P, preq, params)
    assert stats(C) == {"verified": 1}, logs.text


def test_only_the_drafting_rank_defers_finalize(monkeypatch):
    runner = object.__new__(gmr.GPUModelRunner)
    for drafter, broadcast, last, defers in [(False, False, True, False), (True, False, True, True),
                                             (True, False, False, False), (True, True, False, True)]:
        runner.speculative_config = object() if drafter else None
        runner.broadcast_pp_output = broadcast
        monkeypatch.setattr(gmr, "get_pp_group", lambda last=last: _PPRank(last))
        assert runner._defers_kv_connector_finalize() is defers, (drafter, broadcast, last)
