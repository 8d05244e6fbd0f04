"""The block rule (vllm_kvchecksum.core.blocks), on its own.

Which blocks a connector transfers is checked against the connectors
themselves in tests/integration/test_transfer_blocks.py; here, the rule's
own cases: token ranges, the window clip, null blocks.
"""

from vllm_kvchecksum.core.blocks import GroupLayout, group_blocks, request_blocks
from vllm_kvchecksum.core.records import GroupBlocks

FULL = GroupLayout(0, 16)
WINDOW_48 = GroupLayout(1, 16, window_blocks=48 // 16 + 1)


def test_blocks_holding_the_token_range():
    ids = [5, 6, 7, 8, 9]
    assert group_blocks(ids, FULL, 0, 77) == GroupBlocks(0, (5, 6, 7, 8, 9))
    assert group_blocks(ids, FULL, 0, 64) == GroupBlocks(0, (5, 6, 7, 8))
    # A consumer after a 32-token local hit: the loaded blocks only.
    assert group_blocks(ids, FULL, 32, 77) == GroupBlocks(2, (7, 8, 9))
    # More tokens than blocks: only the blocks there are.
    assert group_blocks(ids[:3], FULL, 0, 77) == GroupBlocks(0, (5, 6, 7))


def test_window_keeps_the_last_blocks_the_connector_sends():
    ids = list(range(10, 20))  # 10 blocks, 160 tokens
    assert group_blocks(ids, WINDOW_48, 0, 160) == GroupBlocks(6, (16, 17, 18, 19))
    # 77 tokens: positions 1-4, the oldest still inside the window.
    assert group_blocks(ids[:5], WINDOW_48, 0, 77) == GroupBlocks(1, (11, 12, 13, 14))
    # A local hit past the window start leaves the later start.
    assert group_blocks(ids, WINDOW_48, 128, 160) == GroupBlocks(8, (18, 19))
    # Shorter than the window: everything.
    assert group_blocks(ids[:2], WINDOW_48, 0, 20) == GroupBlocks(0, (10, 11))
    # A block list shorter than the tokens need: the window ends at its last block.
    assert group_blocks(ids[:6], WINDOW_48, 0, 160) == GroupBlocks(2, (12, 13, 14, 15))


def test_leading_null_blocks_are_dropped():
    # 80 tokens, window 48: the sliding-window manager leaves positions 0-1 null.
    assert group_blocks([0, 0, 6, 7, 8], WINDOW_48, 0, 80) == GroupBlocks(2, (6, 7, 8))
    assert group_blocks([0, 0, 6], FULL, 0, 48) == GroupBlocks(2, (6,))
    assert group_blocks([9, 0, 0], FULL, 0, 48, null_block_id=9) == GroupBlocks(1, (0, 0))


def test_a_null_block_after_a_real_one_leaves_the_group_out():
    assert group_blocks([5, 0, 7], FULL, 0, 48) is None
    assert group_blocks([0, 5, 0, 7], FULL, 0, 64) is None
    # Outside the checksummed range it does not matter.
    assert group_blocks([5, 0, 7, 8], FULL, 32, 64) == GroupBlocks(2, (7, 8))


def test_all_null_or_empty_range_is_an_empty_group():
    assert group_blocks([0, 0], FULL, 0, 32) == GroupBlocks(2, ())
    assert group_blocks([5, 6], FULL, 32, 32) == GroupBlocks(2, ())


def test_request_blocks_per_group_omits_left_out_groups():
    blocks = request_blocks([[1, 2, 3, 4, 5], [0, 0, 6, 0, 8]], [FULL, WINDOW_48], 0, 80)
    assert blocks == {0: GroupBlocks(0, (1, 2, 3, 4, 5))}
    blocks = request_blocks([[1, 2, 3, 4, 5], [0, 0, 6, 7, 8]], [WINDOW_48], 0, 80)
    assert blocks == {1: GroupBlocks(2, (6, 7, 8))}
