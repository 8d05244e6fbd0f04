"""Which blocks of a request the checksums cover, per KV cache group.

Both sides apply the same rule to the tokens they hold, so producer and
consumer checksum the same block positions: the blocks holding tokens
[first_token, end_token) of each group, clipped to the trailing blocks the
connector transfers for that group (`GroupLayout.window_blocks`, taken from
vLLM's own rule, `sliding_window_transfer_blocks`, which NIXL and Mooncake
use to choose what they send), with leading null blocks (out of a sliding
window) dropped, and a group with a null block after a non-null one left
out. Comparing fewer blocks than were transferred would let corruption in
the others pass as verified, so the clip must never be re-derived here.

A Mamba (SSM) state group is not per token: the connector transfers one
block, the request's running state, chosen by vLLM's own clip
(`clip_ssm_state_blocks`, passed in as `GroupLayout.state_block`). It is
recorded at position 0, whatever the tokens and block sizes.

This module imports no vLLM: the scheduler glue fills the layouts in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vllm_kvchecksum.core.records import GroupBlocks


@dataclass(frozen=True)
class GroupLayout:
    """What the block rule needs to know of one KV cache group.

    window_blocks: how many trailing blocks of the request the connector
      transfers for this group; 0 means every block.
    state_block: for a Mamba state group, the connector's rule picking the
      state-bearing blocks from the request's block list (it must pick one);
      None for per-token groups.
    """

    group_id: int
    block_size: int
    window_blocks: int = 0
    state_block: Callable[[list[int]], Sequence[int]] | None = None

    @property
    def is_state(self) -> bool:
        return self.state_block is not None


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def group_blocks(block_ids: Sequence[int], layout: GroupLayout, first_token: int, end_token: int,
                 null_block_id: int = 0) -> GroupBlocks | None:
    """The group's blocks for tokens [first_token, end_token); None if left out.

    A state group gives its running-state block at position 0 (tokens do not
    apply), or None when the rule picks no single non-null block.
    """
    if layout.state_block is not None:
        state = list(layout.state_block(list(block_ids)))
        if len(state) != 1 or state[0] == null_block_id:
            return None
        return GroupBlocks(0, (state[0],))
    bs = layout.block_size
    start, stop = first_token // bs, min(cdiv(end_token, bs), len(block_ids))
    if layout.window_blocks:
        start = max(start, stop - layout.window_blocks)
    while start < stop and block_ids[start] == null_block_id:
        start += 1
    ids = tuple(block_ids[start:stop])
    if null_block_id in ids:
        return None
    return GroupBlocks(start, ids)


def request_blocks(block_ids: Sequence[Sequence[int]], layouts: Sequence[GroupLayout], first_token: int,
                   end_token: int, null_block_id: int = 0) -> dict[int, GroupBlocks]:
    """Per checksummed group id, the blocks of tokens [first_token, end_token)."""
    groups = {}
    for layout in layouts:
        blocks = group_blocks(block_ids[layout.group_id], layout, first_token, end_token, null_block_id)
        if blocks is not None:
            groups[layout.group_id] = blocks
    return groups
