"""The block rule on real schedulers: what is compared is what NIXL transferred.

With the hybrid KV cache manager off, vLLM merges sliding-window and full
attention layers into one FullAttentionSpec group that carries the window.
NIXL then transfers every block of the request, so every block must be
compared: a corrupted early block belongs to the full-attention layers too.
"""

from __future__ import annotations

from pd_harness import load, make_side, prefill, prompt_of, stats, with_block_hole

PROMPT = 77  # 5 blocks of 16; a 32-token window would clip to the last 3



def test_merged_window_group_compares_every_transferred_block():
    P = make_side("kv_producer", merged_sliding_window=32, fail_closed=True)
    C = make_side("kv_consumer", merged_sliding_window=32, fail_closed=True, policy="recompute")
    preq, params = prefill(P, prompt_of(PROMPT))
    load(C, P, preq, params)
    assert stats(C) == {"verified": 1}
    preq, params = prefill(P, prompt_of(PROMPT, seed=9))
    # Block 0 holds full-attention KV the decode reads: it must be compared.
    result = load(C, P, preq, params, tamper=lambda req: C.corrupt(req.request_id, group=0, position=0))
    assert stats(C) == {"verified": 1, "mismatch": 1}
    assert result.next_scheduled == PROMPT  # recomputed locally


def test_leading_null_blocks_of_a_sliding_window_load_are_skipped():
    # 80 tokens, window 48: the consumer's sliding-window group holds null
    # blocks at positions 0 and 1 (out of the window); they are neither
    # loaded nor compared, and the group verifies on the blocks it holds.
    P = make_side("kv_producer", sliding_window=48, fail_closed=True)
    C = make_side("kv_consumer", sliding_window=48, fail_closed=True)
    preq, params = prefill(P, prompt_of(80))
    result = load(C, P, preq, params)
    assert C.scheduler.kv_cache_manager.get_block_ids(result.request.request_id)[1][:2] == [0, 0]
    assert stats(C) == {"verified": 1}
    assert result.next_scheduled == 1


def test_oldest_transferred_window_block_is_compared():
    # 77 tokens, window 48, blocks of 16: the connector sends the last
    # cdiv(48, 16) + 1 = 4 blocks, positions 1-4. Position 1 still holds
    # tokens inside the attention window of the first decode step.
    P = make_side("kv_producer", sliding_window=48, fail_closed=True)
    C = make_side("kv_consumer", sliding_window=48, fail_closed=True, policy="recompute")
    preq, params = prefill(P, prompt_of(PROMPT))
    load(C, P, preq, params, tamper=lambda req: C.corrupt(req.request_id, group=1, position=1))
    assert stats(C) == {"mismatch": 1}


def test_window_loads_with_larger_consumer_blocks_verify():
    # Producer blocks of 16, consumer blocks of 32, 100 tokens, window 48:
    # the producer's first checksummed block (position 3 of 16) starts in
    # the middle of consumer block 1, which neither side holds whole, so
    # only chunks both sides cover whole are compared: no false mismatch.
    P = make_side("kv_producer", block_size=16, sliding_window=48, fail_closed=True)
    C = make_side("kv_consumer", block_size=32, sliding_window=48, fail_closed=True, policy="recompute")
    preq, params = prefill(P, prompt_of(100))
    result = load(C, P, preq, params)
    assert stats(C) == {"verified": 1}
    assert result.next_scheduled == 1


def test_group_left_out_on_both_sides_is_counted_and_logged(monkeypatch, logs):
    # A null block after a real one in the sliding-window group (as a block
    # table can show mid-window): the rule leaves that group out on both sides.
    P = make_side("kv_producer", sliding_window=48, fail_closed=True)
    C = make_side("kv_consumer", sliding_window=48, fail_closed=True)
    with_block_hole(P, monkeypatch)
    with_block_hole(C, monkeypatch)
    preq, params = prefill(P, prompt_of(PROMPT))
    load(C, P, preq, params)
    assert stats(C) == {"verified": 1, "groups_left_out": 1}
    assert "groups [1] are not compared" in logs.text
