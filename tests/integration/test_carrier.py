"""Which requests a connector carries checksums for, and how."""

from types import SimpleNamespace

import pytest
from pd_harness import make_config
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.v1.kv_cache_interface import KVCacheConfig

from vllm_kvchecksum.carrier import KVChecksumCarrier

PULL = KVChecksumCarrier.KV_TRANSFER_PARAMS


def connector(**extra):
    config = make_config("kv_both", 1, 1, 16, connector_extra=extra or None)
    return KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER,
                                               KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[]))


def request(**params):
    return SimpleNamespace(request_id="r", kv_transfer_params=params or None)


def test_default_connector_carries_nothing():
    assert KVConnectorBase_V1.kv_checksum_carrier(None, request(), True) is None
    assert KVConnectorBase_V1.can_carry_kv_checksums(None) is False


def test_nixl_pull_carries_producer_requests_and_regular_loads():
    c = connector()
    assert c.can_carry_kv_checksums()
    assert c.kv_checksum_carrier(request(do_remote_decode=True), receiving=False) is PULL
    assert c.kv_checksum_carrier(request(do_remote_prefill=True), receiving=True) is PULL
    # A request that is not sent is not checksummed on the producer.
    assert c.kv_checksum_carrier(request(), receiving=False) is None


def test_nixl_bidirectional_load_is_not_checksummed():
    c = connector()
    params = dict(do_remote_prefill=True, do_remote_decode=True)
    assert c.kv_checksum_carrier(request(**params), receiving=True) is None


def test_nixl_push_has_no_carrier_yet():
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPushConnector

    assert NixlPushConnector._KV_CHECKSUM_CARRIER is None


@pytest.fixture
def multi(tmp_path):
    return connector(connectors=[
        {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
         "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}},
        {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
    ])


def test_multi_connector_delegates(multi, monkeypatch):
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    assert isinstance(multi, MultiConnector)
    assert multi.can_carry_kv_checksums()
    # A producer request: the first sub-connector with a carrier (NIXL).
    assert multi.kv_checksum_carrier(request(do_remote_decode=True), receiving=False) is PULL
    # A load: the sub-connector chosen to load it, or none.
    assert multi.kv_checksum_carrier(request(do_remote_prefill=True), receiving=True) is None
    multi._requests_to_connector["r"] = 1
    assert multi.kv_checksum_carrier(request(do_remote_prefill=True), receiving=True) is PULL
    multi._requests_to_connector["r"] = 0
    assert multi.kv_checksum_carrier(request(do_remote_prefill=True), receiving=True) is None
