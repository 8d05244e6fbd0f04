#!/usr/bin/env python
"""Real prefill/decode on CPU with KV checksums: two vLLM engines, NIXL pull.

    .venv/bin/python scripts/pd_smoke.py [--model build/tiny-llama] [--corrupt]

The producer engine prefills a prompt (max_tokens=1, do_remote_decode) and
returns kv_transfer_params with "kv_checksums"; the consumer engine loads
the KV over NIXL (UCX on loopback), verifies it fail-closed, and decodes.
Its greedy output must equal a single engine's. Prints one line per check
and exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def engine(model: str, role: str, port: int, fail_closed: bool):
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
    from vllm import LLM

    kv = {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu",
          "enable_kv_checksum": True, "kv_checksum_fail_closed": fail_closed}
    return LLM(model=model, dtype="bfloat16", max_model_len=512, enforce_eager=True, gpu_memory_utilization=0.1,
               kv_transfer_config=kv, seed=0)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=str(ROOT / "build" / "tiny-llama"))
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_tiny_model import make

    model = str(make(Path(args.model)).resolve())
    from vllm import SamplingParams

    prompt = " ".join(f"w{(i * 37) % 500 + 4}" for i in range(100))
    producer = engine(model, "kv_producer", 5611, fail_closed=True)
    out = producer.generate([prompt], SamplingParams(max_tokens=1, temperature=0, extra_args={
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}))[0]
    params = out.kv_transfer_params
    ok = True
    print(f"producer kv_transfer_params keys: {sorted(params or {})}")
    if not params or "kv_checksums" not in params:
        print("FAIL: the producer returned no kv_checksums")
        return 1
    print(f"payload: {len(params['kv_checksums'])} base64 characters")
    # The reference: the same prompt prefilled and decoded on one engine.
    reference = producer.generate([prompt], SamplingParams(max_tokens=16, temperature=0))[0].outputs[0].text
    consumer = engine(model, "kv_consumer", 5711, fail_closed=True)
    sp = SamplingParams(max_tokens=16, temperature=0, extra_args={"kv_transfer_params": params})
    got = consumer.generate([prompt], sp)[0].outputs[0]
    print(f"consumer: finish_reason={got.finish_reason} stop_reason={got.stop_reason} text={got.text!r}")
    if got.finish_reason == "error":
        ok = False
        print("FAIL: the consumer failed the load")
    elif got.text != reference:
        ok = False
        print(f"FAIL: the consumer's output differs from the single-engine reference {reference!r}")
    else:
        print("consumer output equals the single-engine reference")
    print(json.dumps({"ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
