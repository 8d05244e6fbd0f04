"""One real vLLM engine (CPU) with MooncakeStoreConnector and KV checksums, driven over stdin.

Run by test_mooncake_store.py as a subprocess:

    python store_engine.py ROLE  (kv_both: computes and stores; kv_consumer: loads from the store)

MOONCAKE_CONFIG_PATH names the store's config (master, metadata server,
protocol tcp). Fail-closed with policy recompute, or fail-open with
KVCS_FAIL_OPEN=1. Each stdin line is a JSON list of prompts (token id lists);
the engine generates them greedily and answers one JSON line on stdout:
{"outputs": [token ids per prompt], "cached": [num_cached_tokens per prompt]}.
The line {"reset_prefix_cache": true} empties its own prefix cache instead
(the store keeps its values), answered {"reset": true}.
It exits cleanly at EOF (the test keeps a storing engine alive while another
reads: the values live in the storing client's segment).
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    role = sys.argv[1]
    model = os.environ["KVCS_STORE_MODEL"]
    # lookup_rpc_port: the scheduler reaches worker rank 0 over an IPC socket
    # whose path only this number tells apart between instances on one host.
    fail_closed = os.environ.get("KVCS_FAIL_OPEN") != "1"
    kv = KVTransferConfig(kv_connector="MooncakeStoreConnector", kv_role=role, enable_kv_checksum=True,
                          kv_checksum_fail_closed=fail_closed, kv_load_failure_policy="recompute",
                          kv_connector_extra_config={"lookup_rpc_port": int(os.environ["KVCS_LOOKUP_RPC_PORT"])})
    llm = LLM(model=model, dtype="bfloat16", enforce_eager=True, block_size=32, max_model_len=512,
              kv_cache_memory_bytes=64 * 2**20, seed=0, enable_prefix_caching=True, kv_transfer_config=kv)
    params = SamplingParams(max_tokens=6, temperature=0)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        prompts = json.loads(line)
        if isinstance(prompts, dict) and prompts.get("reset_prefix_cache"):
            # Store jobs still in flight hold blocks; the reset waits for them.
            ok = False
            for _ in range(100):
                if ok := llm.reset_prefix_cache():
                    break
                time.sleep(0.1)
            print(json.dumps({"reset": ok}), flush=True)
            continue
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        print(json.dumps({"outputs": [list(o.outputs[0].token_ids) for o in outs],
                          "cached": [o.num_cached_tokens for o in outs]}), flush=True)
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
