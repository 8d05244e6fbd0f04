"""Which layers of a worker's KV cache groups are checksummed, and how.

For every transfer group of the worker's KVCacheConfig this decides, once
at startup, either a plan (each cache as a LayerView with its layer number,
first global head and replica key) or the reason the group is skipped. The
rules make every worker of any TP/PP layout number the same slices the same
way, so the workers' partial sums add up to the model's checksum.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

import torch
try:  # vLLM 0.34 moved KV cache planning out of kv_cache_utils
    from vllm.v1.core.kv_cache_planning import layer_tp_replicas
except ImportError:  # vLLM 0.32
    from vllm.v1.core.kv_cache_utils import layer_tp_replicas
from vllm.v1.kv_cache_interface import (AttentionSpec, KVCacheConfig, KVCacheSpec, MambaSpec,
                                        MLAAttentionSpec, SlidingWindowMLASpec,
                                        UniformTypeKVCacheSpecs)

from vllm_kvchecksum.core.definition import MAX_KV_HEADS_PER_LAYER
from vllm_kvchecksum.core.layer_view import LayerView, PlannedCache
from vllm_kvchecksum.engine.mamba_plan import fingerprint64, plan_state_layer

MASK64 = (1 << 64) - 1
# MLA-type caches without max_tp_shards are held whole by every rank (NIXL
# transfers them whole by spec type, too).
MLA_TYPES = (MLAAttentionSpec, SlidingWindowMLASpec)


@dataclass
class GroupPlan:
    """How a worker checksums one KV cache group.

    state: a Mamba state group (one state per block, recorded at position 0;
      its views take one row of block size 1 per block).
    tp_local: its slices follow this rank's TP shard (state whose TP split
      the layers do not describe), so sums are comparable only between equal
      TP sizes.
    """

    group_id: int
    block_size: int
    caches: list[PlannedCache] = field(default_factory=list)
    fingerprint: int = 0
    skip_reason: str | None = None
    state: bool = False
    tp_local: bool = False


@dataclass(frozen=True)
class TPPosition:
    """Where this worker sits in TP, and the model facts replication needs.

    model_kv_heads: the model's KV head count when every layer shares it
    (see `uniform_model_kv_heads`), else None; it resolves one-head-per-rank
    attention, which is ambiguous (sharded or replicated) otherwise.
    """

    tp_rank: int
    tp_size: int
    model_kv_heads: int | None


def layer_number(name: str) -> tuple[int, str] | None:
    """(layer number, layer module) of a layer name with exactly one number."""
    parts = name.split(".")
    numbered = [i for i, p in enumerate(parts) if re.fullmatch(r"\d+", p)]
    if len(numbered) != 1:
        return None
    i = numbered[0]
    return int(parts[i]), ".".join(parts[: i + 1])


def layer_fingerprint(name: str, spec: KVCacheSpec) -> int:
    """A 64-bit hash of what identifies a layer's cache on both sides.

    The block size is left out: producers and consumers may differ in it.
    """
    dtype = str(getattr(spec, "dtype", None))
    return fingerprint64(f"{name}\0{type(spec).__name__}\0{dtype}")


def layer_spec(group_spec: KVCacheSpec, name: str) -> KVCacheSpec:
    """One layer's spec in a group (a UniformTypeKVCacheSpecs group holds one per layer)."""
    if isinstance(group_spec, UniformTypeKVCacheSpecs):
        return group_spec.kv_cache_specs[name]
    return group_spec


def _spec_skip_reason(spec: KVCacheSpec) -> str | None:
    if isinstance(spec, MambaSpec):
        return ("a Mamba layer in a group of mixed specs (its state block would not be recognized by the "
                "scheduler)")
    if not isinstance(spec, AttentionSpec):
        return f"{type(spec).__name__} has no per-token KV"
    if not spec.has_layer_views:
        return f"{type(spec).__name__} caches are not per-layer [B, H, N, C] views"
    if spec.tokens_per_state != 1:
        return f"compressed cache (tokens_per_state={spec.tokens_per_state})"
    if spec.num_head_slots is not None:
        return f"KV heads packed into {spec.num_head_slots} head slots"
    return None


def _replicas(spec: AttentionSpec, local_heads: int, pos: TPPosition) -> int | None:
    """TP ranks holding the same heads of this cache; None when unknown."""
    if spec.max_tp_shards is not None:
        return layer_tp_replicas(spec, pos.tp_size, 1)
    if isinstance(spec, MLA_TYPES):
        return pos.tp_size
    if local_heads > 1 or pos.tp_size == 1:
        return 1
    # One head per rank: sharded (as many ranks as heads) or replicated.
    total = pos.model_kv_heads
    if total is None or total < 1 or pos.tp_size % total:
        return None
    return pos.tp_size // total


def _cache_identity(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


def plan_group(group_id: int, kv_cache_config: KVCacheConfig, kv_caches: dict[str, torch.Tensor],
               pos: TPPosition, path: str = "auto") -> GroupPlan:
    group = kv_cache_config.kv_cache_groups[group_id]
    block_size = group.kv_cache_spec.block_size
    plan = GroupPlan(group_id, block_size)

    def skip(reason: str) -> GroupPlan:
        return _skipped(plan, reason)

    if group.host_resident:
        return skip("host-resident (HiSparse) group")
    if isinstance(group.kv_cache_spec, MambaSpec):
        return plan_state_group(plan, group.layer_names, kv_cache_config, kv_caches, pos, path)
    entries = []  # (layer, name, module, spec, tensor)
    for name in group.layer_names:
        spec = layer_spec(group.kv_cache_spec, name)
        reason = _spec_skip_reason(spec)
        if reason:
            return skip(f"layer {name}: {reason}")
        numbered = layer_number(name)
        if numbered is None:
            return skip(f"layer name {name!r} does not hold a single layer number")
        if name not in kv_caches:
            return skip(f"layer {name} has no KV cache tensor on this worker")
        entries.append((numbered[0], name, numbered[1], spec, kv_caches[name]))

    # KV-sharing aliases address one cache: count it once, under the lowest
    # (layer number, name) using it.
    unique, seen = [], set()
    for entry in sorted(entries, key=lambda e: (e[0], e[1])):
        ident = _cache_identity(entry[4])
        if ident not in seen:
            seen.add(ident)
            unique.append(entry)

    clash = _module_clash((layer, module) for layer, _, module, _, _ in unique)
    if clash:
        return skip(clash)

    # The caches of one layer module number their heads consecutively, in
    # layer name order: each takes the global heads after the previous one's.
    next_head = defaultdict(int)
    for layer, name, module, spec, tensor in sorted(unique, key=lambda e: (e[0], e[1])):
        if tensor.dim() != 4:
            return skip(f"layer {name}: cache is {tensor.dim()}-D, not a [blocks, heads, tokens, cell] view")
        local_heads = tensor.shape[1]
        replicas = _replicas(spec, local_heads, pos)
        if replicas is None or replicas < 1 or pos.tp_size % replicas:
            return skip(f"layer {name}: unknown TP replication of its {local_heads} KV head(s) per rank at TP "
                        f"{pos.tp_size} (model KV head count {pos.model_kv_heads})")
        shards = pos.tp_size // replicas
        first_head = next_head[module] + (pos.tp_rank // replicas) * local_heads
        next_head[module] += shards * local_heads
        if next_head[module] > MAX_KV_HEADS_PER_LAYER:
            return skip(f"layer module {module} has more than {MAX_KV_HEADS_PER_LAYER} KV heads")
        if tensor.shape[0] * tensor.shape[2] != kv_cache_config.num_blocks * block_size:
            return skip(f"layer {name}: cache of {tensor.shape[0]} kernel blocks x {tensor.shape[2]} tokens does "
                        f"not hold {kv_cache_config.num_blocks} blocks of {block_size} tokens")
        try:
            view = LayerView(tensor, block_size=block_size, layer=layer, first_head=first_head, path=path)
        except ValueError as exc:
            return skip(f"layer {name}: {exc}")
        if view.num_blocks != kv_cache_config.num_blocks:
            return skip(f"layer {name}: cache holds {view.num_blocks} blocks, not {kv_cache_config.num_blocks}")
        plan.caches.append(PlannedCache(name, layer, first_head, replicas, pos.tp_rank % replicas, view))
        plan.fingerprint = (plan.fingerprint + layer_fingerprint(name, spec)) & MASK64
    return plan


def plan_groups(kv_cache_config: KVCacheConfig, kv_caches: dict[str, torch.Tensor], pos: TPPosition,
                path: str = "auto") -> dict[int, GroupPlan]:
    """Plans of every transfer group, by KV cache group id."""
    return {gid: plan_group(gid, kv_cache_config, kv_caches, pos, path)
            for gid in kv_cache_config.transfer_group_ids}


# -- Mamba state groups -------------------------------------------------------


def plan_state_group(plan: GroupPlan, layer_names, kv_cache_config: KVCacheConfig,
                     kv_caches: dict[str, torch.Tensor], pos: TPPosition, path: str = "auto") -> GroupPlan:
    """Plan a Mamba state group (see mamba_plan.py); fills `plan` in or skips it."""
    plan.state = True
    entries = []
    for name in layer_names:
        numbered = layer_number(name)
        if numbered is None:
            return _skipped(plan, f"layer name {name!r} does not hold a single layer number")
        if name not in kv_caches:
            return _skipped(plan, f"layer {name} has no KV cache tensor on this worker")
        entries.append((numbered[0], name, numbered[1]))
    clash = _module_clash((layer, module) for layer, _, module in entries)
    if clash:
        return _skipped(plan, clash)
    tp_local = set()
    # The layers of one module (one layer number) number their rows one
    # after another, in name order, so no two slices share a factor.
    next_row = defaultdict(int)
    for layer, name, module in sorted(entries):
        spec = layer_spec(kv_cache_config.kv_cache_groups[plan.group_id].kv_cache_spec, name)
        try:
            planned = plan_state_layer(name, layer, spec, kv_caches[name], pos, kv_cache_config.num_blocks, path,
                                       first_row=next_row[module])
        except Exception as exc:  # a malformed spec from a layer must not stop the worker
            planned = f"{type(exc).__name__}: {exc}"
        if isinstance(planned, str):
            return _skipped(plan, f"layer {name}: {planned}")
        next_row[module] += planned.rows
        plan.caches.extend(planned.caches)
        plan.fingerprint = (plan.fingerprint + planned.fingerprint) & MASK64
        tp_local.add(planned.tp_local)
    plan.tp_local = True in tp_local
    return plan


def _module_clash(layer_modules) -> str | None:
    """Why (layer number, module) pairs cannot be numbered: a number used by several modules."""
    modules_by_layer = defaultdict(set)
    for layer, module in layer_modules:
        modules_by_layer[layer].add(module)
    for layer, modules in modules_by_layer.items():
        if len(modules) > 1:
            return (f"layer number {layer} is used by several modules ({', '.join(sorted(modules))}); "
                    "their slices could not be numbered the same way on every PP layout")
    return None


def _skipped(plan: GroupPlan, reason: str) -> GroupPlan:
    plan.caches, plan.fingerprint, plan.skip_reason, plan.tp_local = [], 0, reason, False
    return plan
