"""KV-sharing aliases, and the config guards, on real vLLM objects.

Holds, with other inputs than the tests that already hold them:
- a layer sharing another layer's KV cache (kv_sharing_target_layer_name)
  is checksummed once, in any group and however many layers share it;
- unsupported_reason / kv_checksum_enabled / KVChecksumScheduler.create
  turn checksums off for context parallelism and for Ray with PP (unless
  the V2 Ray executor is on), and leave them on for TP/PP with "mp";
- uniform_model_kv_heads gives the model's KV head count from real model
  configs (offline HF cache), and None when the config has a separate count;
- create_kv_checksum_worker, in a world-size-1 gloo distributed environment,
  returns None when checksums are off and otherwise a worker at TP/PP rank
  0 of 1 whose values are layer_block_checksums'.
"""

from __future__ import annotations

import copy
import socket

import pytest
import torch
from kv_setup import build_caches
from pd_harness import HEAD_SIZE, NUM_BLOCKS, layer_name, make_config, settle_layout
from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                         VllmConfig, set_current_vllm_config)
from vllm.distributed import parallel_state
from vllm.v1.executor.abstract import Executor
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.worker.utils import add_kv_sharing_layers_to_kv_cache_groups

import vllm_kvchecksum
from vllm_kvchecksum.core.records import GroupBlocks, KVChecksumBlocks
from vllm_kvchecksum.engine.runner import create_kv_checksum_worker, uniform_model_kv_heads
from vllm_kvchecksum.engine.scheduler import KVChecksumScheduler, kv_checksum_enabled, unsupported_reason
from vllm_kvchecksum.engine.worker import KVChecksumWorker

BS = 16
RAY_V2 = "VLLM_USE_RAY_V2_EXECUTOR_BACKEND"


def attn(heads: int = 4) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BS, num_kv_heads=heads, head_size=HEAD_SIZE, dtype=torch.bfloat16)


def checksum(worker: KVChecksumWorker, req: KVChecksumBlocks) -> dict[int, list[int]]:
    """The worker's value per group of one request (its partials summed)."""
    record = worker.compute({"r": req}, replica_zero_only=True).finalize()[0]
    return {gid: [int(v) for v in sum(g.partials.values())] for gid, g in record.requests["r"].items()}


def expected(caches, names, req: KVChecksumBlocks, gid: int) -> list[int]:
    """layer_block_checksums summed over the named layers (each with its layer number)."""
    g = req.groups[gid]
    total = sum(vllm_kvchecksum.layer_block_checksums(
        caches[name], list(g.block_ids), req.num_tokens, first_block_position=g.start,
        layer=int(name.split(".")[2])) for name in names)
    return [int(v) for v in total]


def shared_caches(groups: list[KVCacheGroupSpec], shared: dict[str, str], seed: int = 0):
    """Caches as the model runner sets up KV sharing: the sharing layers get no
    tensor of their own, join their target's group and alias its cache."""
    config, caches = build_caches(copy.deepcopy(groups), NUM_BLOCKS, seed=seed)
    add_kv_sharing_layers_to_kv_cache_groups(shared, config.kv_cache_groups)
    for name, target in shared.items():
        caches[name] = caches[target]
    return config, caches


# -- KV-sharing aliases ------------------------------------------------------

TWO_GROUPS = KVChecksumBlocks(3 * BS + 7, {0: GroupBlocks(0, (5, 2, 7, 1)), 1: GroupBlocks(1, (6, 3, 0))})


def test_alias_in_a_second_group_is_counted_once():
    names = [layer_name(i) for i in range(6)]
    groups = [KVCacheGroupSpec(names[:2], attn()), KVCacheGroupSpec(names[2:4], attn(heads=2))]
    # Layer 5 shares layer 3's cache (group 1); layer 4 shares layer 2's.
    config, caches = shared_caches(groups, {names[5]: names[3], names[4]: names[2]})
    assert sorted(config.kv_cache_groups[1].layer_names) == names[2:]
    alone_config, _ = build_caches(groups, NUM_BLOCKS)
    w = KVChecksumWorker(config, caches, tp_rank=0, tp_size=1, model_kv_heads=None)
    without = KVChecksumWorker(alone_config, {n: caches[n] for n in names[:4]}, tp_rank=0, tp_size=1,
                               model_kv_heads=None)
    assert [c.name for c in w.plans[1].caches] == names[2:4]
    got = checksum(w, TWO_GROUPS)
    assert got == checksum(without, TWO_GROUPS)
    assert got[1] == expected(caches, names[2:4], TWO_GROUPS, 1)
    assert got[0] == expected(caches, names[:2], TWO_GROUPS, 0)
    assert w.fingerprints == without.fingerprints


def test_two_aliases_of_one_target_are_counted_once():
    names = [layer_name(i) for i in range(4)]
    # YOCO-style: layers 2 and 3 both reuse layer 0's KV.
    config, caches = shared_caches([KVCacheGroupSpec(names[:2], attn())],
                                   {names[2]: names[0], names[3]: names[0]}, seed=3)
    assert config.kv_cache_groups[0].layer_names == names
    w = KVChecksumWorker(config, caches, tp_rank=0, tp_size=1, model_kv_heads=None)
    assert [c.name for c in w.plans[0].caches] == names[:2]
    req = KVChecksumBlocks(2 * BS + 1, {0: GroupBlocks(0, (4, 6, 1))})
    assert checksum(w, req)[0] == expected(caches, names[:2], req, 0)
    alone_config, _ = build_caches([KVCacheGroupSpec(names[:2], attn())], NUM_BLOCKS)
    without = KVChecksumWorker(alone_config, {n: caches[n] for n in names[:2]}, tp_rank=0, tp_size=1,
                               model_kv_heads=None)
    assert w.fingerprints == without.fingerprints
    # The shared cache is still checksummed: a change in it changes the value.
    before = checksum(w, req)[0]
    caches[names[0]][4, 0, 0].view(torch.uint8)[0] ^= 1
    assert checksum(w, req)[0] != before


# -- real VllmConfigs ----------------------------------------------------------

_model_configs: dict[str, ModelConfig] = {}


def model_config(model: str) -> ModelConfig:
    """A fresh copy of the model's config (read from the offline HF cache once)."""
    if model not in _model_configs:
        _model_configs[model] = ModelConfig(model=model, dtype="bfloat16", seed=0, max_model_len=2048)
    return copy.deepcopy(_model_configs[model])


def vllm_config(model: str = "facebook/opt-125m", connector: str = "NixlConnector", *, enable: bool = True,
                fail_closed: bool = False, **parallel) -> VllmConfig:
    """Like pd_harness.make_config, with any model, connector and ParallelConfig."""
    kv = KVTransferConfig(kv_connector=connector, kv_role="kv_both", kv_buffer_device="cpu",
                          enable_kv_checksum=enable, kv_checksum_fail_closed=fail_closed)
    return settle_layout(VllmConfig(
        model_config=model_config(model),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048, max_model_len=2048,
                                         enable_chunked_prefill=True, is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
        parallel_config=ParallelConfig(**parallel), kv_transfer_config=kv, device_config=DeviceConfig("cpu")))


def dcp_config(**kw) -> VllmConfig:
    # vLLM accepts DCP only with TP above the model's KV heads (Qwen3-0.6B:
    # 8), at most 2 with 8 heads at TP16, and NIXL only with DCP == TP: so
    # TP16, DCP2, with a connector that does not check it.
    return vllm_config("Qwen/Qwen3-0.6B", "ExampleConnector", tensor_parallel_size=16,
                       decode_context_parallel_size=2, distributed_executor_backend="mp", **kw)


def pcp_config(**kw) -> VllmConfig:
    # No real VllmConfig with PCP builds here: the V1 model runner refuses
    # it and the V2 one needs Triton. So PCP is set after construction.
    config = make_config("kv_both", 2, 1, BS, **kw)
    config.parallel_config.prefill_context_parallel_size = 2
    return config


def ray_pp2_config(**kw) -> VllmConfig:
    return vllm_config(pipeline_parallel_size=2, distributed_executor_backend="ray", **kw)


class CarryingConnector:
    """A scheduler-side connector that carries checksums (all create asks of it)."""

    def can_carry_kv_checksums(self) -> bool:
        return True


def scheduler_kv_cache_config() -> KVCacheConfig:
    """The scheduler's KVCacheConfig, as pd_harness.make_side builds it."""
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec([layer_name(i) for i in range(4)], attn())])


def create_scheduler(config: VllmConfig):
    return KVChecksumScheduler.create(config, scheduler_kv_cache_config(), CarryingConnector())


def _has_legacy_ray_executor() -> bool:
    from vllm import envs

    return RAY_V2 in envs.environment_variables


needs_legacy_ray = pytest.mark.skipif(not _has_legacy_ray_executor(),
                                      reason="this vLLM has only the Ray V2 executor (0.34 dropped the switch)")


UNSUPPORTED = {
    "dcp2": (dcp_config, "decode_context_parallel_size"),
    "pcp2": (pcp_config, "prefill_context_parallel_size"),
    # The legacy Ray executor (gone in vLLM 0.34) with PP.
    **({"ray-pp2": (ray_pp2_config, RAY_V2)} if _has_legacy_ray_executor() else {}),
}


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_parallel_setups_disable_checksums(case, monkeypatch):
    monkeypatch.setenv(RAY_V2, "0")  # the legacy Ray executor
    build, named = UNSUPPORTED[case]
    config = build()
    assert config.kv_transfer_config.enable_kv_checksum
    reason = unsupported_reason(config)
    assert reason is not None and named in reason
    assert kv_checksum_enabled(config) is False
    assert create_scheduler(config) is None


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_setup_with_fail_closed_is_off_not_an_error(case, monkeypatch):
    monkeypatch.setenv(RAY_V2, "0")
    config = UNSUPPORTED[case][0](fail_closed=True)
    assert KVChecksumScheduler.create(config, scheduler_kv_cache_config(), None) is None
    assert create_scheduler(config) is None


@needs_legacy_ray
@pytest.mark.parametrize("value, enabled", [("1", True), ("0", False)])
def test_ray_pp2_needs_the_v2_ray_executor(value, enabled, monkeypatch):
    monkeypatch.setenv(RAY_V2, value)
    config = ray_pp2_config()
    # The executor vLLM would run: the V2 one keeps every stage's connector output.
    assert (Executor.get_class(config).__name__ == "RayExecutorV2") is enabled
    assert (unsupported_reason(config) is None) is enabled
    assert kv_checksum_enabled(config) is enabled
    assert (create_scheduler(config) is not None) is enabled


@pytest.mark.parametrize("value", [None, "2"], ids=["unset", "2"])
def test_ray_pp2_with_vllms_default_v2_executor_keeps_checksums_on(value, monkeypatch):
    if value is None:
        monkeypatch.delenv(RAY_V2, raising=False)
    else:
        monkeypatch.setenv(RAY_V2, value)
    config = ray_pp2_config()
    assert Executor.get_class(config).__name__ == "RayExecutorV2"
    assert unsupported_reason(config) is None


def test_ray_without_pp_is_supported(monkeypatch):
    monkeypatch.setenv(RAY_V2, "0")  # the legacy executor gathers every rank of the last PP stage
    config = vllm_config(tensor_parallel_size=2, distributed_executor_backend="ray")
    assert unsupported_reason(config) is None
    assert kv_checksum_enabled(config)


def test_ray_with_tp_only_creates_the_checksum_scheduler(monkeypatch):
    monkeypatch.setenv(RAY_V2, "0")
    scheduler = create_scheduler(vllm_config(tensor_parallel_size=2, distributed_executor_backend="ray",
                                             fail_closed=True))
    assert isinstance(scheduler, KVChecksumScheduler)
    assert scheduler.num_workers == 2 and scheduler.fail_closed


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2), (2, 2)])
def test_tp_and_pp_with_mp_keep_checksums_on(tp, pp, monkeypatch):
    monkeypatch.delenv(RAY_V2, raising=False)
    config = make_config("kv_both", tp, pp, BS)
    assert config.parallel_config.distributed_executor_backend == "mp"
    assert unsupported_reason(config) is None
    assert kv_checksum_enabled(config)
    scheduler = create_scheduler(config)
    assert isinstance(scheduler, KVChecksumScheduler)
    assert scheduler.num_workers == tp * pp and scheduler.tp_size == tp


def test_checksums_off_in_a_supported_setup_create_nothing():
    config = make_config("kv_both", 2, 2, BS, enable=False)
    assert unsupported_reason(config) is None
    assert kv_checksum_enabled(config) is False
    assert create_scheduler(config) is None


# -- uniform_model_kv_heads --------------------------------------------------

MODEL_KV_HEADS = {"facebook/opt-125m": 12, "Qwen/Qwen3-0.6B": 8, "Qwen/Qwen1.5-7B": 32}
SEPARATE_COUNTS = ("num_global_key_value_heads", "global_num_key_value_heads", "num_key_value_heads_per_layer",
                   "num_kv_heads_per_layer", "swa_num_key_value_heads", "num_swa_key_value_heads")


@pytest.mark.parametrize("model", list(MODEL_KV_HEADS))
def test_uniform_model_kv_heads_of_real_models(model):
    config = vllm_config(model)
    assert uniform_model_kv_heads(config) == MODEL_KV_HEADS[model]
    assert config.model_config.get_total_num_kv_heads() == MODEL_KV_HEADS[model]


@pytest.mark.parametrize("attribute", SEPARATE_COUNTS)
def test_separate_kv_head_count_in_the_hf_config_gives_none(attribute, monkeypatch):
    config = vllm_config("Qwen/Qwen3-0.6B")
    hf = config.model_config.hf_text_config
    monkeypatch.setattr(hf, attribute, None, raising=False)
    assert uniform_model_kv_heads(config) == 8  # present but unset: no separate count
    monkeypatch.setattr(hf, attribute, 4)
    assert uniform_model_kv_heads(config) is None


def test_per_layer_kv_head_list_in_the_hf_config_gives_none_even_when_uniform(monkeypatch):
    config = vllm_config("facebook/opt-125m")
    hf = config.model_config.hf_text_config
    for attribute in SEPARATE_COUNTS:
        assert getattr(hf, attribute, None) is None
    monkeypatch.setattr(hf, "swa_num_key_value_heads", None, raising=False)
    assert uniform_model_kv_heads(config) == 12
    # The count is there at all: which layers it describes is not known.
    monkeypatch.setattr(hf, "num_kv_heads_per_layer", [12] * config.model_config.get_total_num_hidden_layers(),
                        raising=False)
    assert uniform_model_kv_heads(config) is None


def set_per_layer_overrides(config: VllmConfig, overrides: dict[int, dict]) -> None:
    """Per-layer overrides of the model's arch config (a frozen dataclass, built once per config)."""
    num_layers = config.model_config.get_total_num_hidden_layers()
    object.__setattr__(config.model_config.model_arch_config, "per_layer_overrides",
                       [overrides.get(i, {}) for i in range(num_layers)])


def test_per_layer_kv_head_override_of_the_last_layer_gives_none():
    config = vllm_config("facebook/opt-125m")
    # Overrides of other fields leave the count alone.
    set_per_layer_overrides(config, {11: {"head_size": 128}})
    assert uniform_model_kv_heads(config) == 12
    set_per_layer_overrides(config, {11: {"total_num_kv_heads": 4}})
    assert uniform_model_kv_heads(config) is None


def test_per_layer_kv_head_override_equal_to_the_total_gives_none():
    config = vllm_config("Qwen/Qwen3-0.6B")
    set_per_layer_overrides(config, {0: {"sliding_window": 128}, 5: {"head_size": 64}})
    assert uniform_model_kv_heads(config) == 8
    set_per_layer_overrides(config, {0: {"sliding_window": 128}, 5: {"total_num_kv_heads": 8}})
    assert uniform_model_kv_heads(config) is None


# -- create_kv_checksum_worker -------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def world_of_one():
    """vLLM's TP and PP groups for one CPU process (gloo), torn down after the test.

    The state is per process (each pytest-xdist worker is one), and the
    teardown restores it, so other tests never see these groups.
    """
    assert not torch.distributed.is_initialized() and not parallel_state.model_parallel_is_initialized()
    config = make_config("kv_both", 1, 1, BS)
    with set_current_vllm_config(config):
        parallel_state.init_distributed_environment(
            world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{free_port()}", local_rank=0,
            backend="gloo")
        parallel_state.ensure_model_parallel_initialized(1, 1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        parallel_state.destroy_distributed_environment()
    assert not torch.distributed.is_initialized() and not parallel_state.model_parallel_is_initialized()


def worker_caches():
    names = [layer_name(i) for i in range(3)]
    config, caches = build_caches([KVCacheGroupSpec(names, attn(heads=12))], NUM_BLOCKS, seed=11)
    return names, config, caches


def test_create_worker_with_checksums_off_is_none(world_of_one):
    _, config, caches = worker_caches()
    assert create_kv_checksum_worker(make_config("kv_both", 1, 1, BS, enable=False), config, caches) is None


@needs_legacy_ray
def test_create_worker_in_an_unsupported_setup_is_none(world_of_one, monkeypatch):
    monkeypatch.setenv(RAY_V2, "0")
    _, config, caches = worker_caches()
    assert create_kv_checksum_worker(ray_pp2_config(), config, caches) is None


def test_create_worker_with_context_parallelism_is_none(world_of_one):
    _, config, caches = worker_caches()
    assert create_kv_checksum_worker(dcp_config(), config, caches) is None
    assert create_kv_checksum_worker(pcp_config(), config, caches) is None


def test_create_worker_with_the_v2_ray_executor_and_pp(world_of_one, monkeypatch):
    # The config's PP2 decides only whether checksums run; the ranks are
    # the process's own (one process here).
    monkeypatch.setenv(RAY_V2, "1")
    _, config, caches = worker_caches()
    worker = create_kv_checksum_worker(ray_pp2_config(), config, caches)
    assert isinstance(worker, KVChecksumWorker)
    assert (worker.tp_rank, worker.tp_size, worker.pp_rank, worker.pp_size) == (0, 1, 0, 1)


def test_create_worker_checksums_a_real_cache(world_of_one):
    names, config, caches = worker_caches()
    worker = create_kv_checksum_worker(make_config("kv_both", 1, 1, BS), config, caches)
    assert isinstance(worker, KVChecksumWorker)
    assert (worker.tp_rank, worker.tp_size, worker.pp_rank, worker.pp_size) == (0, 1, 0, 1)
    assert worker.skipped_groups == {}
    req = KVChecksumBlocks(2 * BS + 9, {0: GroupBlocks(0, (17, 3, 40))})
    assert checksum(worker, req)[0] == expected(caches, names, req, 0)
    # One block of one layer: the library's value of that block.
    one = KVChecksumBlocks(BS - 3, {0: GroupBlocks(0, (5,))})
    value = vllm_kvchecksum.layer_block_checksums(caches[names[1]], [5], BS - 3, layer=1)
    caches[names[0]].zero_()
    caches[names[2]].zero_()
    assert checksum(worker, one)[0] == [int(value[0])]
