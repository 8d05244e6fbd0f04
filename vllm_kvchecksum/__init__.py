"""Connector-agnostic checksums of vLLM's KV cache (see docs/definition.md)."""

from vllm_kvchecksum.api import layer_block_checksums

__all__ = ["layer_block_checksums"]
