"""Another request's KV never verifies: real producer and consumer schedulers.

pd_harness writes KV that depends on the layer, head and position only, not
on the prompt, so two prompts of one length have the same KV and the same
checksum values: the case an operator hits when a transfer pairs a load with
another request (NIXL push pairs by X-Request-Id; a client reusing an id, a
retry with an edited prompt). Only the binding of the checksums to the
request's tokens (core/binding.py) tells them apart. Every carrier runs
(pull: kv_transfer_params; push and Mooncake: the connector's messages).
"""

from __future__ import annotations

import base64

import msgpack
import numpy as np
import pytest

from pd_harness import CONNECTORS, carrier_maker, load, prefill, prompt_of, run_local, stats

from vllm_kvchecksum.core.binding import TokenContent
from vllm_kvchecksum.core.payload import KVChecksumPayload
from vllm_kvchecksum.engine import metrics

PROMPT = 77  # 4 full 16-token blocks and a partial one


@pytest.fixture(params=sorted(CONNECTORS))
def make(request):
    return carrier_maker(request.param)


def edited(prompt: list[int], token: int) -> list[int]:
    other = list(prompt)
    other[token] += 1
    return other


def decoded(params) -> KVChecksumPayload:
    data = params["kv_checksums"]
    return KVChecksumPayload.from_bytes(data) if isinstance(data, (bytes, bytearray)) else \
        KVChecksumPayload.decode(data)


def test_the_producer_binds_what_it_sends_to_its_prompt(make):
    P = make("kv_producer", fail_closed=True)
    prompt = prompt_of(PROMPT)
    _, params = prefill(P, prompt)
    binding = decoded(params).binding
    assert binding is not None and binding.block_size == 16
    assert np.array_equal(binding.values, TokenContent(prompt).block_bindings(16, PROMPT))


@pytest.mark.parametrize("fail_closed", [True, False])
def test_another_prompts_kv_with_its_checksums_is_a_mismatch_of_its_own_cause(fail_closed, logs, make):
    P = make("kv_producer", fail_closed=True)
    C = make("kv_consumer", fail_closed=fail_closed)
    prompt = prompt_of(PROMPT)
    preq, params = prefill(P, prompt)
    # The consumer's request differs from token 40 (block 2) on; it receives
    # the producer's KV and checksums, whose values match that KV.
    result = load(C, P, preq, params, prompt=edited(prompt, 40))
    assert stats(C) == {"mismatch": 1}, logs.text
    assert "another request's KV at block positions 2-4" in logs.text
    assert "tokens [32, 48)" in logs.text
    assert C.reported_metrics[metrics.labelled(metrics.MISMATCH_CAUSES, "wrong_request")] == 1
    assert C.reported_metrics[metrics.labelled(metrics.MISMATCH_CAUSES, "corrupt")] == 0
    if fail_closed:
        assert result.request.is_finished()
    else:
        assert not result.request.is_finished()


def test_a_corrupt_load_is_counted_corrupt(logs, make):
    P = make("kv_producer", fail_closed=True)
    C = make("kv_consumer", fail_closed=True)
    preq, params = prefill(P, prompt_of(PROMPT))
    load(C, P, preq, params, tamper=lambda req: C.corrupt(req.request_id, position=1))
    assert stats(C) == {"mismatch": 1}, logs.text
    assert C.reported_metrics[metrics.labelled(metrics.MISMATCH_CAUSES, "corrupt")] == 1
    assert "another request" not in logs.text


def test_a_difference_inside_the_local_hit_fails_every_loaded_block(logs, make):
    P = make("kv_producer", fail_closed=True)
    C = make("kv_consumer", fail_closed=True)
    prompt = prompt_of(PROMPT)
    ours = edited(prompt, 3)
    run_local(C, ours[:32])
    preq, params = prefill(P, prompt)
    load(C, P, preq, params, num_local=32, prompt=ours)
    assert stats(C) == {"mismatch": 1}, logs.text
    assert "another request's KV at block positions 2-4" in logs.text


def as_version_1(version, body):
    """What a producer of the previous release sends: no binding, three body fields."""
    return 1, body[:3]


def without_binding(version, body):
    """A payload a client stripped of its binding."""
    return version, body[:4] + [None]


@pytest.mark.parametrize("edit, fail_closed, reason, logged", [
    (as_version_1, False, "payload_version", "payload version 1 is not supported"),
    (without_binding, True, "not_bound", "the producer's checksums name no request content"),
], ids=["previous-version", "stripped-binding"])
def test_a_payload_without_a_usable_binding_is_unverified_with_its_reason(edit, fail_closed, reason, logged, logs):
    make = carrier_maker("pull")
    P = make("kv_producer", fail_closed=True)
    C = make("kv_consumer", fail_closed=fail_closed)
    preq, params = prefill(P, prompt_of(PROMPT))
    edited_payload = edit(*msgpack.unpackb(base64.b64decode(params["kv_checksums"])))
    text = base64.b64encode(msgpack.packb(edited_payload, use_bin_type=True)).decode()
    load(C, P, preq, {**params, "kv_checksums": text})
    assert stats(C) == {"unverified": 1}, logs.text
    assert C.reported_metrics[metrics.labelled(metrics.UNVERIFIED, reason)] == 1
    assert logged in logs.text


# -- NIXL push: two live requests with one X-Request-Id --------------------------


def push_ids(monkeypatch, *suffixes):
    """The next requests pd_harness makes get ids "req-dup-<suffix>": one X-Request-Id, vLLM's random suffixes."""
    import pd_harness

    monkeypatch.setattr(pd_harness, "_ids", iter([f"dup-{s}" for s in suffixes]))


def test_a_push_producer_refuses_the_second_live_request_with_one_id(logs, monkeypatch):
    make = carrier_maker("push")
    P = make("kv_producer", fail_closed=True)
    push_ids(monkeypatch, "0a1b2c3d", "4e5f6a7b")
    first, params_1 = prefill(P, prompt_of(PROMPT))
    # The first request's blocks wait for its consumer's registration: still live.
    second, params_2 = prefill(P, prompt_of(PROMPT, seed=5))
    assert "kv_checksums" in params_1 and "kv_checksums" not in params_2
    assert stats(P) == {"sent": 1, "not_sent": 1}
    assert P.reported_metrics[metrics.labelled(metrics.NOT_SENT, "duplicate_request_id")] == 1
    assert "request 'req-dup-4e5f6a7b' shares its X-Request-Id 'req-dup' with live request 'req-dup-0a1b2c3d'" \
        in logs.text
    # Once the first request's blocks are freed, the id is free again.
    P.scheduler.kv_checksum.release_send(first.request_id)
    P.scheduler.kv_checksum.release_send(second.request_id)
    push_ids(monkeypatch, "8c9d0e1f")
    _, params_3 = prefill(P, prompt_of(PROMPT, seed=6))
    assert "kv_checksums" in params_3


def test_a_pull_producer_does_not_pair_by_id(monkeypatch):
    make = carrier_maker("pull")
    P = make("kv_producer", fail_closed=True)
    push_ids(monkeypatch, "0a1b2c3d", "4e5f6a7b")
    prefill(P, prompt_of(PROMPT))
    _, params = prefill(P, prompt_of(PROMPT, seed=5))
    assert "kv_checksums" in params and stats(P) == {"sent": 2}


def test_a_push_consumer_refuses_a_second_live_load_with_one_id(logs, monkeypatch):
    from pd_harness import make_request

    make = carrier_maker("push")
    P = make("kv_producer", fail_closed=True)
    C = make("kv_consumer", fail_closed=True)
    prompt = prompt_of(PROMPT)
    preq, params = prefill(P, prompt)
    carried = params.pop("kv_checksums")
    push_ids(monkeypatch, "0a1b2c3d", "4e5f6a7b")
    loads = []
    for _ in range(2):
        req = make_request(prompt, params=dict(params), block_size=C.block_size)
        C.scheduler.add_request(req)
        C.step()
        assert req.status.name == "WAITING_FOR_REMOTE_KVS"
        C.write_tokens(req.request_id, 0, req.num_computed_tokens, source=P, source_id=preq.request_id)
        loads.append(req)
    ids = {r.request_id for r in loads}
    C.step(finished_recving=ids, received={r.request_id: carried for r in loads})
    # The first load verifies; the second is refused, by its own reason, and fails (fail-closed).
    assert stats(C) == {"verified": 1, "unverified": 1}, logs.text
    assert C.reported_metrics[metrics.labelled(metrics.UNVERIFIED, "duplicate_request_id")] == 1
    assert loads[1].is_finished() and not loads[0].is_finished()
    assert "request 'req-dup-4e5f6a7b' shares its X-Request-Id 'req-dup'" in logs.text
    # Both loads are over: the id is free for the next one.
    push_ids(monkeypatch, "8c9d0e1f")
    load(C, P, preq, {**params, "kv_checksums": carried})
    assert stats(C) == {"verified": 2, "unverified": 1}, logs.text


def test_live_ids_keep_the_first_request_and_free_the_id_with_it():
    from vllm_kvchecksum.engine.push_ids import LiveIds

    live = LiveIds()
    assert live.add("a-0a1b2c3d") is None
    assert live.add("a-0a1b2c3d") is None  # the same request again (preempted, rescheduled)
    assert live.add("a-4e5f6a7b") == "a-0a1b2c3d"
    assert live.add("b-4e5f6a7b") is None  # another id
    live.remove("a-4e5f6a7b")  # the refused one leaving frees nothing
    assert live.add("a-99999999") == "a-0a1b2c3d"
    live.remove("a-0a1b2c3d")
    assert live.add("a-99999999") is None
    assert len(live) == 2


def test_a_vllm_requests_content_is_read_as_its_block_hashes_would_see_it():
    """request_content reads the token ids, the LoRA name (not its path), the cache salt, the
    multimodal identifiers and placeholders and the embedding rows of a vLLM Request."""
    from types import SimpleNamespace

    import torch
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from vllm_kvchecksum.engine.request_binding import request_content

    def request(prompt=None, lora=None, salt=None):
        return Request(request_id="r", prompt_token_ids=prompt or prompt_of(40), sampling_params=SamplingParams(),
                       pooling_params=None, lora_request=lora, cache_salt=salt)

    def runs(req):
        return request_content(req).block_bindings(16, 40).tolist()

    base = runs(request())
    assert runs(request()) == base
    assert runs(request(prompt=edited(prompt_of(40), 39)))[:2] == base[:2]
    assert runs(request(prompt=edited(prompt_of(40), 39)))[2] != base[2]
    named = runs(request(lora=LoRARequest("adapter", 1, "/mnt/a")))
    assert named != base
    assert runs(request(lora=LoRARequest("adapter", 2, "/elsewhere/a"))) == named  # the path may differ per host
    assert runs(request(salt="tenant-1")) not in (base, runs(request(salt="tenant-2")))

    def fake(mm=(), embeds=None):
        return SimpleNamespace(all_token_ids=prompt_of(40), lora_request=None, cache_salt=None, mm_features=[
            SimpleNamespace(mm_position=SimpleNamespace(offset=o, length=n), identifier=i) for o, n, i in mm],
            prompt_embeds=embeds)

    assert runs(fake()) == base  # read through all_token_ids as well
    image = runs(fake(mm=[(8, 10, "img-a")]))
    assert image[0] != base[0] and image[2] == base[2]
    assert runs(fake(mm=[(8, 10, "img-b")])) != image
    rows = torch.arange(40 * 6, dtype=torch.float32).reshape(40, 6).to(torch.bfloat16)
    with_rows = runs(fake(embeds=rows))
    changed = rows.clone()
    changed[39, 5] += 1
    assert with_rows != base and runs(fake(embeds=changed))[:2] == with_rows[:2]
    assert runs(fake(embeds=changed))[2] != with_rows[2]


def test_binding_a_payload_keeps_everything_else_and_every_embedding_byte_counts():
    import torch

    from types import SimpleNamespace

    from vllm_kvchecksum.core.payload import PayloadGroup
    from vllm_kvchecksum.engine.request_binding import bind_payload, embedding_digests

    payload = KVChecksumPayload(num_tokens=40, producer_tp_size=2,
                                groups={0: PayloadGroup(9, 16, 0, np.arange(3, dtype=np.uint64)),
                                        3: PayloadGroup(4, 32, 0, np.arange(2, dtype=np.uint64))},
                                tp_local_groups={3})
    bound = bind_payload(payload, SimpleNamespace(all_token_ids=prompt_of(40)))
    assert (bound.num_tokens, bound.producer_tp_size, bound.groups, bound.tp_local_groups) == \
        (40, 2, payload.groups, frozenset({3}))
    assert bound.binding.block_size == 16  # the smallest group block size
    assert bound.binding.values.tolist() == TokenContent(prompt_of(40)).block_bindings(16, 40).tolist()
    rows = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6).to(torch.bfloat16)
    digests = embedding_digests(rows)
    for col in range(6):
        changed = rows.clone()
        changed[2, col] += 1
        after = embedding_digests(changed)
        assert after[2] != digests[2] and np.array_equal(np.delete(after, 2), np.delete(digests, 2)), col
