"""Verified loads: a real producer scheduler and a real consumer scheduler.

Both sides run the patched vLLM Scheduler with a real connector's scheduler
half and real KVChecksumWorkers over CPU caches; see pd_harness for what
stands in for the model and the transfer. The cases run for every carrier
(the `make` fixture): NIXL pull, whose checksums ride kv_transfer_params,
and NIXL push, whose producer scheduler ships them in its connector
metadata and whose consumer workers report them with the finished load.
"""

from __future__ import annotations

import base64
import logging

import msgpack
import pytest
import torch

from pd_harness import (CONNECTORS, carrier_maker, load, make_side, prefill, prompt_of, run_local,
                        series_lacks_first_bad_block_rollback, stats)

PROMPT = 77  # 4 full 16-token blocks and a partial one


@pytest.fixture(params=sorted(CONNECTORS))
def make(request):
    """make_side for the case's carrier (pull, push, ...)."""
    return carrier_maker(request.param)


@pytest.mark.parametrize("producer,consumer", [
    ((1, 1), (1, 1)), ((2, 1), (1, 1)), ((1, 1), (2, 1)), ((1, 1), (4, 1)), ((1, 2), (1, 1)), ((1, 1), (2, 2)),
], ids=lambda tp_pp: f"tp{tp_pp[0]}pp{tp_pp[1]}")
def test_correct_loads_verify_across_tp_pp(producer, consumer, logs, make):
    # At TP4 the consumer's 2 KV heads are replicated on two ranks each.
    heads = 2 if consumer[0] == 4 else 4
    P = make("kv_producer", *producer, heads=heads, fail_closed=True)
    C = make("kv_consumer", *consumer, heads=heads, fail_closed=True)
    preq, params = prefill(P, prompt_of(PROMPT))
    assert "kv_checksums" in params
    assert stats(P) == {"sent": 1}
    result = load(C, P, preq, params)
    assert stats(C) == {"verified": 1}, logs.text
    assert result.next_scheduled == 1  # the last prompt token, then decode
    assert "mismatch" not in logs.text


def test_local_prefix_hit_compares_only_loaded_blocks(logs, make):
    P = make("kv_producer", fail_closed=True)
    C = make("kv_consumer", fail_closed=True)
    prompt = prompt_of(PROMPT)
    run_local(C, prompt[:32])
    preq, params = prefill(P, prompt)

    def differ_locally(req):
        # The consumer's own KV of blocks 0-1 (its prefix-cache hit, which
        # the load does not write) need not equal the producer's: make it
        # differ in every layer, so comparing them would be a false mismatch.
        local_blocks = C.scheduler.kv_cache_manager.get_block_ids(req.request_id)[0][:2]
        for w in C.workers:
            for cache in w.caches.values():
                for block in local_blocks:
                    cache[block].view(torch.uint8)[..., 5] ^= 0x21

    result = load(C, P, preq, params, num_local=32, tamper=differ_locally)
    assert result.request.num_computed_tokens >= PROMPT - 1
    assert stats(C) == {"verified": 1}, logs.text
    assert result.next_scheduled == 1


def corrupt(C):
    return lambda req: C.corrupt(req.request_id, position=2)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_corrupted_byte_fail_closed(policy, logs, make):
    P = make("kv_producer", fail_closed=True)
    C = make("kv_consumer", fail_closed=True, policy=policy)
    preq, params = prefill(P, prompt_of(PROMPT))
    result = load(C, P, preq, params, tamper=corrupt(C))
    assert stats(C) == {"mismatch": 1}
    assert "KV checksum mismatch for request" in logs.text and "block" in logs.text
    if policy == "fail":
        out = result.outputs[result.request.request_id]
        assert out.finish_reason is not None and out.finish_reason.name == "ERROR"
        assert out.stop_reason.startswith("kv_checksum_mismatch")
        assert result.request.is_finished()
    else:
        assert not result.request.is_finished()
        # Recomputed locally from the bad block 2 (the verified blocks 0-1
        # stay), not loaded again.
        assert result.next_scheduled == PROMPT - (0 if series_lacks_first_bad_block_rollback() else 32)
        assert not result.request.kv_transfer_params.get("do_remote_prefill")
        # Recomputed, not ended: no checksum reason is left on it to reach the
        # client when it finishes normally.
        assert result.request.stop_reason is None


def test_corrupted_byte_fail_open_is_logged_and_used(logs, make):
    P = make("kv_producer")
    C = make("kv_consumer")
    preq, params = prefill(P, prompt_of(PROMPT))
    result = load(C, P, preq, params, tamper=corrupt(C))
    assert stats(C) == {"mismatch": 1}
    assert any(r.levelno == logging.ERROR and "mismatch" in r.getMessage() for r in logs.records)
    assert result.next_scheduled == 1


@pytest.mark.parametrize("policy,fail_closed", [("fail", True), ("recompute", True), ("fail", False)])
def test_missing_checksums_are_unverified(policy, fail_closed, logs, make):
    P = make("kv_producer")
    C = make("kv_consumer", fail_closed=fail_closed, policy=policy)
    preq, params = prefill(P, prompt_of(PROMPT))
    params.pop("kv_checksums")
    result = load(C, P, preq, params)
    assert stats(C) == {"unverified": 1}
    assert "no_producer_checksums" in logs.text
    if not fail_closed:
        assert result.next_scheduled == 1
    elif policy == "fail":
        assert result.outputs[result.request.request_id].stop_reason.startswith("kv_checksum_unverified")
    else:
        assert result.next_scheduled == PROMPT


def nested(depth):
    """msgpack of [[[...0...]]], nested `depth` deep (built by hand: the packer refuses it)."""
    return b"\x91" * depth + b"\x00"


@pytest.mark.parametrize("bad", [
    "", "not base64!", base64.b64encode(b"\xc1").decode(), base64.b64encode(nested(5000)).decode(),
    base64.b64encode(msgpack.packb([2, [1, 1, []]])).decode(), 12345, ["list"], {"a": 1},
], ids=["empty", "text", "bad-msgpack", "deep", "version-2", "int", "list", "dict"])
def test_malformed_payloads_never_raise(bad, logs):
    P = make_side("kv_producer")
    C = make_side("kv_consumer", fail_closed=True, policy="recompute")
    preq, params = prefill(P, prompt_of(PROMPT))
    params["kv_checksums"] = bad
    result = load(C, P, preq, params)
    assert stats(C) == {"unverified": 1}
    assert result.next_scheduled == PROMPT


def skip_group(side, gid):
    """The workers cannot checksum group `gid` (as for SSM state): reported skipped."""
    for w in side.workers:
        w.checksums.skipped_groups[gid] = "skipped by the test"
        w.checksums.fingerprints.pop(gid, None)
        w.checksums._active.remove(gid)


def test_group_skipped_on_both_sides_is_ignored(logs, make):
    P = make("kv_producer", sliding_window=48, fail_closed=True)
    C = make("kv_consumer", sliding_window=48, fail_closed=True)
    skip_group(P, 1)
    skip_group(C, 1)
    preq, params = prefill(P, prompt_of(PROMPT))
    load(C, P, preq, params)
    assert stats(C) == {"verified": 1}, logs.text


@pytest.mark.parametrize("side", ["producer", "consumer"])
def test_group_skipped_on_one_side_is_unverified(side, logs, make):
    P = make("kv_producer", sliding_window=48)
    C = make("kv_consumer", sliding_window=48, fail_closed=True)
    skip_group(P if side == "producer" else C, 1)
    preq, params = prefill(P, prompt_of(PROMPT))
    result = load(C, P, preq, params)
    assert stats(C) == {"unverified": 1}
    assert result.request.is_finished()


def test_sliding_window_group_verifies_and_catches_corruption(logs, make):
    P = make("kv_producer", sliding_window=48, fail_closed=True)
    C = make("kv_consumer", sliding_window=48, fail_closed=True, policy="recompute")
    preq, params = prefill(P, prompt_of(PROMPT))
    load(C, P, preq, params)
    assert stats(C) == {"verified": 1}, logs.text
    preq, params = prefill(P, prompt_of(PROMPT, seed=5))
    load(C, P, preq, params, tamper=lambda req: C.corrupt(req.request_id, group=1, position=4))
    assert stats(C) == {"verified": 1, "mismatch": 1}


@pytest.mark.parametrize("bs_p,bs_c", [(16, 32), (32, 16)])
def test_different_block_sizes(bs_p, bs_c, logs, make):
    P = make("kv_producer", block_size=bs_p, fail_closed=True)
    C = make("kv_consumer", block_size=bs_c, fail_closed=True, policy="recompute")
    preq, params = prefill(P, prompt_of(PROMPT))
    load(C, P, preq, params)
    assert stats(C) == {"verified": 1}, logs.text
    preq, params = prefill(P, prompt_of(PROMPT, seed=3))
    load(C, P, preq, params, tamper=lambda req: C.corrupt(req.request_id, position=1))
    assert stats(C) == {"verified": 1, "mismatch": 1}


def test_unaligned_smaller_consumer_blocks_are_unverified(logs, make):
    # Consumer blocks of 16 after a 16-token local hit start inside the
    # producer's first 32-token block: never a false verify.
    P = make("kv_producer", block_size=32)
    C = make("kv_consumer", block_size=16, fail_closed=True, policy="recompute")
    prompt = prompt_of(PROMPT)
    run_local(C, prompt[:16])
    preq, params = prefill(P, prompt)
    load(C, P, preq, params, num_local=16)
    assert stats(C) == {"unverified": 1}
    assert "unaligned_first_block" in logs.text


def test_connector_without_carrier(tmp_path, logs):
    from vllm_kvchecksum.engine.scheduler import KVChecksumConfigError

    extra = {"shared_storage_path": str(tmp_path)}
    with pytest.raises(KVChecksumConfigError, match="cannot carry KV checksums"):
        make_side("kv_consumer", connector="ExampleConnector", fail_closed=True, connector_extra=extra)
    side = make_side("kv_consumer", connector="ExampleConnector", connector_extra=extra)
    assert side.scheduler.kv_checksum is None
    assert "KV checksums are disabled" in logs.text


def test_checksums_off_adds_nothing():
    P = make_side("kv_producer", enable=False)
    assert P.scheduler.kv_checksum is None
    preq, params = prefill(P, prompt_of(PROMPT))
    assert "kv_checksums" not in params


