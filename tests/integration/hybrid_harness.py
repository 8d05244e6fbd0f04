"""A hybrid (attention + Mamba2) producer and consumer, minus the model.

pd_harness's sides with a second KV cache group: Mamba2 layers 1 and 3 in a
MambaSpec group, attention layers 0 and 2 in a full-attention group, on the
real Scheduler with the hybrid KV cache manager in align mode (prefix
caching) and one speculative scratch block per request, real connector
scheduler halves and real KVChecksumWorkers over caches from vLLM's
allocate_kv_cache.

What stands in for the model: after each step's forward, every worker writes
its shard of each Mamba layer's state into the request's running-state block,
which this module takes as the row's last block before its speculative
scratch block (not through the rule the checksum scheduler uses), and junk
of its own into the scratch block. The state is a function of (layer, tokens
computed): a global (TP=1) state, of which each rank writes the rows its
shard holds, in its own page layout (x, B, C conv rows; heads), B and C on
every rank when the layer has one group and TP > 1. A correct transfer is the
consumer writing the same state for the tokens it loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from kv_setup import build_caches
import pd_harness
from pd_harness import (HEAD_SIZE, NUM_BLOCKS, Side, StructuredOutputManager, Worker, layer_name, make_config)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

from vllm_kvchecksum.engine.worker import KVChecksumWorker

ATTENTION_LAYERS = [0, 2]
MAMBA_LAYERS = [1, 3]
MAMBA_GROUP = 1
NUM_SPEC_BLOCKS = 1
NUM_HEADS = 4


def mamba_layer_name(i: int) -> str:
    return f"model.layers.{i}.mixer"


@dataclass(frozen=True)
class Mamba2Layer:
    """The global (TP=1) shape of the test's Mamba2 layers.

    split: the spec describes the TP split (MambaSpec.state_splits); without
    it the worker checksums each rank's bytes as they are.
    """

    x_rows: int = 16
    n_groups: int = 1
    state_size: int = 4
    conv_len: int = 3
    heads: int = 4
    head_dim: int = 2
    dim_first: bool = True
    split: bool = True
    conv_bytes: int = 2  # bf16 (2) or fp32 (4) conv state

    @property
    def conv_rows(self) -> int:
        return self.x_rows + 2 * self.n_groups * self.state_size

    @property
    def temporal_elements(self) -> int:
        return self.head_dim * self.state_size

    def local_rows(self, tp: int, rank: int) -> tuple[dict[str, list[int]], list[int]]:
        """The global conv rows per segment, and the heads, that `rank` holds at TP `tp`."""
        xl = self.x_rows // tp
        conv = {"x": list(range(rank * xl, (rank + 1) * xl))}
        n = self.n_groups * self.state_size
        for name, base in (("B", self.x_rows), ("C", self.x_rows + n)):
            if self.n_groups == 1 and tp > 1:
                conv[name] = list(range(base, base + n))  # replicated on every rank
            else:
                per = n // tp
                conv[name] = list(range(base + rank * per, base + (rank + 1) * per))
        hl = self.heads // tp
        return conv, list(range(rank * hl, (rank + 1) * hl))

    def local_shapes(self, tp: int) -> tuple[tuple[int, int], tuple[int, int, int]]:
        conv, heads = self.local_rows(tp, 0)
        rows = sum(len(r) for r in conv.values())
        conv_shape = (rows, self.conv_len) if self.dim_first else (self.conv_len, rows)
        return conv_shape, (len(heads), self.head_dim, self.state_size)

    def spec(self, tp: int, block_size: int, page_size: int) -> MambaSpec:
        kw = {}
        if self.split:
            from vllm.v1.kv_cache_interface import MambaStateSplit

            conv, heads = self.local_rows(tp, 0)
            replicas = tp if self.n_groups == 1 and tp > 1 else 1
            kw["state_splits"] = (
                MambaStateSplit(0 if self.dim_first else 1,
                                ((len(conv["x"]), 1), (len(conv["B"]), replicas), (len(conv["C"]), replicas))),
                MambaStateSplit(0, ((len(heads), 1),)))
        return MambaSpec(block_size=block_size, shapes=self.local_shapes(tp), dtypes=(self.conv_dtype, torch.float32),
                         page_size_padded=page_size, mamba_cache_mode="align",
                         num_speculative_blocks=NUM_SPEC_BLOCKS, **kw)

    @property
    def conv_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.conv_bytes == 2 else torch.float32

    def global_state(self, layer: int, tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """(conv [rows, conv_len], temporal [heads, elements] uint32): the state after `tokens`,
        as unsigned integers of the states' element sizes."""
        rng = np.random.default_rng([layer, tokens])
        conv_type = np.uint16 if self.conv_bytes == 2 else np.uint32
        conv = rng.integers(0, 2**(8 * self.conv_bytes), (self.conv_rows, self.conv_len), dtype=conv_type)
        temporal = rng.integers(0, 2**32, (self.heads, self.temporal_elements), dtype=np.uint32)
        return conv, temporal

    def local_page(self, layer: int, tokens: int, tp: int, rank: int) -> bytes:
        """The bytes a rank's page starts with: its conv state, then its temporal state."""
        conv, temporal = self.global_state(layer, tokens)
        conv_rows, heads = self.local_rows(tp, rank)
        local_conv = conv[sum(conv_rows.values(), [])]
        if not self.dim_first:
            local_conv = local_conv.T
        return np.ascontiguousarray(local_conv).tobytes() + np.ascontiguousarray(temporal[heads]).tobytes()


def running_state_block(block_ids) -> int:
    """The running-state slot: the row's last block before its speculative scratch blocks."""
    return block_ids[-1 - NUM_SPEC_BLOCKS]


class HybridSide(Side):
    """A Side whose requests also have Mamba2 state (group 1)."""

    model: Mamba2Layer
    tp: int
    junk: int

    def write_tokens(self, request_id: str, first_token: int, end_token: int, source: Side | None = None,
                     source_id: str | None = None) -> None:
        super().write_tokens(request_id, first_token, end_token, source, source_id)
        ids = self.scheduler.kv_cache_manager.get_block_ids(request_id)[MAMBA_GROUP]
        running, scratch = running_state_block(ids), ids[-1]
        for w in self.workers:
            for layer in MAMBA_LAYERS:
                if layer not in w.layers:
                    continue
                cache = w.caches[mamba_layer_name(layer)]
                data = self.model.local_page(layer, end_token, self.tp, w.tp_rank)
                page = cache[running, 0, 0].view(torch.uint8)
                page[:len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
                # The scratch slot holds whatever this side's drafts left there.
                cache[scratch, 0, 0].view(torch.uint8).fill_((self.junk + layer + w.tp_rank) % 256)

    def state_page(self, request_id: str, worker: int = -1, block: int | None = None) -> torch.Tensor:
        """A worker's page of layer 1 in the request's running-state block (uint8, writable)."""
        ids = self.scheduler.kv_cache_manager.get_block_ids(request_id)[MAMBA_GROUP]
        block = running_state_block(ids) if block is None else block
        return self.workers[worker].caches[mamba_layer_name(MAMBA_LAYERS[0])][block, 0, 0].view(torch.uint8)

    def b_row_offset(self) -> int:
        """Byte offset of the first element of the first B row in a rank's page."""
        conv, _ = self.model.local_rows(self.tp, 0)
        if self.model.dim_first:
            return len(conv["x"]) * self.model.conv_len * self.model.conv_bytes
        return len(conv["x"]) * self.model.conv_bytes  # the first time step's B channel


def make_hybrid_side(role: str, tp: int = 1, *, model: Mamba2Layer = Mamba2Layer(), block_size: int = 16,
                     junk: int = 0, **config_kw) -> HybridSide:
    """One hybrid instance at TP `tp` (PP 1); config_kw as pd_harness.make_config."""
    vllm_config = make_config(role, tp, 1, block_size, **config_kw)
    vllm_config.cache_config.mamba_cache_mode = "align"
    vllm_config.cache_config.mamba_block_size = block_size
    local_heads = NUM_HEADS // tp
    attention = FullAttentionSpec(block_size=block_size, num_kv_heads=local_heads, head_size=HEAD_SIZE,
                                  dtype=torch.bfloat16)
    mamba = model.spec(tp, block_size, attention.page_size_bytes)
    assert mamba.real_page_size_bytes <= attention.page_size_bytes
    groups = [KVCacheGroupSpec([layer_name(l) for l in ATTENTION_LAYERS], attention),
              KVCacheGroupSpec([mamba_layer_name(l) for l in MAMBA_LAYERS], mamba)]
    workers = []
    for t in range(tp):
        config, caches = build_caches(groups, NUM_BLOCKS, seed=t)
        checksums = KVChecksumWorker(config, caches, tp_rank=t, tp_size=tp, model_kv_heads=NUM_HEADS)
        workers.append(Worker(0, t, list(range(4)), t * local_heads, caches, checksums))
    vllm_config.cache_config.num_gpu_blocks = NUM_BLOCKS
    sched_config = pd_harness.settle_hash_block_size(
        KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups), vllm_config)
    scheduler = Scheduler(vllm_config=vllm_config, kv_cache_config=sched_config, log_stats=True,
                          structured_output_manager=StructuredOutputManager(vllm_config), block_size=block_size)
    side = HybridSide(scheduler, workers, block_size, [(ATTENTION_LAYERS, None)])
    side.model, side.tp, side.junk = model, tp, junk
    side.remote_ids = {}
    return side


def flip_bit(page: torch.Tensor, offset: int, mask: int = 0x10) -> None:
    page[offset] ^= mask

