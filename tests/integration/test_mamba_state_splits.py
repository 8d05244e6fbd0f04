"""How TP splits Mamba states (MambaStateSplit / MambaSpec.state_splits), on real vLLM objects.

Holds, at TP 1, 2 and 4, with the conv state laid out (state_len, dim) and (dim, state_len):
- the splits of Mamba1, Mamba2 (8 groups: B and C sharded; 1 group: B and C on every rank) and GDN partition the
  local shapes from the matching *_state_shape along their axis, the conv axis being the channel one of the oriented
  conv shape and the temporal axis 0;
- a segment's global size (local * tp // replicas) is the same at every TP size, and B and C of a one-group Mamba2
  have replicas == tp at TP > 1;
- the calculators return None, and do not raise, for sizes TP does not divide and for group counts MambaMixer2 refuses;
- MambaBase.get_kv_cache_spec puts get_state_splits() into MambaSpec.state_splits (None by default), and
  MambaMixer2.get_kv_cache_spec keeps them, with and without ReplaySSM (whose ring states are not described);
- the real layers' conv1d weight loaders (MambaMixer, MambaMixer2, the Qwen and OLMo GDN layers) put on each TP rank
  exactly the global conv rows its splits name, in that order: x, B, C and Q, K, V.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen3NextConfig
from vllm.config import CacheConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import parallel_state
from vllm.model_executor.layers.mamba import mamba_utils
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator as Calc
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import MambaSpec, MambaStateSplit

TP_SIZES = (1, 2, 4)
CONV_KERNEL, NUM_SPEC = 4, 2  # conv state length 5, unlike any channel count below
CONV_LEN = CONV_KERNEL - 1 + NUM_SPEC

# name: (shape function, splits function, arguments but tp_world_size, global segment sizes of (conv, temporal)).
CASES = {
    "mamba1": (Calc.mamba1_state_shape, Calc.mamba1_state_splits,
               dict(intermediate_size=256, state_size=16, conv_kernel=CONV_KERNEL), ((256,), (256,))),
    "mamba2_8_groups": (Calc.mamba2_state_shape, Calc.mamba2_state_splits,
                        dict(intermediate_size=256, n_groups=8, num_heads=8, head_dim=32, state_size=16,
                             conv_kernel=CONV_KERNEL, num_spec=NUM_SPEC), ((256, 128, 128), (8,))),
    "mamba2_1_group": (Calc.mamba2_state_shape, Calc.mamba2_state_splits,
                       dict(intermediate_size=256, n_groups=1, num_heads=8, head_dim=32, state_size=16,
                            conv_kernel=CONV_KERNEL, num_spec=NUM_SPEC), ((256, 16, 16), (8,))),
    "gdn": (Calc.gated_delta_net_state_shape, Calc.gated_delta_net_state_splits,
            dict(num_k_heads=4, num_v_heads=8, head_k_dim=16, head_v_dim=32, conv_kernel_size=CONV_KERNEL,
                 num_spec=NUM_SPEC), ((64, 64, 256), (8,))),
}


@pytest.fixture(params=["SD", "DS"])
def conv_layout(request, monkeypatch):
    """The conv state layout, set through its env var (get_conv_state_layout caches it)."""
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", request.param)
    mamba_utils.get_conv_state_layout.cache_clear()
    assert mamba_utils.is_conv_state_dim_first() == (request.param == "DS")
    yield request.param
    mamba_utils.get_conv_state_layout.cache_clear()


def global_sizes(split: MambaStateSplit, tp: int) -> tuple[int, ...]:
    return tuple(local * tp // replicas for local, replicas in split.segments)


def global_rows(split: MambaStateSplit, tp: int, rank: int) -> list[int]:
    """The global rows rank `rank` holds along split.axis, in local order (MambaStateSplit's definition)."""
    rows, start = [], 0
    for local, replicas in split.segments:
        first = start + (rank // replicas) * local
        rows += range(first, first + local)
        start += local * tp // replicas
    return rows


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("case", CASES)
def test_splits_partition_the_local_shapes(case, tp, conv_layout):
    shape_fn, splits_fn, kwargs, expected_global = CASES[case]
    conv_shape, temporal_shape = shape_fn(tp_world_size=tp, **kwargs)
    splits = splits_fn(tp_world_size=tp, **kwargs)
    assert splits is not None and len(splits) == 2
    conv, temporal = splits

    channel_axis = 0 if conv_layout == "DS" else 1
    assert conv.axis == channel_axis
    assert conv_shape[1 - channel_axis] == (CONV_LEN if "num_spec" in kwargs else CONV_KERNEL - 1)
    assert temporal.axis == 0
    for split, shape in ((conv, conv_shape), (temporal, temporal_shape)):
        assert sum(local for local, _ in split.segments) == shape[split.axis]
        assert all(local > 0 and 1 <= replicas <= tp and tp % replicas == 0 for local, replicas in split.segments)
    assert (global_sizes(conv, tp), global_sizes(temporal, tp)) == expected_global


@pytest.mark.parametrize("case", CASES)
def test_global_segments_do_not_depend_on_tp(case):
    _, splits_fn, kwargs, _ = CASES[case]
    by_tp = {tp: tuple(global_sizes(s, tp) for s in splits_fn(tp_world_size=tp, **kwargs)) for tp in TP_SIZES}
    assert len(set(by_tp.values())) == 1, by_tp


@pytest.mark.parametrize("tp", TP_SIZES)
def test_mamba2_b_and_c_replicas(tp):
    _, splits_fn, kwargs, _ = CASES["mamba2_1_group"]
    x, b, c = splits_fn(tp_world_size=tp, **kwargs)[0].segments
    assert x == (256 // tp, 1)
    assert b == c == (16, tp)  # every rank holds the one group's B and C whole
    _, splits_fn, kwargs, _ = CASES["mamba2_8_groups"]
    x, b, c = splits_fn(tp_world_size=tp, **kwargs)[0].segments
    assert b == c == (8 // tp * 16, 1)


@pytest.mark.parametrize(("case", "tp", "changes"), [
    ("mamba1", 4, dict(intermediate_size=250)),
    ("mamba2_8_groups", 4, dict(num_heads=6)),
    ("mamba2_8_groups", 4, dict(intermediate_size=250)),
    ("mamba2_8_groups", 4, dict(n_groups=2)),  # neither a multiple of TP nor 1: MambaMixer2 refuses it
    ("mamba2_8_groups", 2, dict(n_groups=3)),
    ("gdn", 4, dict(num_k_heads=2)),  # fewer K heads than ranks
    ("gdn", 4, dict(num_v_heads=6)),
    ("gdn", 8, {}),
])
def test_none_for_sizes_tp_does_not_divide(case, tp, changes, conv_layout):
    _, splits_fn, kwargs, _ = CASES[case]
    assert splits_fn(tp_world_size=tp, **{**kwargs, **changes}) is None


# -- MambaBase.get_kv_cache_spec ---------------------------------------------------------------------------------------

SPLITS = (MambaStateSplit(axis=1, segments=((64, 1), (16, 2), (16, 2))), MambaStateSplit(axis=0, segments=((4, 1),)))


def spec_config(use_replayssm: bool = False) -> SimpleNamespace:
    return SimpleNamespace(
        cache_config=SimpleNamespace(mamba_block_size=16, mamba_page_size_padded=None, mamba_cache_mode="none",
                                     use_replayssm=use_replayssm),
        num_speculative_tokens=0)


class _Layer(MambaBase):
    def get_state_shape(self):
        return ((3, 96), (4, 16, 16))

    def get_state_dtype(self):
        return (torch.bfloat16, torch.float32)

    @property
    def mamba_type(self):
        return MambaAttentionBackendEnum.MAMBA2


class _SplitLayer(_Layer):
    def get_state_splits(self):
        return SPLITS


def test_mamba_base_spec_carries_the_splits():
    spec = _SplitLayer().get_kv_cache_spec(spec_config())
    assert isinstance(spec, MambaSpec) and spec.state_splits == SPLITS
    assert _Layer().get_kv_cache_spec(spec_config()).state_splits is None
    # A layer's spec stays hashable and equal to itself with splits; they take part in its equality.
    assert hash(spec) == hash(_SplitLayer().get_kv_cache_spec(spec_config()))
    assert spec != _Layer().get_kv_cache_spec(spec_config())
    assert MambaSpec.merge([spec, spec]).state_splits == SPLITS


# -- The real layers, at a given TP rank, without a distributed environment ------------------------------------------

@pytest.fixture
def make_layer(monkeypatch):
    """make_layer(build, tp, rank, **config): build(VllmConfig(**config), prefix) at TP rank `rank` of `tp`."""
    def make(build, tp: int, rank: int, **config_changes):
        monkeypatch.setattr(parallel_state, "get_tp_group", lambda: SimpleNamespace(rank_in_group=rank, world_size=tp))
        config = VllmConfig(**config_changes)
        with set_current_vllm_config(config):
            return build(config, "model.layers.0.mixer")
    return make


def mamba1(config, prefix):
    from vllm.model_executor.layers.mamba.mamba_mixer import MambaMixer
    return MambaMixer(hidden_size=64, ssm_state_size=16, conv_kernel_size=CONV_KERNEL, intermediate_size=256,
                      time_step_rank=8, use_conv_bias=False, use_bias=False, use_rms_norm=False,
                      model_config=SimpleNamespace(dtype=torch.bfloat16), cache_config=config.cache_config,
                      prefix=prefix)


def mamba2(n_groups):
    def build(config, prefix):
        from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
        return MambaMixer2(hidden_size=64, ssm_state_size=16, conv_kernel_size=CONV_KERNEL, intermediate_size=256,
                           use_conv_bias=True, use_bias=False, n_groups=n_groups, num_heads=8, head_dim=32,
                           model_config=SimpleNamespace(dtype=torch.bfloat16), cache_config=config.cache_config,
                           prefix=prefix)
    return build


GDN_CONFIG = dict(hidden_size=64, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=16,
                  linear_value_head_dim=32, linear_conv_kernel_dim=CONV_KERNEL, num_attention_heads=4,
                  num_key_value_heads=2)


def gdn(kind):
    def build(config, prefix):
        hf_config = Qwen3NextConfig(**GDN_CONFIG)
        object.__setattr__(config, "model_config", SimpleNamespace(hf_text_config=hf_config, dtype=torch.bfloat16))
        if kind == "qwen":
            from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
            return QwenGatedDeltaNetAttention(hf_config, config, prefix=prefix)
        from vllm.model_executor.layers.mamba.gdn import olmo_gdn_linear_attn
        with pytest.MonkeyPatch.context() as mp:  # it sets a Triton allocator, which the CPU build lacks
            mp.setattr(olmo_gdn_linear_attn, "set_triton_allocator", lambda device: None)
            return olmo_gdn_linear_attn.OlmoHybridGatedDeltaNetAttention(hf_config, config, prefix=prefix)
    return build


def load_conv_weight(layer, kind: str, global_weight: torch.Tensor) -> None:
    """Load a checkpoint's conv1d weight the way the model's load_weights does."""
    param = layer.conv1d.weight
    if kind == "olmo":  # q_conv1d, k_conv1d and v_conv1d load as shards 0, 1, 2 of the fused conv1d
        key_dim = GDN_CONFIG["linear_num_key_heads"] * GDN_CONFIG["linear_key_head_dim"]
        for shard_id, (start, end) in enumerate(((0, key_dim), (key_dim, 2 * key_dim), (2 * key_dim, None))):
            param.weight_loader(param, global_weight[start:end], shard_id)
    else:
        param.weight_loader(param, global_weight)


@pytest.mark.parametrize(("kind", "build", "tp", "checkpoint_conv_dim"), [
    ("mamba1", mamba1, 2, 256),
    ("mamba2", mamba2(8), 2, 256 + 2 * 8 * 16),
    ("mamba2", mamba2(8), 4, 256 + 2 * 8 * 16),
    ("mamba2", mamba2(1), 2, 256 + 2 * 16),
    ("mamba2", mamba2(1), 4, 256 + 2 * 16),
    ("qwen", gdn("qwen"), 2, 2 * 64 + 256),
    ("olmo", gdn("olmo"), 4, 2 * 64 + 256),
], ids=["mamba1-tp2", "mamba2-8g-tp2", "mamba2-8g-tp4", "mamba2-1g-tp2", "mamba2-1g-tp4", "qwen-gdn-tp2",
        "olmo-gdn-tp4"])
def test_layer_weight_loaders_hold_the_rows_the_splits_name(make_layer, kind, build, tp, checkpoint_conv_dim):
    # Row i of the checkpoint's conv1d weight holds the value i.
    global_weight = torch.arange(checkpoint_conv_dim, dtype=torch.float32)[:, None, None].expand(
        -1, 1, CONV_KERNEL).contiguous()
    for rank in range(tp):
        layer = make_layer(build, tp, rank)
        splits = layer.get_state_splits()
        assert splits is not None
        conv, temporal = splits
        assert sum(global_sizes(conv, tp)) == checkpoint_conv_dim
        load_conv_weight(layer, kind, global_weight.to(layer.conv1d.weight.dtype))
        local_rows = layer.conv1d.weight[:, 0, 0].float().long().tolist()
        assert local_rows == global_rows(conv, tp, rank), f"rank {rank}"
        conv_shape, temporal_shape = layer.get_state_shape()[:2]
        assert conv_shape[conv.axis] == len(local_rows)
        assert temporal_shape[0] == sum(local for local, _ in temporal.segments)


@pytest.mark.parametrize("use_replayssm", [False, True])
def test_mamba_mixer2_spec_keeps_the_splits(make_layer, use_replayssm):
    config_changes = {}
    if use_replayssm:
        config_changes["cache_config"] = CacheConfig(use_replayssm=True, replayssm_buffer_len=4)
    layer = make_layer(mamba2(1), 4, 3, **config_changes)
    spec = layer.get_kv_cache_spec(spec_config(use_replayssm))
    assert isinstance(spec, MambaSpec)
    assert spec.num_prefill_checkpoint_blocks == 1  # MambaMixer2's own replace() ran
    assert len(spec.shapes) == (5 if use_replayssm else 2)
    assert spec.state_splits == Calc.mamba2_state_splits(tp_world_size=4, intermediate_size=256, n_groups=1,
                                                         num_heads=8, head_dim=32, state_size=16,
                                                         conv_kernel=CONV_KERNEL, num_spec=0)
    assert spec.state_splits[0].segments[1:] == ((16, 4), (16, 4))
