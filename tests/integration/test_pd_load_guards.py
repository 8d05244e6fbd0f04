"""P/D loads in the cases the verified-loads tests miss.

Real vLLM Schedulers with real connector scheduler halves and real
KVChecksumWorkers (pd_harness, hybrid_harness): checksums a connector-owned
carrier delivers before the load finishes, the one reason an unverified load
is counted under when its groups give several, and a payload that puts a
Mamba state anywhere but position 0.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hybrid_harness import MAMBA_GROUP, make_hybrid_side
from pd_harness import CONNECTORS, load, make_request, make_side, prefill, prompt_of, series_lacks, stats

from vllm_kvchecksum.core.payload import KVChecksumPayload

PROMPT = 77  # 4 full 16-token blocks and a partial one


@pytest.mark.parametrize("mode", ["push", "mooncake"])
def test_checksums_delivered_before_the_load_finishes_are_kept(mode, logs):
    """A connector-owned carrier hands a worker the producer's checksums in a
    step before that worker reports the load finished: the worker passes
    them on at once (it would not have them later), and the load verifies."""
    if (reason := series_lacks(mode)) is not None:
        pytest.skip(reason)
    P = make_side("kv_producer", connector=CONNECTORS[mode])
    C = make_side("kv_consumer", connector=CONNECTORS[mode], fail_closed=True)
    preq, params = prefill(P, prompt_of(PROMPT))
    carried = params.pop("kv_checksums")
    req = make_request(preq.prompt_token_ids, params=params, block_size=C.block_size)
    C.scheduler.add_request(req)
    C.step()
    assert req.status.name == "WAITING_FOR_REMOTE_KVS", req.status
    C.step(received={req.request_id: carried})  # the checksums, ahead of the KV
    assert req.status.name == "WAITING_FOR_REMOTE_KVS" and stats(C) == {}
    C.write_tokens(req.request_id, 0, req.num_computed_tokens, source=P, source_id=preq.request_id)
    C.step(finished_recving={req.request_id})
    assert stats(C) == {"verified": 1}, logs.text
    out, _ = C.step()
    assert out.num_scheduled_tokens.get(req.request_id) == 1


def _payload_with(params: dict, change) -> dict:
    payload = KVChecksumPayload.decode(params["kv_checksums"])
    groups = change(dict(payload.groups))
    payload = KVChecksumPayload(payload.num_tokens, payload.producer_tp_size, groups,
                                frozenset(payload.tp_local_groups) & set(groups))
    return {**params, "kv_checksums": payload.encode()}


def _other_fingerprint(groups, gid):
    groups[gid] = replace(groups[gid], fingerprint=groups[gid].fingerprint ^ 1)
    return groups


@pytest.mark.parametrize("changed, dropped, label", [
    (0, 1, "fingerprint_differs"),
    (1, 0, "not_checksummed_by_producer"),
])
def test_unverified_load_is_counted_under_its_first_groups_reason(changed, dropped, label, logs):
    """Two groups unverified for different reasons (one group's fingerprint
    changed, the other absent from the payload): the load is counted once,
    under its first group's reason, and both reasons are logged."""
    P = make_side("kv_producer", sliding_window=48)
    C = make_side("kv_consumer", sliding_window=48, fail_closed=True, policy="recompute")
    preq, params = prefill(P, prompt_of(PROMPT))

    def change(groups):
        groups = _other_fingerprint(groups, changed)
        del groups[dropped]
        return groups

    load(C, P, preq, _payload_with(params, change))
    assert stats(C) == {"unverified": 1}, logs.text
    verdicts = {k: v for k, v in C.reported_metrics.items() if k.startswith("loads_") and "recomputed" not in k}
    assert verdicts == {f"loads_unverified/{label}": 1}
    assert "KV loads are unverified (fingerprint_differs)" in logs.text
    assert "KV loads are unverified (not_checksummed_by_producer)" in logs.text


@pytest.mark.parametrize("start", [1, 4])
def test_state_value_at_another_position_is_unverified(start, logs):
    """A Mamba state is one value at position 0 on both sides. A payload
    (from the client, in pull mode) whose state group starts elsewhere is
    not compared, though its value is the right one: unverified, and
    fail-closed the request fails with that reason."""
    if (reason := series_lacks("pull")) is not None:
        pytest.skip(reason)
    P = make_hybrid_side("kv_producer", connector=CONNECTORS["pull"], fail_closed=True, junk=1)
    C = make_hybrid_side("kv_consumer", connector=CONNECTORS["pull"], fail_closed=True, junk=2)
    preq, params = prefill(P, prompt_of(PROMPT))

    def move_state(groups):
        groups[MAMBA_GROUP] = replace(groups[MAMBA_GROUP], start=start)
        return groups

    result = load(C, P, preq, _payload_with(params, move_state), prompt=prompt_of(PROMPT))
    assert stats(C) == {"unverified": 1}, logs.text
    assert f"the producer sent 1 values from position {start} for a state group" in logs.text
    assert dict(C.reported_metrics) == {"loads_unverified/no_common_blocks": 1}
    req = result.request
    assert req.is_finished() and result.outputs[req.request_id].finish_reason.name == "ERROR"
    assert req.stop_reason.startswith("kv_checksum_unverified: no_common_blocks"), req.stop_reason
