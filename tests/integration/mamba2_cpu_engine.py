"""One real vLLM engine (CPU) on the tiny random Granite-4.0-H, prefix caching on or off.

Run by test_cpu_mamba2_prefix_caching.py as a subprocess:

    python mamba2_cpu_engine.py MODEL cache|nocache

Once the engine is up it builds the batches of `batches()` for the block
size this CPU gave it, runs each greedily (one generate call per batch, so
its prompts are scheduled together), and prints one line, ANSWER and JSON:
{"block_size": N, name: [[output token ids, num_cached_tokens] per prompt]}.
"""

from __future__ import annotations

import hashlib
import json
import sys


def prompt(key: str, n: int) -> list[int]:
    ids, counter = [], 0
    while len(ids) < n:
        digest = hashlib.sha256(f"{key}/{counter}".encode()).digest()
        ids += [int.from_bytes(digest[i:i + 2], "little") % 500 + 4 for i in range(0, len(digest), 2)]
        counter += 1
    return ids[:n]


def batches(block: int) -> dict:
    """Prompts in units of the engine's block size (which the CPU decides)."""
    first = prompt("a", block + block // 4 + 1)
    long = prompt("d", 2 * block + block // 2)
    return {
        "crossing": {"prompts": [first], "max_tokens": 8},
        "shared_prefix": {"prompts": [first[:block + 8] + prompt("b", block // 3)], "max_tokens": 8},
        "batched": {"prompts": [prompt("c", block + 9), long, prompt("e", block - 9)], "max_tokens": 8},
        "decode_crosses": {"prompts": [prompt("f", block - 9)], "max_tokens": 24},
        "long_shared": {"prompts": [long[:2 * block + 5] + prompt("g", 20)], "max_tokens": 8},
    }


def logprobs_of(completion) -> list[float]:
    """The log probability of each generated token: a wrong state that leaves
    the greedy tokens as they are (a tiny random model) still moves these."""
    return [lp[tok].logprob for tok, lp in zip(completion.token_ids, completion.logprobs)]


def main() -> None:
    from vllm import LLM, SamplingParams

    model, mode = sys.argv[1], sys.argv[2]
    # block_size 32 and 256 MiB of KV as in the demo's servers; the Mamba page
    # then sets the attention block. A float32 SSM state on every CPU (vLLM
    # picks float32 only where AVX-512-bf16 is, bf16 elsewhere): a state
    # restored from the cache then equals the one a single scan carries, so
    # the outputs compare token for token on any machine.
    llm = LLM(model=model, dtype="bfloat16", enforce_eager=True, block_size=32, max_model_len=1024,
              kv_cache_memory_bytes=256 * 2**20, seed=0, enable_prefix_caching=mode == "cache",
              mamba_ssm_cache_dtype="float32")
    block = llm.llm_engine.vllm_config.cache_config.block_size
    answer: dict = {"block_size": block}
    for name, batch in batches(block).items():
        max_tokens = batch["max_tokens"]
        outs = llm.generate([{"prompt_token_ids": p} for p in batch["prompts"]],
                            SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=0), use_tqdm=False)
        answer[name] = [[list(o.outputs[0].token_ids), o.num_cached_tokens, logprobs_of(o.outputs[0])]
                        for o in outs]
    print("ANSWER " + json.dumps(answer), flush=True)
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
