"""Real vLLM KV caches on CPU for the worker tests.

Builds a KVCacheConfig the way the engine lays tensors out
(compute_layout_strides), allocates it with vLLM's allocate_kv_cache, and
fills it with random bytes. Groups get their own byte regions here, so the
same block ids can be used in several groups of one test.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from vllm.v1.kv_cache_interface import (KVCacheConfig, KVCacheGroupSpec, KVCacheTensor,
                                        UniformTypeKVCacheSpecs, compute_layout_strides)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache


def build_caches(groups: list[KVCacheGroupSpec], num_blocks: int, layout: KVCacheLayout = KVCacheLayout.LBHNC,
                 kernel_block_sizes: list[int] | None = None, seed: int = 0,
                 aliases: dict[str, str] | None = None) -> tuple[KVCacheConfig, dict[str, torch.Tensor]]:
    """aliases: layer -> target layer whose cache it shares (KV sharing)."""
    aliases = aliases or {}
    tensors, offset = [], 0
    for group in groups:
        by_spec = defaultdict(list)
        spec = group.kv_cache_spec
        for name in group.layer_names:
            if name in aliases:
                continue
            layer_spec = spec.kv_cache_specs[name] if isinstance(spec, UniformTypeKVCacheSpecs) else spec
            by_spec[layer_spec].append(name)
        for layer_spec, names in by_spec.items():
            layer_stride, block_stride, *_ = compute_layout_strides(layer_spec, num_blocks, len(names), layout)
            tensors.append(KVCacheTensor(size=0, layers=names, layer_stride=layer_stride,
                                         block_stride=block_stride, offset=offset))
            offset += len(names) * layer_spec.page_size_bytes * num_blocks
    for t in tensors:
        t.size = offset
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups)
    caches = allocate_kv_cache(config, torch.device("cpu"), layout, kernel_block_sizes)
    for name, target in aliases.items():
        caches[name] = caches[target]
    if caches:
        storage = next(iter(caches.values())).untyped_storage()
        raw = torch.empty(0, dtype=torch.uint8).set_(storage)
        gen = torch.Generator().manual_seed(seed)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
    return config, caches
