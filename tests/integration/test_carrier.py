"""Which requests a connector carries checksums for, and how."""

from types import SimpleNamespace

import pytest
from pd_harness import make_config
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.v1.kv_cache_interface import KVCacheConfig

from vllm_kvchecksum.carrier import KVChecksumCarrier

PULL = KVChecksumCarrier.KV_TRANSFER_PARAMS


def connector(kind="NixlConnector", **extra):
    config = make_config("kv_both", 1, 1, 16, connector=kind, connector_extra=extra or None)
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


def test_nixl_push_carries_them_in_its_own_messages():
    c = connector(kind="NixlPushConnector")
    assert c.can_carry_kv_checksums()
    assert c.kv_checksum_carrier(request(do_remote_decode=True), receiving=False) is KVChecksumCarrier.CONNECTOR
    assert c.kv_checksum_carrier(request(do_remote_prefill=True), receiving=True) is KVChecksumCarrier.CONNECTOR
    assert c.kv_checksum_carrier(request(), receiving=False) is None


def test_default_connector_sends_no_checksums():
    assert KVConnectorBase_V1.send_kv_checksums(None, request(), b"x") is False


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


class _Child:
    """A sub-connector that records what MultiConnector forwards to it."""

    def __init__(self, carrier, sends=True, results=None):
        self.carrier, self.sends, self.results, self.sent = carrier, sends, results, []

    def kv_checksum_carrier(self, request, receiving):
        return self.carrier

    def send_kv_checksums(self, request, checksums):
        self.sent.append((request.request_id, checksums))
        return self.sends

    def get_transfer_results(self, finished_req_ids):
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

        return self.results or KVConnectorTransferResults()


def test_multi_connector_sends_through_the_carrying_child(multi):
    children = [_Child(None), _Child(KVChecksumCarrier.CONNECTOR), _Child(KVChecksumCarrier.CONNECTOR)]
    multi._connectors = children
    assert multi.send_kv_checksums(request(do_remote_decode=True), b"CS") is True
    assert [c.sent for c in children] == [[], [("r", b"CS")], []]
    children[1].sends = False
    assert multi.send_kv_checksums(request(do_remote_decode=True), b"CS") is False
    multi._connectors = [_Child(None)]
    assert multi.send_kv_checksums(request(do_remote_decode=True), b"CS") is False


def test_multi_connector_merges_childrens_checksums(multi):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

    multi._connectors = [
        _Child(None, results=KVConnectorTransferResults(finished_recving={"a"}, kv_checksums={"a": b"1"})),
        _Child(None, results=KVConnectorTransferResults(finished_recving={"b"},
                                                        kv_checksums={"b": b"2", "a": b"other"})),
    ]
    results = multi.get_transfer_results(set())
    assert results.finished_recving == {"a", "b"}
    assert results.kv_checksums == {"a": b"1", "b": b"2"}


@pytest.mark.parametrize("kind,name", [("NixlConnector", "kv_transfer_params"),
                                       ("NixlPushConnector", "connector"), ("MooncakeConnector", "connector")])
def test_startup_line_names_the_carrier(kind, name):
    from vllm_kvchecksum.scheduler import _carrier_name

    assert _carrier_name(connector(kind=kind)) == name


def test_mooncake_carries_router_requests_only():
    c = connector(kind="MooncakeConnector")
    connector_carrier = KVChecksumCarrier.CONNECTOR
    assert c.can_carry_kv_checksums()
    assert c.kv_checksum_carrier(request(do_remote_decode=True, transfer_id="x"), receiving=False) \
        is connector_carrier
    assert c.kv_checksum_carrier(request(do_remote_prefill=True, transfer_id="x"), receiving=True) \
        is connector_carrier
    # No transfer id: Mooncake transfers nothing for it.
    assert c.kv_checksum_carrier(request(do_remote_decode=True), receiving=False) is None
    assert c.kv_checksum_carrier(request(do_remote_prefill=True), receiving=True) is None
