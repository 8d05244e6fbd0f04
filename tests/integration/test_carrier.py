"""Which requests a connector carries checksums for, and how."""

from pd_harness import carrier_request, scheduler_connector
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from vllm_kvchecksum.engine.carrier import KVChecksumCarrier

PULL = KVChecksumCarrier.KV_TRANSFER_PARAMS


connector, request = scheduler_connector, carrier_request


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


def test_startup_line_names_the_carrier():
    from vllm_kvchecksum.engine.scheduler import _carrier_name

    assert _carrier_name(connector()) == "kv_transfer_params"
