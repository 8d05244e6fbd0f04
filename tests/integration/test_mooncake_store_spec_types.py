"""The Mooncake store checks loads of groups that are exactly FullAttentionSpec or
MLAAttentionSpec, not of their subclasses.

vLLM 0.32's other subclasses of FullAttentionSpec: RSWASpec (R-SWA,
deepseek_v2's RSWAAttention: RSWAManager frees a decoding request's gap
blocks, replacing them with the null block, while the request runs),
SinkFullAttentionSpec (StaticSinkAttention, openpangu: attention also reads
sink KV written once into blocks no request or store key holds),
HiddenStateCacheSpec (extract_hidden_states: the cache holds hidden states,
not KV), and any spec a platform registers (register_custom_kv_cache_specs).
vLLM groups them with full attention (uniform_type_base_spec=FullAttentionSpec),
so one group can mix them with plain full attention layers. None of their
cache semantics is what the store's checks were built and tested for (the
e2e test runs full attention), so each is refused at startup by its name:
loads from the store are then said to be unchecked rather than claimed
checked. The store's own TP-sharded layout uses the same exact-type rule
("subclasses may use different sharding or cache-lifetime semantics").
"""

from __future__ import annotations

import logging

import pytest
import torch
from log_capture import capture_logger
from test_mooncake_store_checksums import FULL, _config, _kv_cache_config
from vllm.v1.kv_cache_interface import (HiddenStateCacheSpec, MLAAttentionSpec, RSWASpec, SinkFullAttentionSpec,
                                        UniformTypeKVCacheSpecs)

kv_checksums = pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.kv_checksums",
    reason="the Mooncake store patch of the series is not applied")

LOGGER = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.kv_checksums"
KW = dict(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
RSWA = RSWASpec(**KW, rswa_window=32)
SINK = SinkFullAttentionSpec(**KW, sink_len=16)
HIDDEN = HiddenStateCacheSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.bfloat16)
MLA = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.bfloat16)


def not_checked_reason(kv_cache_config, caplog) -> str:
    """The startup warning's text when the store does not check its loads."""
    with capture_logger(caplog, LOGGER):
        assert not kv_checksums.store_kv_checksums_enabled(_config(), kv_cache_config, 16, log=True)
    record = next(r for r in caplog.records if r.levelno == logging.WARNING and "Mooncake" in r.getMessage())
    assert "loads from the Mooncake store are NOT checked" in record.getMessage()
    return record.getMessage()


def test_full_attention_and_mla_groups_are_checked():
    assert kv_checksums.store_kv_checksums_enabled(_config(), _kv_cache_config(FULL, MLA), 16)


@pytest.mark.parametrize("spec", [RSWA, SINK, HIDDEN], ids=lambda s: type(s).__name__)
def test_subclasses_of_full_attention_are_not_checked(spec, caplog):
    assert isinstance(spec, FULL.__class__)
    reason = not_checked_reason(_kv_cache_config(FULL, spec), caplog)
    assert f"KV cache group 1 is {type(spec).__name__}, not full attention" in reason


def test_a_uniform_group_holding_rswa_layers_is_not_checked(caplog):
    # vLLM itself puts full attention and R-SWA layers in one group.
    uniform = UniformTypeKVCacheSpecs.from_specs({"model.layers.0.attn": FULL, "model.layers.1.attn": RSWA})
    assert uniform is not None
    reason = not_checked_reason(_kv_cache_config(uniform), caplog)
    assert "KV cache group 0 is RSWASpec, not full attention" in reason
