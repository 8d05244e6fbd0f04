"""Verified loads of a hybrid model's Mamba state, on real schedulers and workers.

The sides are hybrid_harness's: attention layers and Mamba2 layers, align
mode with prefix caching, one speculative scratch block per request. Each
case runs for every carrier (NIXL pull, NIXL push, Mooncake P2P).
"""

from __future__ import annotations

import pytest
from hybrid_harness import MAMBA_GROUP, Mamba2Layer, make_hybrid_side, running_state_block
from pd_harness import (CONNECTORS, carrier_maker, load, prefill, prompt_of, series_lacks_producer_tp_size,
                        stats)

PROMPT = 77


@pytest.fixture(params=sorted(CONNECTORS))
def make(request):
    return carrier_maker(request.param, make_hybrid_side)


def verdict_groups(logs) -> str:
    return logs.text


@pytest.mark.parametrize("split", [False, True], ids=["unsplit", "split"])
def test_correct_state_load_verifies_and_flipped_bit_is_a_mismatch(split, logs, make):
    model = Mamba2Layer(split=split)
    P = make("kv_producer", model=model, fail_closed=True, junk=1)
    C = make("kv_consumer", model=model, fail_closed=True, junk=2)
    preq, params = prefill(P, prompt_of(PROMPT))
    assert stats(P) == {"sent": 1}
    result = load(C, P, preq, params, prompt=prompt_of(PROMPT))
    assert stats(C) == {"verified": 1}, logs.text
    assert f"group {MAMBA_GROUP} verified (1 blocks compared)" in logs.text

    C2 = make("kv_consumer", model=model, fail_closed=True, junk=3)
    preq2, params2 = prefill(P, prompt_of(PROMPT, seed=1))
    load(C2, P, preq2, params2, prompt=prompt_of(PROMPT, seed=1), tamper=lambda req: C2.state_page(req.request_id).__setitem__(
        5, C2.state_page(req.request_id)[5] ^ 0x10))
    assert stats(C2) == {"mismatch": 1}, logs.text
    assert f"group {MAMBA_GROUP} differs at block positions 0" in logs.text


def flip_state_bit(side, offset: int = 5, worker: int = -1):
    """A tamper that flips one bit of a worker's layer-1 running state."""
    def tamper(req):
        page = side.state_page(req.request_id, worker)
        page[offset] ^= 0x10
    return tamper


@pytest.mark.parametrize("tps", [(1, 2), (2, 1)], ids=["tp1-tp2", "tp2-tp1"])
def test_state_without_a_tp_split_is_left_out_between_tp_sizes(tps, logs, make):
    # The attention group still verifies the load, fail-closed; the state,
    # whose slices follow each rank's bytes, is not compared (even corrupted).
    model = Mamba2Layer(split=False)
    P = make("kv_producer", tps[0], model=model, fail_closed=True, junk=1)
    C = make("kv_consumer", tps[1], model=model, fail_closed=True, junk=2)
    preq, params = prefill(P, prompt_of(PROMPT))
    result = load(C, P, preq, params, prompt=prompt_of(PROMPT), tamper=flip_state_bit(C))
    assert stats(C) == {"verified": 1, "groups_left_out_tp": 1}, logs.text
    assert result.next_scheduled == 1
    assert "KV cache groups [1] are not compared" in logs.text
    assert f"group {MAMBA_GROUP} " not in logs.text.split("verified:")[-1]


@pytest.mark.parametrize("tps", [(1, 1), (1, 2), (2, 1), (2, 2)], ids=lambda t: f"tp{t[0]}-tp{t[1]}")
@pytest.mark.parametrize("dim_first", [True, False], ids=["dim-first", "dim-last"])
def test_tp_split_state_verifies_across_tp_sizes(tps, dim_first, logs, make):
    model = Mamba2Layer(n_groups=1, dim_first=dim_first)
    P = make("kv_producer", tps[0], model=model, fail_closed=True, junk=1)
    C = make("kv_consumer", tps[1], model=model, fail_closed=True, junk=2)
    preq, params = prefill(P, prompt_of(PROMPT))
    seen = {}

    def check_block(req):
        ids = C.scheduler.kv_cache_manager.get_block_ids(req.request_id)[MAMBA_GROUP]
        seen["scheduled"] = C.scheduler.kv_checksum._recvs[req.request_id].blocks.groups[MAMBA_GROUP].block_ids
        seen["running"] = (running_state_block(ids),)

    result = load(C, P, preq, params, prompt=prompt_of(PROMPT), tamper=check_block)
    assert seen["scheduled"] == seen["running"]
    assert stats(C) == {"verified": 1}, logs.text
    assert f"group {MAMBA_GROUP} verified (1 blocks compared)" in logs.text
    assert result.next_scheduled == 1


@pytest.mark.parametrize("tps", [(1, 2), (2, 1), (2, 2)], ids=lambda t: f"tp{t[0]}-tp{t[1]}")
@pytest.mark.parametrize("n_groups", [1, 2])
def test_flipped_bit_in_last_consumer_ranks_b_is_a_mismatch(tps, n_groups, logs, make):
    model = Mamba2Layer(n_groups=n_groups)
    P = make("kv_producer", tps[0], model=model, fail_closed=True, junk=1)
    C = make("kv_consumer", tps[1], model=model, fail_closed=True, junk=2)
    preq, params = prefill(P, prompt_of(PROMPT))
    load(C, P, preq, params, prompt=prompt_of(PROMPT), tamper=flip_state_bit(C, C.b_row_offset(), worker=-1))
    assert stats(C) == {"mismatch": 1}, logs.text
    assert f"group {MAMBA_GROUP} differs at block positions 0" in logs.text
    assert "group 0 verified" in logs.text


@pytest.mark.parametrize("split_side", ["producer", "consumer"])
def test_state_tp_local_on_one_side_only_is_not_left_out(split_side, logs, make):
    # Version skew: one side's layers describe their split, the other's do
    # not. Between different TP sizes the group must not be left out (that
    # would verify the load on attention alone): it is unverified.
    P = make("kv_producer", 1, model=Mamba2Layer(split=split_side == "producer"), fail_closed=True, junk=1)
    C = make("kv_consumer", 2, model=Mamba2Layer(split=split_side == "consumer"), fail_closed=True, junk=2)
    preq, params = prefill(P, prompt_of(PROMPT))
    load(C, P, preq, params, prompt=prompt_of(PROMPT))
    assert stats(C) == {"unverified": 1}, logs.text
    assert "fingerprint_differs" in logs.text


def _with_producer_tp_size(params: dict, tp_size: int) -> dict:
    """The params with the checksums' producer TP size changed (text or bytes, as carried)."""
    from dataclasses import replace

    from vllm_kvchecksum.core.payload import KVChecksumPayload

    carried = params["kv_checksums"]
    if isinstance(carried, str):
        forged = replace(KVChecksumPayload.decode(carried), producer_tp_size=tp_size).encode()
    else:
        forged = replace(KVChecksumPayload.from_bytes(carried), producer_tp_size=tp_size).to_bytes()
    return {**params, "kv_checksums": forged}


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_payload_claiming_another_tp_size_does_not_switch_the_state_comparison_off(mode, logs):
    """TP 1 on both sides, state without a TP split, a flipped state bit, and
    checksums that claim the producer ran TP 2 (in pull mode a client can
    write that): the state group would be left out and the load verified.
    NixlConnector says which TP size it transfers from, so the load is
    unverified instead. (Mooncake's scheduler does not know the producer's
    TP size; its checksums come from the producer itself, not a client.)"""
    make = carrier_maker(mode, make_hybrid_side)
    if series_lacks_producer_tp_size():
        pytest.skip("connectors say the producer's TP size from a later patch of the series on")
    model = Mamba2Layer(split=False)
    P = make("kv_producer", model=model, fail_closed=True, junk=1)
    C = make("kv_consumer", model=model, fail_closed=True, junk=2)
    preq, params = prefill(P, prompt_of(PROMPT))
    result = load(C, P, preq, _with_producer_tp_size(params, 2), prompt=prompt_of(PROMPT),
                  tamper=flip_state_bit(C))
    assert stats(C) == {"unverified": 1}, logs.text
    out = result.outputs[result.request.request_id]
    assert out.finish_reason.name == "ERROR" and "producer_tp_size_differs" in out.stop_reason
