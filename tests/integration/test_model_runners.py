"""A load checksummed through each model runner's own KV connector path
reaches the scheduler and is verified there (and a corrupted one is caught);
a producer with a drafter sends checksums from every PP rank."""

import inspect

import pd_harness
import pytest
from pd_harness import (ReportingConnector, forward_of, load, make_request, make_side, prefill, prompt_of,
                        runner_step, stats)
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.forward_context import set_forward_context

PROMPT = 77

# Model Runner V1 (vllm/v1/worker/gpu_model_runner.py) is gone since vLLM 0.34.
needs_v1 = pytest.mark.skipif("v1" not in pd_harness.MODEL_RUNNERS, reason="no Model Runner V1 in this vLLM")


def _v1_runner_module():
    import vllm.v1.worker.gpu_model_runner as gmr

    return gmr


@pytest.mark.parametrize("runner", pd_harness.MODEL_RUNNERS)
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
    gmr = _v1_runner_module()
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


@needs_v1
@pytest.mark.parametrize("pp", [1, 2])
def test_v1_runner_with_drafter_sends_checksums_from_every_pp_rank(pp, monkeypatch, logs):
    # With a drafter, only the rank that drafts defers its finalization: if a
    # non-last PP rank deferred, it would never checksum the prompt, the
    # producer's sum would miss it, and every load would be unverified.
    sent_and_verified(pp, lambda P, forward: producer_forward_step(P, forward, monkeypatch), logs)


def sent_and_verified(pp, producer_step, logs) -> None:
    """A producer request run through `producer_step(P, forward)` until it
    finishes sends checksums, and its consumer's load verifies."""
    P = make_side("kv_producer", pp=pp)
    C = make_side("kv_consumer", pp=pp, fail_closed=True)
    preq = make_request(prompt_of(PROMPT), remote_decode=True)
    P.scheduler.add_request(preq)
    params = None
    for _ in range(4):
        outputs = producer_step(P, forward_of(P, preq))
        if preq.request_id in outputs and outputs[preq.request_id].kv_transfer_params is not None:
            params = outputs[preq.request_id].kv_transfer_params
            break
    assert params is not None and "kv_checksums" in params, logs.text
    assert stats(P) == {"sent": 1}
    load(C, P, preq, params)
    assert stats(C) == {"verified": 1}, logs.text


@needs_v1
def test_only_the_drafting_rank_defers_finalize(monkeypatch):
    gmr = _v1_runner_module()
    runner = object.__new__(gmr.GPUModelRunner)
    for drafter, broadcast, last, defers in [(False, False, True, False), (True, False, True, True),
                                             (True, False, False, False), (True, True, False, True)]:
        runner.speculative_config = object() if drafter else None
        runner.broadcast_pp_output = broadcast
        monkeypatch.setattr(gmr, "get_pp_group", lambda last=last: _PPRank(last))
        assert runner._defers_kv_connector_finalize() is defers, (drafter, broadcast, last)


def _v2_defers_finalize() -> bool:
    from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

    return "defer_finalize" in inspect.signature(ActiveKVConnector.post_forward).parameters


def v2_producer_forward_step(side, forward, *, drafter=True):
    """One producer step through Model Runner V2's connector calls on every
    rank, in sample_tokens' order: a non-last PP rank runs post_forward right
    after its forward; the last rank, with a drafter, runs post_forward with
    defer_finalize, then the drafter (which writes KV: here the last rank's
    whole forward is written only then), then finalize_step."""
    from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

    out = side.scheduler.schedule()
    last_pp = max(w.pp_rank for w in side.workers)
    early = [w for w in side.workers if w.pp_rank != last_pp or not drafter]
    forward(out, workers=early)
    runner_outputs = []
    for w in side.workers:
        defer = drafter and w.pp_rank == last_pp
        kv_transfer_state._KV_CONNECTOR_AGENT = ReportingConnector(side.scheduler.vllm_config,
                                                                   side.scheduler.kv_cache_config)
        try:
            active = ActiveKVConnector(side.scheduler.vllm_config, w.caches)
            active.kv_checksum_worker = w.checksums
            with set_forward_context(None, side.scheduler.vllm_config):
                active.pre_forward(out)
                active.finish_forward()
            kv_output = active.post_forward(out.finished_req_ids, defer_finalize=defer)
            if defer:
                forward(out, workers=[w])  # the drafter writes its KV
                active.finalize_step()
        finally:
            kv_transfer_state._KV_CONNECTOR_AGENT = None
        runner_outputs.append(side.runner_output(out, kv_output))
    return side.update(out, side.aggregator.aggregate(runner_outputs, 0))


@pytest.mark.skipif(not _v2_defers_finalize(), reason="this vLLM's Model Runner V2 never defers its finalize")
@pytest.mark.parametrize("pp", [1, 2])
def test_v2_runner_with_drafter_checksums_sends_after_the_drafter(pp, logs):
    # The drafter writes KV after post_forward: the rank that drafts
    # checksums its sends in finalize_step, after those writes; a non-last
    # PP rank, which never defers, checksums them at once. Sends taken
    # before the drafter's writes mismatch on the consumer; sends never
    # taken leave the load unverified.
    sent_and_verified(pp, v2_producer_forward_step, logs)
