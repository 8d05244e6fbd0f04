"""How a connector carries a request's checksums from producer to consumer."""

from __future__ import annotations

import enum

# The kv_transfer_params key holding the encoded KVChecksumPayload.
KV_TRANSFER_PARAMS_KEY = "kv_checksums"


class KVChecksumCarrier(enum.Enum):
    """A connector's answer to kv_checksum_carrier(request, receiving).

    KV_TRANSFER_PARAMS: the producer's scheduler adds the encoded checksums
      to the kv_transfer_params its connector returns for the request (key
      "kv_checksums"); the proxy forwards them to the consumer with the
      request, whose scheduler reads them when the load starts. The
      connector needs no code of its own beyond declaring it.
    CONNECTOR: the connector moves the checksums in its own messages
      (e.g. the notif of a NIXL WRITE); the bytes reach the consumer's
      workers and come back in their records.
    """

    KV_TRANSFER_PARAMS = "kv_transfer_params"
    CONNECTOR = "connector"
