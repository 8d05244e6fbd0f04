"""The block rule against the connectors' own choice of blocks to transfer.

For every kind of KV cache group vLLM v0.32.0 builds, with the hybrid KV
cache manager on and off, the blocks the checksums cover (the package's
`request_blocks` over the scheduler's `transfer_layouts`) must be exactly
the blocks NIXL (`get_exchange_clipped_blocks`) and Mooncake
(`get_sw_clipped_blocks`) transfer: covering fewer is a false verify
waiting to happen, covering more a false mismatch.
"""

from __future__ import annotations

import random

import pytest
import torch
from pd_harness import make_config
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import MooncakeConnectorScheduler
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler import NixlPushConnectorScheduler
from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheConfig,
                                        KVCacheGroupSpec, MLAAttentionSpec, SlidingWindowMLASpec,
                                        SlidingWindowSpec)

from vllm_kvchecksum.core.blocks import request_blocks
from vllm_kvchecksum.engine.scheduler import transfer_layouts

BS = 16
KW = dict(block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
MLA = dict(block_size=BS, num_kv_heads=1, head_size=16, dtype=torch.bfloat16)

# The groups vLLM builds for each kind of model: (hybrid manager on, off).
# With the hybrid manager off, sliding-window and chunked-local layers mixed
# with full attention are merged into one FullAttentionSpec carrying the window.
MODELS = {
    "full": ([FullAttentionSpec(**KW)], [FullAttentionSpec(**KW)]),
    "sliding+full": ([FullAttentionSpec(**KW), SlidingWindowSpec(**KW, sliding_window=48)],
                     [FullAttentionSpec(**KW, sliding_window=48)]),
    "sliding-only": ([SlidingWindowSpec(**KW, sliding_window=40)], [SlidingWindowSpec(**KW, sliding_window=40)]),
    "chunked-local+full": ([FullAttentionSpec(**KW), ChunkedLocalAttentionSpec(**KW, attention_chunk_size=64)],
                           [FullAttentionSpec(**KW, attention_chunk_size=64)]),
    "mla": ([MLAAttentionSpec(**MLA)], [MLAAttentionSpec(**MLA)]),
    "sliding-mla+mla": ([MLAAttentionSpec(**MLA), SlidingWindowMLASpec(**MLA, sliding_window=33)],
                        [MLAAttentionSpec(**MLA, sliding_window=33)]),
}

CONNECTORS = {
    "nixl-pull": ("NixlConnector", NixlPullConnectorScheduler, "get_exchange_clipped_blocks"),
    "nixl-push": ("NixlConnector", NixlPushConnectorScheduler, "get_exchange_clipped_blocks"),
    "mooncake": ("MooncakeConnector", MooncakeConnectorScheduler, "get_sw_clipped_blocks"),
}


def setup(model: str, hybrid: bool, connector: str):
    specs = MODELS[model][0 if hybrid else 1]
    name, cls, clip = CONNECTORS[connector]
    vllm_config = make_config("kv_both", 1, 1, BS, connector=name)
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = not hybrid
    kv_cache_config = KVCacheConfig(num_blocks=4096, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([f"model.layers.{i}.attn"], spec) for i, spec in enumerate(specs)])
    scheduler = cls(vllm_config, "engine", kv_cache_config)
    return getattr(scheduler, clip), transfer_layouts(vllm_config, kv_cache_config), len(specs)


@pytest.mark.parametrize("connector", list(CONNECTORS))
@pytest.mark.parametrize("hybrid", [True, False], ids=["hma-on", "hma-off"])
@pytest.mark.parametrize("model", list(MODELS))
def test_checksummed_blocks_are_the_transferred_blocks(model, hybrid, connector):
    clip, layouts, num_groups = setup(model, hybrid, connector)
    rng = random.Random(f"{model}{hybrid}{connector}")
    for num_tokens in (1, 15, 16, 17, 47, 48, 49, 77, 130, 257, 1000):
        num_blocks = -(-num_tokens // BS)
        block_ids = [rng.sample(range(1, 4096), num_blocks) for _ in range(num_groups)]
        # Producer: the whole prompt. Consumer: the blocks after a local hit,
        # which is what the connector is handed for the load.
        for first_block in sorted({0, num_blocks // 2, num_blocks - 1}):
            sent = clip([ids[first_block:] for ids in block_ids])
            ours = request_blocks(block_ids, layouts, first_block * BS, num_tokens)
            for gid in range(num_groups):
                assert list(ours[gid].block_ids) == list(sent[gid]), (model, hybrid, num_tokens, first_block, gid)
                assert ours[gid].start == num_blocks - len(sent[gid])


def test_merged_window_is_not_clipped():
    # The case a rule keyed on a `sliding_window` attribute got wrong: the
    # merged group carries the window, and every block is transferred.
    _, layouts, _ = setup("sliding+full", False, "nixl-pull")
    assert [layout.window_blocks for layout in layouts] == [0]
    _, layouts, _ = setup("sliding+full", True, "nixl-pull")
    assert [layout.window_blocks for layout in layouts] == [0, 48 // BS + 1]
