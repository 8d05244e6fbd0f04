"""Checksum requests and records ride the step's existing channels."""

import pickle

import pd_harness
import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

from vllm_kvchecksum.core.host_copy import PendingHostCopy, new_copy_stream
from vllm_kvchecksum.core.records import GroupChecksums, KVChecksumOutput, KVChecksumRecord


def record(tp_rank, pp_rank=0, value=1):
    rec = KVChecksumRecord(tp_rank, 2, pp_rank, 2, {0: 5}, {})
    rec.requests["r"] = {0: GroupChecksums(0, 1, 16, {(1, 0): np.array([value], dtype=np.uint64)})}
    rec.num_tokens["r"] = 16
    return rec


def runner_output(kv):
    return pd_harness.model_runner_output([], [], kv)


def test_fields_default_to_none():
    assert "kv_checksum_scheduled" in SchedulerOutput.__dataclass_fields__
    assert KVConnectorOutput().kv_checksums is None
    assert KVConnectorOutput().is_empty()


def test_output_carrying_only_checksums_is_not_empty():
    # A PP stage that only checksummed must not have its output dropped.
    kv = KVConnectorOutput(kv_checksums=KVChecksumOutput([record(0)]))
    assert not kv.is_empty()
    assert ModelRunnerOutput.with_kv_conn_output_only(kv).kv_connector_output is kv


def test_aggregator_concatenates_every_workers_records():
    agg = KVOutputAggregator(expected_finished_count=4)
    outputs = [runner_output(KVConnectorOutput(kv_checksums=KVChecksumOutput([record(t, p, 10 * p + t)])))
               for p in range(2) for t in range(2)]
    outputs.append(runner_output(KVConnectorOutput()))  # a worker with nothing to report
    merged = agg.aggregate(outputs, 0).kv_connector_output.kv_checksums
    assert sorted(r.worker for r in merged.records) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert agg.aggregate([runner_output(KVConnectorOutput())], 0).kv_connector_output.kv_checksums is None


def test_values_in_flight_survive_aggregation_and_pickling():
    rec = KVChecksumRecord(0, 1, 0, 1, {}, {})
    values = torch.tensor([[7]], dtype=torch.int64)
    copy = PendingHostCopy(values, new_copy_stream(values.device),
                           lambda host: rec.requests.update(r={0: GroupChecksums(0, 1, 16, {(1, 0): host[:, 0]})}))
    agg = KVOutputAggregator(1).aggregate([runner_output(KVConnectorOutput(
        kv_checksums=KVChecksumOutput([rec], [copy])))], 0)
    received = pickle.loads(pickle.dumps(agg.kv_connector_output))
    assert received.kv_checksums.records[0].requests["r"][0].partials[(1, 0)].tolist() == [7]
