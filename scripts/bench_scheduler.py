#!/usr/bin/env python
"""Scheduler-side cost of KV checksums for one 128K-token prompt.

Measures, in one run, the producer's sum of the workers' records, the
payload's encode and decode, and the consumer's comparison, for 1 and 4
KV cache groups and TP 1 and 8 (one record per worker), as ratios to the
scheduler's own step time for the same batch: a real vLLM Scheduler
scheduling the 128K-token prompt in one step and processing its output.

    .venv/bin/python scripts/bench_scheduler.py [--tokens 131072] [--repeat 5]

Needs the patched vLLM (make setup) and the offline HF configs; it sets
HF_HOME to build/hf-home itself.
"""

from __future__ import annotations

import argparse
import os
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

from vllm_kvchecksum.compare import compare_load, sum_producer  # noqa: E402
from vllm_kvchecksum.payload import KVChecksumPayload  # noqa: E402
from vllm_kvchecksum.records import GroupChecksums, KVChecksumRecord  # noqa: E402

BLOCK = 16


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


def scheduler_step_time(tokens, repeat):
    """schedule() + update_from_output() of one step prefilling `tokens` tokens."""
    import torch
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    init_none_hash(sha256)
    max_len = tokens + 64
    config = VllmConfig(
        model_config=ModelConfig(model="facebook/opt-125m", dtype="bfloat16", max_model_len=max_len),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=max_len, max_model_len=max_len,
                                         enable_chunked_prefill=True, is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True), device_config=DeviceConfig("cpu"))
    num_blocks = 2 * tokens // BLOCK + 16
    config.cache_config.num_gpu_blocks = num_blocks
    kv_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        ["model.layers.0.attn"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8,
                                                   dtype=torch.bfloat16))])
    scheduler = Scheduler(vllm_config=config, kv_cache_config=kv_config, log_stats=False,
                          structured_output_manager=StructuredOutputManager(config), block_size=BLOCK)
    times = []
    for i in range(repeat):
        sp = SamplingParams(max_tokens=1)
        sp.update_from_generation_config({}, 2)
        req = Request(request_id=f"b{i}", prompt_token_ids=[(j * 7 + i) % 5000 + 3 for j in range(tokens)],
                      sampling_params=sp, pooling_params=None, mm_features=None,
                      block_hasher=get_request_block_hasher(BLOCK, sha256))
        scheduler.add_request(req)
        start = time.perf_counter()
        out = scheduler.schedule()
        runner = ModelRunnerOutput(req_ids=[req.request_id], req_id_to_index={req.request_id: 0},
                                   sampled_token_ids=[[5]], logprobs=None, prompt_logprobs_dict={},
                                   pooler_output=None)
        scheduler.update_from_output(out, runner)
        times.append(time.perf_counter() - start)
        scheduler.reset_prefix_cache()
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    num_blocks = args.tokens // BLOCK
    rng = np.random.default_rng(0)
    step = scheduler_step_time(args.tokens, args.repeat)
    print(f"scheduler step, one {args.tokens}-token prompt: {step * 1e3:.2f} ms (median of {args.repeat})\n")
    print("| groups | TP | producer sum ms | encode ms | payload KB | decode ms | consumer compare ms "
          "| total / step |")
    print("|---|---|---|---|---|---|---|---|")
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
            print(f"| {groups} | {tp} | {t_sum * 1e3:.2f} | {t_enc * 1e3:.2f} | {len(text) / 1e3:.0f} | "
                  f"{t_dec * 1e3:.2f} | {t_cmp * 1e3:.2f} | {total / step:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
