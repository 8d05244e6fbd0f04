"""Connector-agnostic checksums of vLLM's KV cache (see docs/definition.md)."""

from vllm_kvchecksum.api import layer_block_checksums
from vllm_kvchecksum.carrier import KVChecksumCarrier
from vllm_kvchecksum.payload import KVChecksumPayload

__all__ = ["KVChecksumCarrier", "KVChecksumPayload", "layer_block_checksums"]
