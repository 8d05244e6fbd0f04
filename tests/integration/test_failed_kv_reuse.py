"""What is kept of a load that failed its check, and who may use its KV.

A real producer scheduler and a real consumer scheduler (pd_harness). Under
kv_load_failure_policy "recompute" a mismatched load keeps its verified
prefix (the local prefix-cache hit and the loaded blocks before the first
bad one) and is recomputed from the first bad block; where that prefix is
not known good in every group (several KV cache groups, a payload that
compared less than was loaded, an unverified load) the whole prompt is.
Under fail-open the request uses its load, but no other request hits its
blocks from the first bad one on, nor any block it computes after them.
"""

from __future__ import annotations

import pd_harness
import pytest
from vllm.v1.kv_cache_interface import SlidingWindowSpec

from offload_harness import (corrupt_store_kv, empty_store, host_connector, load_prompt,  # noqa: F401
                             make_offload_side, perform_loads, store_prompt)
from pd_harness import (CONNECTORS, carrier_maker, forward_of, load, make_request, make_side, prefill, prompt_of,
                        run_local, stats, with_block_hole)
from vllm_kvchecksum.core.payload import KVChecksumPayload, PayloadGroup

PROMPT = 77  # 4 full 16-token blocks and a partial one
BS = 16


@pytest.fixture(params=sorted(CONNECTORS))
def make(request):
    """make_side for the case's carrier (pull, push, mooncake)."""
    return carrier_maker(request.param)


def rollbacks(side) -> dict:
    """The consumer's reported rollback counts: {scope: loads}, and "tokens"."""
    counts = {k.split("/", 1)[1]: v for k, v in side.reported_metrics.items() if k.startswith("loads_recomputed/")}
    if side.reported_metrics.get("recomputed_tokens"):
        counts["tokens"] = side.reported_metrics["recomputed_tokens"]
    return counts


def local_hit(side, tokens: list[int]) -> int:
    """How many tokens a new request with these tokens would hit in the side's prefix cache."""
    _, num_hit, *_ = side.scheduler.kv_cache_manager.get_computed_blocks(
        make_request(tokens, block_size=side.block_size))
    return num_hit


@pytest.mark.parametrize("position", [0, 2, 4])
def test_mismatch_is_recomputed_from_its_first_bad_block(position, make):
    P = make("kv_producer", fail_closed=True)
    C = make("kv_consumer", fail_closed=True, policy="recompute")
    preq, params = prefill(P, prompt_of(PROMPT))
    result = load(C, P, preq, params, tamper=lambda req: C.corrupt(req.request_id, position=position))
    assert stats(C) == {"mismatch": 1}
    # Blocks before the bad one compared equal and stay; the rest is computed again.
    assert result.next_scheduled == PROMPT - position * BS
    assert not result.request.is_finished() and result.request.stop_reason is None
    assert rollbacks(C) == {"from_first_bad_block": 1, "tokens": PROMPT - position * BS}
    # The kept blocks are in the prefix cache; the recomputed ones after the step that recomputes them.
    assert local_hit(C, prompt_of(PROMPT)) == 64


def test_an_offloaded_load_recomputed_from_its_first_bad_block_counts_the_tokens_it_drops():
    """An asynchronous load of offloaded KV (blocks 0-3 of the store) whose
    block 2 is corrupt, fail-closed, recompute: the loaded tokens from the bad
    block to the load's end (32 to 64) are recomputed, and counted."""
    A = make_offload_side()
    corrupt_store_kv(store_prompt(A, prompt_of(PROMPT)), 2)
    C = make_offload_side(fail_closed=True, policy="recompute")
    result = load_prompt(C, prompt_of(PROMPT))
    assert stats(C) == {"mismatch": 1, "offloaded_mismatch": 1}
    assert result.next_scheduled == PROMPT - 2 * BS
    assert rollbacks(C) == {"from_first_bad_block": 1, "tokens": 4 * BS - 2 * BS}


def test_a_local_hit_is_kept_when_the_first_loaded_block_is_bad():
    P = make_side("kv_producer", fail_closed=True)
    C = make_side("kv_consumer", fail_closed=True, policy="recompute")
    prompt = prompt_of(PROMPT)
    run_local(C, prompt[:32])
    preq, params = prefill(P, prompt)
    result = load(C, P, preq, params, num_local=32, tamper=lambda req: C.corrupt(req.request_id, position=2))
    assert stats(C) == {"mismatch": 1}
    assert result.next_scheduled == PROMPT - 32
    assert rollbacks(C) == {"from_first_bad_block": 1, "tokens": PROMPT - 32}


def test_several_kv_cache_groups_recompute_the_whole_prompt():
    # vLLM rolls a load back per request, not per group: with a sliding
    # window group beside the full one the prefix is not kept.
    P = make_side("kv_producer", sliding_window=48, fail_closed=True)
    C = make_side("kv_consumer", sliding_window=48, fail_closed=True, policy="recompute")
    preq, params = prefill(P, prompt_of(PROMPT))
    result = load(C, P, preq, params, tamper=lambda req: C.corrupt(req.request_id, group=0, position=3))
    assert stats(C) == {"mismatch": 1}
    assert result.next_scheduled == PROMPT
    assert rollbacks(C) == {"whole_prompt": 1, "tokens": PROMPT}


def test_a_sliding_window_group_alone_recomputes_the_whole_prompt(monkeypatch):
    # The hybrid manager on, one SlidingWindowSpec group: the connector sends
    # only the window's blocks, so the blocks before a bad one were never
    # transferred, and recomputing from it would attend to KV never loaded.
    # (Found by an outside mutation round: pd_harness otherwise runs with the
    # hybrid manager off, where window_blocks is 0.)
    monkeypatch.setattr(pd_harness, "FullAttentionSpec",
                        lambda **kw: SlidingWindowSpec(**{**kw, "sliding_window": 48}))
    plain = pd_harness.make_config

    def hybrid_on(*args, **kw):
        config = plain(*args, **kw)
        config.scheduler_config.disable_hybrid_kv_cache_manager = False
        return config

    monkeypatch.setattr(pd_harness, "make_config", hybrid_on)
    P = make_side("kv_producer", fail_closed=True)
    C = make_side("kv_consumer", fail_closed=True, policy="recompute")
    assert C.scheduler.kv_checksum.layouts[0].window_blocks > 0 and C.scheduler.kv_checksum.num_kv_cache_groups == 1
    preq, params = prefill(P, prompt_of(PROMPT))
    result = load(C, P, preq, params, tamper=lambda req: C.corrupt(req.request_id, position=2))
    assert stats(C) == {"mismatch": 1}
    assert result.next_scheduled == PROMPT
    assert rollbacks(C) == {"whole_prompt": 1, "tokens": PROMPT}


def test_a_group_left_out_on_both_sides_recomputes_the_whole_prompt(monkeypatch):
    # Two KV cache groups, one left out by the block rule on both sides (a
    # null block after a real one): the load has one compared group, but
    # vLLM's rollback covers both, and the other was never compared.
    P = make_side("kv_producer", sliding_window=48, fail_closed=True)
    C = make_side("kv_consumer", sliding_window=48, fail_closed=True, policy="recompute")
    with_block_hole(P, monkeypatch)
    with_block_hole(C, monkeypatch)
    preq, params = prefill(P, prompt_of(PROMPT))
    result = load(C, P, preq, params, tamper=lambda req: C.corrupt(req.request_id, group=0, position=2))
    assert stats(C) == {"mismatch": 1, "groups_left_out": 1}
    assert result.next_scheduled == PROMPT
    assert rollbacks(C) == {"whole_prompt": 1, "tokens": PROMPT}


def test_unverified_load_recomputes_the_whole_prompt():
    P = make_side("kv_producer")
    C = make_side("kv_consumer", fail_closed=True, policy="recompute")
    preq, params = prefill(P, prompt_of(PROMPT))
    params.pop("kv_checksums")
    result = load(C, P, preq, params)
    assert stats(C) == {"unverified": 1}
    assert result.next_scheduled == PROMPT
    assert rollbacks(C) == {"whole_prompt": 1, "tokens": PROMPT}


def test_a_payload_that_compares_fewer_blocks_keeps_no_prefix():
    # The client's payload starts at block 2: blocks 0 and 1 are loaded but
    # never compared, so they are not a verified prefix, even though the
    # first mismatch is at block 2.
    P = make_side("kv_producer")
    C = make_side("kv_consumer", fail_closed=True, policy="recompute")
    preq, params = prefill(P, prompt_of(PROMPT))
    real = KVChecksumPayload.decode(params["kv_checksums"])
    (gid, group), = real.groups.items()
    params["kv_checksums"] = KVChecksumPayload(
        num_tokens=real.num_tokens, producer_tp_size=real.producer_tp_size,
        groups={gid: PayloadGroup(group.fingerprint, group.block_size, 2, group.values[:3])}).encode()
    result = load(C, P, preq, params)
    assert stats(C) == {"mismatch": 1}
    assert result.next_scheduled == PROMPT
    assert rollbacks(C) == {"whole_prompt": 1, "tokens": PROMPT}


def test_verified_and_policy_fail_loads_roll_nothing_back():
    P = make_side("kv_producer", fail_closed=True)
    C = make_side("kv_consumer", fail_closed=True, policy="recompute")
    preq, params = prefill(P, prompt_of(PROMPT))
    load(C, P, preq, params)
    F = make_side("kv_consumer", fail_closed=True, policy="fail")
    preq, params = prefill(P, prompt_of(PROMPT, seed=3))
    result = load(F, P, preq, params, tamper=lambda req: F.corrupt(req.request_id, position=1))
    assert result.request.is_finished()
    assert rollbacks(C) == {} and rollbacks(F) == {}


# -- fail-open ------------------------------------------------------------------

@pytest.mark.parametrize("positions", [(0,), (2,), (1, 3)], ids=str)
def test_fail_open_mismatch_never_reaches_another_request(positions, make):
    P = make("kv_producer")
    C = make("kv_consumer")
    prompt = prompt_of(PROMPT)
    preq, params = prefill(P, prompt)

    def corrupt(req):
        for position in positions:
            C.corrupt(req.request_id, position=position)

    result = load(C, P, preq, params, tamper=corrupt)
    assert stats(C) == {"mismatch": 1}
    assert result.next_scheduled == 1  # used by its own request (fail-open)
    assert result.request.max_cached_tokens == positions[0] * BS
    # Another request with the same prompt hits only the blocks before the first bad one.
    assert local_hit(C, prompt) == positions[0] * BS


def test_fail_open_clean_load_is_cached_whole(make):
    P = make("kv_producer")
    C = make("kv_consumer")
    prompt = prompt_of(PROMPT)
    preq, params = prefill(P, prompt)
    result = load(C, P, preq, params)
    assert stats(C) == {"verified": 1}
    assert result.request.max_cached_tokens is None
    assert local_hit(C, prompt) == 64


def test_fail_open_unverified_load_is_cached_whole():
    # Nothing says which block is bad: cached as usual (a limit of 0 here
    # would keep every unverified request out of the prefix cache).
    P = make_side("kv_producer")
    C = make_side("kv_consumer")
    preq, params = prefill(P, prompt_of(PROMPT))
    params.pop("kv_checksums")
    result = load(C, P, preq, params)
    assert stats(C) == {"unverified": 1}
    assert result.request.max_cached_tokens is None
    assert local_hit(C, prompt_of(PROMPT)) == 64


def test_fail_open_limit_is_the_first_bad_block_over_groups():
    P = make_side("kv_producer", sliding_window=48)
    C = make_side("kv_consumer", sliding_window=48)
    preq, params = prefill(P, prompt_of(PROMPT))

    def corrupt(req):
        C.corrupt(req.request_id, group=0, position=3)
        C.corrupt(req.request_id, group=1, position=2)

    result = load(C, P, preq, params, tamper=corrupt)
    assert stats(C) == {"mismatch": 1}
    assert result.request.max_cached_tokens == 2 * BS
    assert local_hit(C, prompt_of(PROMPT)) <= 2 * BS


def test_blocks_from_covers_every_group():
    C = make_side("kv_consumer", sliding_window=48)
    assert C.scheduler.kv_checksum.blocks_from(32, ([1, 2, 3, 4, 5], [0, 6, 7, 8, 9])) == {3, 4, 5, 7, 8, 9}


def test_blocks_from_takes_the_block_holding_the_limit_in_groups_of_other_block_sizes():
    """A limit inside a group's block (groups of different block sizes: 16 and
    32 tokens here) takes that block too: it holds the first bad token."""
    from vllm_kvchecksum.core.blocks import GroupLayout
    C = make_side("kv_consumer", sliding_window=48)
    C.scheduler.kv_checksum.layouts = [GroupLayout(0, 16), GroupLayout(1, 32)]
    # Token 48 starts block 3 of group 0, and lies in block 1 (tokens 32-63) of group 1.
    assert C.scheduler.kv_checksum.blocks_from(48, ([1, 2, 3, 4, 5], [6, 7, 8])) == {4, 5, 7, 8}


def test_a_later_limit_never_raises_an_earlier_one():
    P = make_side("kv_producer")
    C = make_side("kv_consumer")
    preq, params = prefill(P, prompt_of(PROMPT))

    def tamper(req):
        req.max_cached_tokens = BS  # as left by an earlier failed load of this request
        C.corrupt(req.request_id, position=2)

    result = load(C, P, preq, params, tamper=tamper)
    assert stats(C) == {"mismatch": 1}
    assert result.request.max_cached_tokens == BS
    assert local_hit(C, prompt_of(PROMPT)) == BS


@pytest.mark.parametrize("batch_queue", [False, True], ids=["scheduler", "batch-queue"])
def test_fail_open_blocks_computed_after_the_bad_one_stay_out(batch_queue):
    # The request decodes past token 80, filling block 4 with KV computed on
    # its bad block 2. Another request then recomputes blocks 2-3 correctly
    # and caches them, which reconnects the hash chain up to block 4: block
    # 4 must still never be hit.
    P = make_side("kv_producer")
    C = make_side("kv_consumer", batch_queue=batch_queue)
    prompt = prompt_of(PROMPT)
    preq, params = prefill(P, prompt)
    result = load(C, P, preq, params, tamper=lambda req: C.corrupt(req.request_id, position=2))
    req = result.request
    forward = forward_of(C, req)
    for _ in range(8):
        if req.is_finished():
            break
        C.step(forward=forward)
    assert req.is_finished() and len(req.all_token_ids) >= 80
    run_local(C, prompt)  # recomputes and caches blocks 2 and 3
    assert local_hit(C, prompt) == 64
    assert local_hit(C, list(req.all_token_ids[:80]) + [7]) == 64


def test_fail_open_sync_load_evicts_blocks_cached_before_its_verdict():
    # A synchronous load of offloaded blocks 0-3 under a batch queue, with
    # chunked prefill: step N+1 (scheduled before step N's verdict) computes
    # the prompt's blocks 6-7 and caches them. Its held blocks (0-5) leave
    # the cache at the verdict; blocks 6-7 were cached on the bad block 1
    # too, and must leave with them, or another request that recomputes
    # blocks 1-5 would chain on to them.
    A = make_offload_side()
    B = make_offload_side(batch_queue=True, max_num_batched_tokens=32)
    prompt = prompt_of(128)
    hashes = store_prompt(A, prompt[:65])
    corrupt_store_kv(hashes, 1)
    host_connector(B).load_async = False
    req = make_request(prompt, block_size=BS, max_tokens=2)
    B.scheduler.add_request(req)
    out_n = B.scheduler.schedule()
    perform_loads(B)
    forward_of(B, req)(out_n)
    out_next = B.scheduler.schedule()  # step N+1, before step N's update
    assert out_next.num_scheduled_tokens[req.request_id] == 32
    forward_of(B, req)(out_next)
    pool = B.scheduler.kv_cache_manager.block_pool
    ids = B.scheduler.kv_cache_manager.get_block_ids(req.request_id)[0]
    assert all(pool.blocks[i].block_hash is not None for i in ids[6:8])
    B.update(out_n, B.run_workers(out_n))
    assert stats(B) == {"mismatch": 1, "offloaded_mismatch": 1}
    assert req.max_cached_tokens == BS
    assert [pool.blocks[i].block_hash is not None for i in ids] == [True] + [False] * (len(ids) - 1)


def test_what_a_verdict_leaves_for_the_scheduler_lasts_one_update():
    # Under policy "fail" nothing takes the failed load's prefix: the next
    # update drops it, so it cannot pile up over a server's life.
    P = make_side("kv_producer", fail_closed=True)
    C = make_side("kv_consumer", fail_closed=True, policy="fail")
    preq, params = prefill(P, prompt_of(PROMPT))
    load(C, P, preq, params, tamper=lambda req: C.corrupt(req.request_id, position=1))
    assert C.scheduler.kv_checksum._failed_prefix == {}
    O = make_side("kv_consumer")
    preq, params = prefill(P, prompt_of(PROMPT, seed=5))
    load(O, P, preq, params, tamper=lambda req: O.corrupt(req.request_id, position=1))
    assert O.scheduler.kv_checksum._cache_limits == {}
