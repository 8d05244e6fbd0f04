"""Does vLLM's CPU linear layer give a token the same result alone and in a batch?

    .venv/bin/python -m kvcs_soak.kernel_rows        (scripts/ on PYTHONPATH)

The mechanism behind `kv_same_output_differs: numerics` (kvcs_soak.outputs),
shown without a server: each weight shape of the tiny Llama goes through
vLLM's own CPU dispatch (dispatch_cpu_unquantized_gemm, as its linear layers
do at load time), then every row of a batch of 64 random bf16 activations is
computed once in the batch and once alone (one row), and the rows whose
results differ are counted. On a CPU with AMX, weights up to 1 MiB take
sgl-kernel's weight_packed_linear, which runs AMX brgemm for more than 4 rows
and an AVX-512 kernel for up to 4 (csrc/cpu/sgl-kernels/gemm.h,
can_use_brgemm): the two round differently. Elsewhere they take oneDNN.
"""

from __future__ import annotations

import json
import sys

# The tiny Llama's linear layers (build/tiny-llama: hidden 128, 4 heads of 32,
# 2 KV heads, MLP 256, vocabulary 512), as (name, out features N, in features K).
TINY_LLAMA_SHAPES = (("qkv_proj", 256, 128), ("o_proj", 128, 128), ("gate_up_proj", 512, 128),
                     ("down_proj", 128, 256), ("lm_head", 512, 128))


def rows_alone_vs_batched(n: int, k: int, rows: int = 64, seed: int = 0) -> dict:
    """Rows (of `rows`) whose output differs computed alone and in the batch, through vLLM's CPU dispatch."""
    import torch

    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    gen = torch.Generator().manual_seed(seed)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter((torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16),
                                      requires_grad=False)
    dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
    x = torch.randn(rows + 4, k, generator=gen).to(torch.bfloat16)

    def run(first: int, m: int):
        return layer.cpu_linear(x[first:first + m].contiguous(), layer.weight, None)

    batched = run(0, rows)
    alone = [run(i, 1)[0] for i in range(rows)]
    out = {"n": n, "k": k, "rows": rows,
           f"rows_differing_alone_vs_in_{rows}": sum(bool((alone[i] != batched[i]).any()) for i in range(rows))}
    # The 4-row switch: each row first of a batch of 4, and of 5, against itself alone.
    for m in (4, 5):
        out[f"rows_differing_alone_vs_in_{m}"] = sum(bool((alone[i] != run(i, m)[0]).any()) for i in range(rows))
    return out


def main() -> int:
    import torch

    from vllm.platforms import current_platform

    current_platform.import_kernels()
    if torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()  # what the CPU worker does at start (patch 0018)
    out = {"amx": torch.cpu._is_amx_tile_supported(), "avx512_bf16": torch.cpu._is_avx512_bf16_supported(),
           "layers": {name: rows_alone_vs_batched(n, k) for name, n, k in TINY_LLAMA_SHAPES}}
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
