"""The kv_transfer_config flags of the series, on the patched vLLM."""

import json

import pytest
from pydantic import ValidationError

from vllm.config import KVTransferConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}


def parse_cli(*argv: str) -> EngineArgs:
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    return EngineArgs.from_cli_args(parser.parse_args(["--model", "facebook/opt-125m", *argv]))


def test_defaults_off():
    config = KVTransferConfig(**NIXL)
    assert config.enable_kv_checksum is False
    assert config.kv_checksum_fail_closed is False


def test_python_api():
    config = KVTransferConfig(**NIXL, enable_kv_checksum=True, kv_checksum_fail_closed=True)
    assert config.enable_kv_checksum is True
    assert config.kv_checksum_fail_closed is True


@pytest.mark.parametrize("fail_closed", [False, True])
def test_cli_json(fail_closed):
    payload = dict(NIXL, enable_kv_checksum=True, kv_checksum_fail_closed=fail_closed)
    args = parse_cli("--kv-transfer-config", json.dumps(payload))
    assert args.kv_transfer_config.enable_kv_checksum is True
    assert args.kv_transfer_config.kv_checksum_fail_closed is fail_closed


def test_cli_dotted_keys():
    args = parse_cli("--kv-transfer-config.kv_connector", "NixlConnector",
                     "--kv-transfer-config.kv_role", "kv_both",
                     "--kv-transfer-config.enable_kv_checksum", "true")
    assert args.kv_transfer_config.enable_kv_checksum is True


@pytest.mark.parametrize("bad", ["sometimes", 3, [True]])
def test_bad_value_is_a_config_error(bad):
    with pytest.raises(ValidationError, match="enable_kv_checksum"):
        KVTransferConfig(**NIXL, enable_kv_checksum=bad)
    with pytest.raises((ValidationError, SystemExit, ValueError)):
        parse_cli("--kv-transfer-config", json.dumps(dict(NIXL, kv_checksum_fail_closed=bad)))


def test_fail_closed_needs_checksums():
    with pytest.raises(ValueError, match="kv_checksum_fail_closed=True needs enable_kv_checksum=True"):
        KVTransferConfig(**NIXL, kv_checksum_fail_closed=True)


def compile_identity(config: KVTransferConfig):
    """What the config contributes to the compiled graph's cache key:
    compute_hash() on vLLM 0.32, compile_factors() since 0.34."""
    if hasattr(config, "compile_factors"):
        return config.compile_factors()
    return config.compute_hash()


def test_flags_leave_the_compile_hash_alone():
    # The checksums read the KV after the forward; the graph is the same.
    assert compile_identity(KVTransferConfig(**NIXL, enable_kv_checksum=True, kv_checksum_fail_closed=True)) == \
        compile_identity(KVTransferConfig(**NIXL))
