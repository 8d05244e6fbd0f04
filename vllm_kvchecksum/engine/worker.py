"""KVChecksumWorker: a worker's partial checksums of the KV cache it holds.

Created by the model runner's KV connector glue when
kv_transfer_config.enable_kv_checksum is set, after the KV cache is
allocated. Each step that has requests to checksum, the glue calls
`compute` after the forward (and the drafter) wrote the KV; the result rides
the worker's KVConnectorOutput to the scheduler, which sums the TP and PP
parts.

The one state kept across steps is the table of pending loads: the
scheduler sends a load's blocks once, when it starts, and the worker keeps
them until its own connector reports the load finished (then checksums and
drops them) or the scheduler says to forget the request. Scheduler outputs
reach a worker in the order they were made, so the table follows the
scheduler's.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np
import torch

from vllm_kvchecksum.engine.group_plan import GroupPlan, TPPosition, plan_groups
from vllm_kvchecksum.core.host_copy import PendingHostCopy, new_copy_stream
from vllm_kvchecksum.core.records import (GroupChecksums, KVChecksumBlocks, KVChecksumOutput, KVChecksumRecord,
                                          RecordPurpose)
from vllm_kvchecksum.engine.export_guard import TAINTED_ENTRY
from vllm_kvchecksum.engine.offload import block_checksum_tags
from vllm_kvchecksum.core.rows import BLOCK_IDS, RequestBlocks, build_rows

# A child of "vllm", so it logs through vLLM's handlers and format.
logger = logging.getLogger("vllm.kv_checksum")


class KVChecksumWorker:
    """Computes one worker's partial KV checksums per request and group.

    kv_cache_config / kv_caches: the worker's own config and its per-layer
      [blocks, heads, tokens, cell] cache views (as registered with the KV
      connector).
    tp_rank, tp_size, pp_rank, pp_size: the worker's place in the model.
    model_kv_heads: the model's KV head count when every layer shares it,
      else None (see group_plan.TPPosition).
    """

    def __init__(self, kv_cache_config, kv_caches: Mapping[str, torch.Tensor], *, tp_rank: int, tp_size: int,
                 pp_rank: int = 0, pp_size: int = 1, model_kv_heads: int | None, device: torch.device | None = None,
                 path: str = "auto"):
        self.tp_rank, self.tp_size, self.pp_rank, self.pp_size = tp_rank, tp_size, pp_rank, pp_size
        self.plans: dict[int, GroupPlan] = plan_groups(
            kv_cache_config, dict(kv_caches), TPPosition(tp_rank, tp_size, model_kv_heads), path)
        self.fingerprints = {g: p.fingerprint for g, p in self.plans.items() if p.skip_reason is None}
        self.skipped_groups = {g: p.skip_reason for g, p in self.plans.items() if p.skip_reason is not None}
        self.tp_local_groups = frozenset(g for g, p in self.plans.items() if p.tp_local and p.skip_reason is None)
        # Groups with caches on this worker (a PP stage may hold none of a group).
        self._active = [g for g, p in self.plans.items() if p.caches]
        if device is None:
            first = next((c.view.device for g in self._active for c in self.plans[g].caches), None)
            device = first or torch.device("cpu")
        self.device = torch.device(device)
        self._copy_stream = new_copy_stream(self.device)
        # Consumer loads started and not yet finished on this worker, by
        # request id: their blocks are sent once, when the load starts.
        self._pending_recvs: dict[str, KVChecksumBlocks] = {}
        # Offloaded KV (init_block_checksums): one entry per block, and the
        # groups they are kept for.
        self.num_blocks = kv_cache_config.num_blocks
        self.block_checksums: torch.Tensor | None = None
        self.offload_groups: frozenset[int] = frozenset()
        # Block ids holding KV that failed its check (fail-open), as the
        # scheduler last said (KVChecksumScheduled.tainted_blocks): their
        # entries are saved poisoned (export_guard.py).
        self.tainted_blocks: frozenset[int] = frozenset()
        for gid, reason in sorted(self.skipped_groups.items()):
            logger.warning("KV checksums: KV cache group %d is not checksummed: %s", gid, reason)
        if tp_rank == 0:
            logger.info(
                "KV checksums enabled on PP stage %d: groups %s checksummed (%d caches on this rank), "
                "groups %s skipped", pp_rank, self._active,
                sum(len(self.plans[g].caches) for g in self._active), sorted(self.skipped_groups))

    def warm_up(self) -> None:
        """Compile the kernel for every layer shape now, not in the first checksummed step."""
        seen = set()
        for gid in self._active:
            for cache in self.plans[gid].caches:
                pieces = cache.view.caches[0].pieces
                shape = (tuple(pieces.shape), pieces.dtype, cache.view.block_size)
                if shape not in seen:
                    seen.add(shape)
                    cache.view.warm_up()

    # -- pending consumer loads -------------------------------------------

    def forget_loads(self, req_ids) -> None:
        """Drop the pending loads of requests the scheduler no longer waits for."""
        for req_id in req_ids:
            self._pending_recvs.pop(req_id, None)

    def expect_loads(self, reqs: Mapping[str, KVChecksumBlocks]) -> None:
        """Keep the blocks of loads that start in this step until they finish here."""
        self._pending_recvs.update(reqs)

    def compute_finished_loads(self, finished_recving, received: Mapping[str, bytes] | None = None
                               ) -> KVChecksumOutput | None:
        """Queue the checksums of the pending loads this worker's connector
        reports finished, and drop them; None if there is nothing to report
        (a load whose request was forgotten is not checksummed).

        received: the producer's checksums a connector-owned carrier
        delivered to this worker, by request id. Those of pending loads go in
        the record (KVChecksumRecord.received), for the scheduler to compare
        with; others are dropped, so what is kept follows this worker's own
        table, not what another host sent. Only the first worker
        (`forwards_received`) passes them on: every worker of a load gets the
        same payload, and one copy per load through the executor is enough.
        """
        kept = {rid: bytes(data) for rid, data in (received or {}).items()
                if self.forwards_received and rid in self._pending_recvs and isinstance(data, (bytes, bytearray))}
        loaded = {rid: self._pending_recvs.pop(rid) for rid in finished_recving or () if rid in self._pending_recvs}
        if loaded:
            output = self.compute(loaded, replica_zero_only=False, purpose=RecordPurpose.LOAD)
        elif kept:
            output = KVChecksumOutput([self.new_record()])
        else:
            return None
        output.add_received(kept)
        return output

    def report_read_after_release(self, req_ids) -> KVChecksumOutput | None:
        """A record naming the producer requests whose KV this worker's
        connector says a consumer read after it released the blocks; None
        for none. Every worker reports its own (a request read from several
        workers is counted once, by the scheduler).
        """
        named = frozenset(r for r in req_ids or () if isinstance(r, str))
        if not named:
            return None
        record = self.new_record()
        record.read_after_release = named
        return KVChecksumOutput([record])

    @property
    def forwards_received(self) -> bool:
        """Whether this worker passes on the checksums its connector received.

        The first worker of the first PP stage: its output always reaches the
        scheduler, and its load cannot finish without the connector's message
        that carries them (NIXL push notif, Mooncake response). If a
        misbehaving producer sends them to other workers only, the load is
        unverified (no_producer_checksums), never verified.
        """
        return self.tp_rank == 0 and self.pp_rank == 0

    @property
    def pending_load_ids(self) -> frozenset[str]:
        """The requests whose loads this worker still waits for (for tests and logs)."""
        return frozenset(self._pending_recvs)

    # -- checksums ----------------------------------------------------------

    def new_record(self) -> KVChecksumRecord:
        return KVChecksumRecord(self.tp_rank, self.tp_size, self.pp_rank, self.pp_size,
                                dict(self.fingerprints), dict(self.skipped_groups),
                                tp_local_groups=self.tp_local_groups, offload_groups=self.offload_groups)

    def _request_rows(self, gid: int, blocks, num_tokens: int) -> RequestBlocks:
        """The rows of one request's blocks in a group.

        A state block holds one state, not tokens: its views take it as one
        full row of block size 1 at position 0.
        """
        if self.plans[gid].state:
            return RequestBlocks(blocks.block_ids, 0, len(blocks.block_ids))
        return RequestBlocks(blocks.block_ids, blocks.start, num_tokens)

    def compute(self, reqs: Mapping[str, KVChecksumBlocks], *, replica_zero_only: bool,
                purpose: str | None = None) -> KVChecksumOutput:
        """Queue the checksums of `reqs`' blocks; the values arrive with the output.

        replica_zero_only: a producer sends replica 0 only; a consumer checks
        every replica of replicated layers, so it computes them all.
        purpose: what the record is for (RecordPurpose); by default a send
        with replica_zero_only, else a finished load.
        Loads of offloaded KV (KVChecksumBlocks.offloaded) cover the groups
        this worker stores entries for, and also report those entries, as
        the connector wrote them back (KVChecksumRecord.stored).
        Call after the step's forward (and drafter): kernels run on the
        current stream and the copy to host waits on it.
        """
        record = self.new_record()
        record.purpose = purpose or (RecordPurpose.SEND if replica_zero_only else RecordPurpose.LOAD)
        for req_id, blocks in reqs.items():
            record.requests[req_id] = {}
            record.num_tokens[req_id] = blocks.num_tokens
        groups = []  # (gid, [(req_id, GroupBlocks)], caches)
        for gid in self._active:
            caches = [c for c in self.plans[gid].caches if not (replica_zero_only and c.replica_index)]
            members = [(rid, b.groups[gid]) for rid, b in reqs.items()
                       if gid in b.groups and (not b.offloaded or gid in self.offload_groups)]
            if members:
                groups.append((gid, members, caches))
        if not groups:
            return KVChecksumOutput([record])
        stored = any(reqs[rid].offloaded for _, members, _ in groups for rid, _ in members)
        rows, table, out, column = self._accumulate(
            [(gid, [self._request_rows(gid, gb, reqs[rid].num_tokens) for rid, gb in members], caches)
             for gid, members, caches in groups], extra_columns=int(stored))
        stored_column = out.shape[1] - 1
        if stored:
            for gi in range(len(groups)):
                row, count = rows.groups[gi]
                out[row:row + count, stored_column] = self.block_checksums[rows.group_rows(table, gi)[0]]

        def deliver(host) -> None:
            for gi, (gid, members, caches) in enumerate(groups):
                group_keys = sorted({c.key for c in caches})
                block_size = self.plans[gid].block_size
                for (rid, gb), (row, count) in zip(members, rows.requests[gi]):
                    record.requests[rid][gid] = GroupChecksums(
                        gb.start, count, block_size,
                        {k: host[row:row + count, column[k]].copy() for k in group_keys})
                    if reqs[rid].offloaded:
                        record.stored.setdefault(rid, {})[gid] = host[row:row + count, stored_column].copy()

        return KVChecksumOutput([record], [PendingHostCopy(out, self._copy_stream, deliver)])

    def _accumulate(self, groups, extra_columns: int = 0):
        """Queue the per-block partial sums of several groups' rows.

        groups: (gid, [RequestBlocks], caches) per group. Returns (rows, the
        rows' table on the device, out [rows, keys + extra_columns] int64,
        key -> column of out).
        """
        rows = build_rows([members for _, members, _ in groups],
                          [1 if self.plans[gid].state else self.plans[gid].block_size for gid, _, _ in groups],
                          pin_memory=self.device.type == "cuda")
        keys = sorted({c.key for _, _, caches in groups for c in caches})
        column = {k: i for i, k in enumerate(keys)}
        out = torch.zeros((rows.table.shape[1], max(1, len(keys)) + extra_columns), dtype=torch.int64,
                          device=self.device)
        table = rows.to_device(self.device)
        for gi, (_, _, caches) in enumerate(groups):
            block_ids, first_tokens, valid_tokens = rows.group_rows(table, gi)
            row, count = rows.groups[gi]
            group_out = out[row:row + count]
            for cache in caches:
                cache.view.accumulate(group_out, column[cache.key], block_ids, first_tokens, valid_tokens)
        return rows, table, out, column

    # -- checksums stored with offloaded KV (offload.py) ----------------------

    def init_block_checksums(self, group_ids) -> torch.Tensor:
        """The entries a connector stores with each offloaded block.

        Called by the connector (after set_kv_checksum_worker, from
        register_kv_caches) with the KV cache groups it offloads. Returns a
        (num_blocks,) int64 tensor on the KV cache device: entry b is this
        worker's checksum of block b, tagged (offload.block_checksum_tags),
        once save_block_checksums filled it. The connector moves an entry
        wherever it moves the block's KV, and writes it back before it
        reports the load finished. Groups this worker cannot checksum (and
        Mamba state groups) are not covered; loads of them are not checked.
        Several connectors (MultiConnector's children) may call it: they
        share the one tensor, and the groups covered are the union of theirs.
        """
        covered = []
        for gid in group_ids:
            plan = self.plans.get(gid)
            if plan is None or plan.skip_reason is not None or plan.state:
                logger.warning("KV checksums: KV cache group %s is not checked when loaded back from offloading: "
                               "%s", gid, "no such group" if plan is None else plan.skip_reason
                               or "Mamba state is not stored per block")
                continue
            covered.append(gid)
        self.offload_groups = self.offload_groups | frozenset(covered)
        if self.block_checksums is None:
            self.block_checksums = torch.zeros(self.num_blocks, dtype=torch.int64, device=self.device)
        return self.block_checksums

    def save_block_checksums(self, runs) -> None:
        """Fill the entries of full blocks a connector is about to offload.

        runs: offload.BlockChecksumRun (group, first position, block ids,
        block hashes). Queued on the current stream: call after the forward
        that wrote the blocks and before the connector reads them (e.g.
        before the event its sending thread waits on). Runs of groups not
        covered are ignored. A block holding KV that failed its check
        (tainted_blocks) gets an entry that never matches it, so no load of
        it from any tier verifies.
        """
        if self.block_checksums is None:
            return
        by_group: dict[int, list] = {}
        for run in runs:
            if run.group_id in self.offload_groups and len(run.block_ids) and run.group_id in self._active:
                by_group.setdefault(run.group_id, []).append(run)
        if not by_group:
            return
        gids = sorted(by_group)
        rows, table, out, _ = self._accumulate(
            [(gid, [RequestBlocks(r.block_ids, r.start, (r.start + len(r.block_ids)) * self.plans[gid].block_size)
                    for r in by_group[gid]], self.plans[gid].caches) for gid in gids])
        # Which rows hold a run's block (not a group's padding row), and their tags.
        picked, tags = [], []
        for gi, gid in enumerate(gids):
            for run, (row, count) in zip(by_group[gid], rows.requests[gi]):
                picked.append(np.arange(row, row + count))
                tag = block_checksum_tags(run.block_hashes, self.fingerprints[gid])
                if self.tainted_blocks:
                    tag = tag ^ np.array([TAINTED_ENTRY if b in self.tainted_blocks else 0 for b in run.block_ids],
                                         dtype=np.uint64)
                tags.append(tag)
        picked_rows = torch.from_numpy(np.concatenate(picked)).to(self.device, non_blocking=True)
        tag_values = torch.from_numpy(np.concatenate(tags).view(np.int64)).to(self.device, non_blocking=True)
        values = out.sum(dim=1).index_select(0, picked_rows) ^ tag_values
        block_ids = table[BLOCK_IDS].index_select(0, picked_rows)
        self.block_checksums.index_copy_(0, block_ids, values)
