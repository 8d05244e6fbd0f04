"""Connector-agnostic checksums of vLLM's KV cache (see docs/definition.md)."""

from vllm_kvchecksum.core.api import layer_block_checksums
from vllm_kvchecksum.engine.carrier import KVChecksumCarrier
from vllm_kvchecksum.core.payload import KVChecksumPayload

__all__ = ["KVChecksumCarrier", "KVChecksumPayload", "layer_block_checksums"]
