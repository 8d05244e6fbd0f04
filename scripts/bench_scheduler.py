#!/usr/bin/env python
"""Scheduler-side cost of KV checksums for one 128K-token prompt.

Measures, in one run, the producer's sum of the workers' records, the
payload's encode and decode, the consumer's comparison, and the producer's
re-check when its transfer completes (kv_checksum_producer_recheck: the sum
of the second records and its comparison with what was sent), for 1 and 4
KV cache groups and TP 1 and 8 (one record per worker), as ratios to the
scheduler's own step time for the same batch: a real vLLM Scheduler
scheduling the 128K-token prompt in one step and processing its output.

    .venv/bin/python scripts/bench_scheduler.py [--tokens 131072] [--repeat 5]

With --in-flight it measures instead what each step's SchedulerOutput
carries for KV checksums on a consumer with 1, 16, 64 and 256 loads of
--load-tokens tokens in flight: its pickled bytes and pickling time, when
every step re-lists every pending load (the old scheme) and in a steady
decode step now (what build_checksum_meta returns), as ratios to a real
scheduler decode step of --decode-batch requests measured in the same run:

    .venv/bin/python scripts/bench_scheduler.py --in-flight [--load-tokens 32768] [--decode-batch 64]

With --consumer it measures what the consumer's scheduler thread pays per
load between decode steps: decoding the producer's payload and comparing a
P/D load (compare_load), and comparing a load of offloaded KV against its
stored entries (compare_offloaded), for a --tokens load with 1 and 4 groups
and TP 1 and 8, as ratios to a real scheduler decode step of 256 and of 64
running requests measured in the same run:

    .venv/bin/python scripts/bench_scheduler.py --consumer [--tokens 131072]

Needs the patched vLLM (make setup) and the offline HF configs; it sets
HF_HOME to build/hf-home itself.
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HOME", str(ROOT / "build" / "hf-home"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from vllm_kvchecksum.core.compare import compare_load, sum_producer  # noqa: E402
from vllm_kvchecksum.core.payload import KVChecksumPayload  # noqa: E402
from vllm_kvchecksum.core.records import GroupChecksums, KVChecksumRecord, KVChecksumScheduled  # noqa: E402

BLOCK = 16
IN_FLIGHT = (1, 16, 64, 256)


def timed(fn, repeat):
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def records(num_blocks, groups, tp, rng):
    out = []
    for rank in range(tp):
        rec = KVChecksumRecord(rank, tp, 0, 1, {g: 1000 + g for g in range(groups)}, {})
        rec.requests["r"] = {g: GroupChecksums(0, num_blocks, BLOCK, {(1, 0): rng.integers(
            0, 2**63, num_blocks, dtype=np.uint64)}) for g in range(groups)}
        rec.num_tokens["r"] = num_blocks * BLOCK
        out.append(rec)
    return out


def vllm_setup(max_len, num_blocks, max_num_seqs, kv_transfer_config=None):
    """A VllmConfig and a one-group KVCacheConfig for a CPU scheduler."""
    import torch
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    config = VllmConfig(
        model_config=ModelConfig(model="facebook/opt-125m", dtype="bfloat16", max_model_len=max_len),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_len,
                                         max_model_len=max_len, enable_chunked_prefill=True,
                                         is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True), device_config=DeviceConfig("cpu"),
        kv_transfer_config=kv_transfer_config)
    config.cache_config.num_gpu_blocks = num_blocks
    kv_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        ["model.layers.0.attn"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8,
                                                   dtype=torch.bfloat16))])
    return config, kv_config


def new_scheduler(config, kv_config):
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    init_none_hash(sha256)
    return Scheduler(vllm_config=config, kv_cache_config=kv_config, log_stats=False,
                     structured_output_manager=StructuredOutputManager(config), block_size=BLOCK)


def new_request(request_id, prompt, max_tokens):
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=max_tokens)
    sp.update_from_generation_config({}, 2)
    return Request(request_id=request_id, prompt_token_ids=prompt, sampling_params=sp, pooling_params=None,
                   mm_features=None, block_hasher=get_request_block_hasher(BLOCK, sha256))


def run_step(scheduler):
    """schedule() + update_from_output(), each scheduled request sampling one token; the output."""
    from vllm.v1.outputs import ModelRunnerOutput

    out = scheduler.schedule()
    reqs = list(out.num_scheduled_tokens)
    scheduler.update_from_output(out, ModelRunnerOutput(
        req_ids=reqs, req_id_to_index={r: i for i, r in enumerate(reqs)}, sampled_token_ids=[[5] for _ in reqs],
        logprobs=None, prompt_logprobs_dict={}, pooler_output=None))
    return out


def scheduler_step_time(tokens, repeat):
    """schedule() + update_from_output() of one step prefilling `tokens` tokens."""
    max_len = tokens + 64
    scheduler = new_scheduler(*vllm_setup(max_len, 2 * tokens // BLOCK + 16, max_num_seqs=4))
    times = []
    for i in range(repeat):
        scheduler.add_request(new_request(f"b{i}", [(j * 7 + i) % 5000 + 3 for j in range(tokens)], 1))
        start = time.perf_counter()
        run_step(scheduler)
        times.append(time.perf_counter() - start)
        scheduler.reset_prefix_cache()
    return statistics.median(times)


def decode_step(batch, repeat):
    """A real scheduler's decode step of `batch` running requests (checksums
    off): median seconds of schedule() + update_from_output(), and the
    pickled bytes and median pickling seconds of its SchedulerOutput."""
    prompt_len, max_tokens = 512, 1024  # none finishes while the others prefill
    scheduler = new_scheduler(*vllm_setup(4096, batch * (prompt_len + max_tokens) // BLOCK + 64, max_num_seqs=batch))
    reqs = [new_request(f"d{i}", [(j * 7 + i) % 5000 + 3 for j in range(prompt_len)], max_tokens=max_tokens)
            for i in range(batch)]
    for req in reqs:
        scheduler.add_request(req)
    while any(req.num_computed_tokens < prompt_len for req in reqs):
        run_step(scheduler)  # the prefills, chunked by the token budget
    times, out = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        out = run_step(scheduler)
        times.append(time.perf_counter() - start)
    assert len(out.num_scheduled_tokens) == batch and out.total_num_scheduled_tokens == batch
    return statistics.median(times), len(pickle.dumps(out)), timed(lambda: pickle.dumps(out), repeat)


class _CarriesInParams:
    """The scheduler half of a connector whose loads carry checksums in kv_transfer_params."""

    def kv_checksum_carrier(self, request, receiving):
        from vllm_kvchecksum.engine.carrier import KVChecksumCarrier

        return KVChecksumCarrier.KV_TRANSFER_PARAMS


def checksum_scheduler_with_loads(num_loads, load_tokens, rng):
    """A KVChecksumScheduler whose first step started `num_loads` loads of
    `load_tokens` tokens each (block ids drawn from a 256-load cache, so
    their pickled size does not depend on the count)."""
    from types import SimpleNamespace

    from vllm.config import KVTransferConfig

    from vllm_kvchecksum.engine.scheduler import KVChecksumScheduler

    kv = KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_consumer", enable_kv_checksum=True)
    config, kv_config = vllm_setup(load_tokens + 64, 16, max_num_seqs=4, kv_transfer_config=kv)
    checksums = KVChecksumScheduler(config, kv_config, _CarriesInParams())
    blocks_per_load = load_tokens // BLOCK
    pool = rng.permutation(np.arange(1, max(IN_FLIGHT) * blocks_per_load + 1))
    for i in range(num_loads):
        block_ids = pool[i * blocks_per_load:(i + 1) * blocks_per_load].tolist()
        request = SimpleNamespace(request_id=f"load-{i}", kv_transfer_params={}, num_tokens=load_tokens)
        checksums.add_recv(request, (block_ids,), 0, load_tokens)
    return checksums


def pickled(obj, repeat):
    return len(pickle.dumps(obj)), timed(lambda: pickle.dumps(obj), repeat)


def in_flight_table(args) -> None:
    rng = np.random.default_rng(0)
    step, step_bytes, step_pickle = decode_step(args.decode_batch, args.repeat)
    print(f"scheduler decode step, {args.decode_batch} running requests: {step * 1e3:.2f} ms (median of "
          f"{args.repeat}); its SchedulerOutput pickles to {step_bytes / 1024:.1f} KiB in "
          f"{step_pickle * 1e3:.3f} ms\n")
    print("| loads in flight | before: KiB / step | before: x step output bytes | before: pickle ms "
          "| before: pickle / step | after: bytes / step | after: pickle ms | after: pickle / step "
          "| sent once per load: KiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for num_loads in IN_FLIGHT:
        checksums = checksum_scheduler_with_loads(num_loads, args.load_tokens, rng)
        start_bytes = len(pickle.dumps(checksums.build_checksum_meta()))
        # The old scheme: every step re-listed every pending load.
        before = KVChecksumScheduled(reqs_to_recv={rid: p.blocks for rid, p in checksums._recvs.items()})
        after = checksums.build_checksum_meta()  # a steady decode step
        b_bytes, b_time = pickled(before, args.repeat)
        a_bytes, a_time = pickled(after, args.repeat)
        print(f"| {num_loads} | {b_bytes / 1024:.1f} | {b_bytes / step_bytes:.0f} | {b_time * 1e3:.2f} | "
              f"{b_time / step:.3f} | {a_bytes} ({after!r}) | {a_time * 1e3:.4f} | {a_time / step:.4f} | "
              f"{start_bytes / num_loads / 1024:.1f} |")


def offloaded_records(num_blocks, groups, tp, rng):
    """Worker records of an intact offloaded load, with their stored entries, and the block hashes."""
    from vllm_kvchecksum.engine.offload import block_checksum_tags

    hashes = [rng.bytes(32) for _ in range(num_blocks)]
    recs = records(num_blocks, groups, tp, rng)
    for rec in recs:
        rec.offload_groups = frozenset(range(groups))
        rec.stored["r"] = {g: rec.requests["r"][g].partials[(1, 0)] ^ block_checksum_tags(hashes, rec.fingerprints[g])
                           for g in range(groups)}
    return recs, hashes


def consumer_table(args) -> None:
    from vllm_kvchecksum.engine.offload import compare_offloaded
    from vllm_kvchecksum.engine.request_binding import bind_payload, request_content

    rng = np.random.default_rng(0)
    num_blocks = args.tokens // BLOCK
    steps = {batch: decode_step(batch, args.repeat)[0] for batch in (256, 64)}
    print(f"scheduler decode step: {steps[256] * 1e3:.2f} ms with 256 running requests, {steps[64] * 1e3:.2f} ms "
          f"with 64 (medians of {args.repeat})\n")
    print(f"one {args.tokens}-token load ({num_blocks} blocks of {BLOCK} per group):\n")
    # One vLLM Request holding the prompt: both sides bind from their own.
    request = new_request("r", [int(t) for t in rng.integers(0, 50_000, size=args.tokens)], 1)
    print("| groups | TP | P/D: decode ms | P/D: compare ms | of which binding ms | producer: binding ms "
          "| P/D total / 256-step | P/D total / 64-step "
          "| offloaded: compare ms | offloaded / 256-step | offloaded / 64-step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for groups in (1, 4):
        for tp in (1, 8):
            recs = records(num_blocks, groups, tp, rng)
            scheduled = {g: (0, num_blocks) for g in range(groups)}
            unbound = sum_producer(recs, "r", tp, scheduled, args.tokens, tp).payload
            # The producer binds its payload to the request when it finishes (request_finished).
            t_pbind = timed(lambda: bind_payload(unbound, request), args.repeat)
            text = bind_payload(unbound, request).encode()
            t_dec = timed(lambda: KVChecksumPayload.decode(text), args.repeat)
            payload = KVChecksumPayload.decode(text)
            cons = {g: (0, num_blocks, BLOCK) for g in range(groups)}

            def compare(bound=True):  # as the scheduler judges a load: its request's content read anew
                return compare_load(payload, recs, "r", tp, cons, args.tokens,
                                    own=request_content(request) if bound else None)
            assert compare().status.value == "verified"
            t_cmp = timed(compare, args.repeat)
            t_values = timed(lambda: compare(False), args.repeat)
            off, hashes = offloaded_records(num_blocks, groups, tp, rng)
            block_hashes = {g: hashes for g in range(groups)}
            verdict = compare_offloaded(off, "r", tp, scheduled, args.tokens, block_hashes)
            assert verdict.status.value == "verified", verdict.describe()
            t_off = timed(lambda: compare_offloaded(off, "r", tp, scheduled, args.tokens, block_hashes), args.repeat)
            pd = t_dec + t_cmp
            print(f"| {groups} | {tp} | {t_dec * 1e3:.2f} | {t_cmp * 1e3:.2f} | {(t_cmp - t_values) * 1e3:.2f} | "
                  f"{t_pbind * 1e3:.2f} | {pd / steps[256]:.2f} | "
                  f"{pd / steps[64]:.2f} | {t_off * 1e3:.2f} | {t_off / steps[256]:.2f} | {t_off / steps[64]:.2f} |")
    # A steady step with loads in flight: the hooks the patched Scheduler calls every step
    # (build_checksum_meta in schedule(); collect, verify_sync_loads and
    # verify_finished_loads in update_from_output()), with nothing new to report.
    print("\nthe checksum hooks of one steady step (no load starts or finishes), by loads in flight:\n")
    print("| loads in flight | hooks us / step | / 256-step | / 64-step |")
    print("|---|---|---|---|")
    for num_loads in (0, 256):
        checksums = checksum_scheduler_with_loads(num_loads, 32768, rng)
        checksums.build_checksum_meta()  # the step that started them

        def steady_step():
            scheduled = checksums.build_checksum_meta()
            checksums.collect(None)
            checksums.verify_sync_loads(scheduled)
            checksums.verify_finished_loads((), ())
        assert len(checksums._recvs) == num_loads
        t_hooks = timed(steady_step, args.repeat * 100)
        print(f"| {num_loads} | {t_hooks * 1e6:.2f} | {t_hooks / steps[256]:.4f} | {t_hooks / steps[64]:.4f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--in-flight", action="store_true",
                        help="measure the per-step checksum part of SchedulerOutput with loads in flight")
    parser.add_argument("--load-tokens", type=int, default=32768)
    parser.add_argument("--decode-batch", type=int, default=64)
    parser.add_argument("--consumer", action="store_true",
                        help="measure the consumer's per-load cost against decode steps of 256 and 64 requests")
    args = parser.parse_args()
    if args.in_flight:
        in_flight_table(args)
        return 0
    if args.consumer:
        consumer_table(args)
        return 0
    num_blocks = args.tokens // BLOCK
    rng = np.random.default_rng(0)
    step = scheduler_step_time(args.tokens, args.repeat)
    print(f"scheduler step, one {args.tokens}-token prompt: {step * 1e3:.2f} ms (median of {args.repeat})\n")
    from vllm_kvchecksum.engine.recheck import RecheckStatus, recheck
    print("| groups | TP | producer sum ms | encode ms | payload KB | decode ms | consumer compare ms "
          "| total / step | producer re-check ms | re-check / step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for groups in (1, 4):
        for tp in (1, 8):
            recs = records(num_blocks, groups, tp, rng)
            scheduled = {g: (0, num_blocks) for g in range(groups)}
            t_sum = timed(lambda: sum_producer(recs, "r", tp, scheduled, args.tokens, tp), args.repeat)
            payload = sum_producer(recs, "r", tp, scheduled, args.tokens, tp).payload
            t_enc = timed(payload.encode, args.repeat)
            text = payload.encode()
            t_dec = timed(lambda: KVChecksumPayload.decode(text), args.repeat)
            cons = {g: (0, num_blocks, BLOCK) for g in range(groups)}
            verdict = compare_load(payload, recs, "r", tp, cons, args.tokens)
            assert verdict.status.value == "verified", verdict.describe()
            t_cmp = timed(lambda: compare_load(payload, recs, "r", tp, cons, args.tokens), args.repeat)
            total = t_sum + t_enc + t_dec + t_cmp

            def producer_recheck():  # the second records summed as the first, then compared
                return recheck(payload, sum_producer(recs, "r", tp, scheduled, args.tokens, tp).payload)
            assert producer_recheck().status == RecheckStatus.INTACT
            t_re = timed(producer_recheck, args.repeat)
            print(f"| {groups} | {tp} | {t_sum * 1e3:.2f} | {t_enc * 1e3:.2f} | {len(text) / 1e3:.0f} | "
                  f"{t_dec * 1e3:.2f} | {t_cmp * 1e3:.2f} | {total / step:.3f} | {t_re * 1e3:.2f} | "
                  f"{t_re / step:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
