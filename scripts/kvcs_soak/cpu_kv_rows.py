"""Where vLLM's CPU attention keeps a partial block's tokens, against the rows a token-row reading takes.

    .venv/bin/python -m kvcs_soak.cpu_kv_rows        (scripts/ on PYTHONPATH)

vLLM's CPU KV cache tensor is [blocks, KV heads, block_size, 2 * head_size],
but that shape is not a token per row: the attention views each head's slab
as [2 * block_size, head_size] (keys, then values) and its writer
(cpu_attn_reshape_and_cache) packs them for its ISA. Code that reads dim 2 as
the token slots (the checksum's LayerView with layout "HND", the drill's
faults and witness digests) takes rows 0..n-1 as the n valid tokens of a
partial block; they are not.

For a block of the tiny Llama's shape (2 KV heads of 32, block size 32),
this writes n valid tokens with vLLM's own writer for each ISA and reports
the rows of the [32, 64] shape they occupy, the rows < n that a token-row
reading covers, and the valid rows it misses; that changing a missed row
changes the attention's output and leaves the block's checksum
(vllm_kvchecksum.core.api) as it was. Then it checks the attention's
masking: junk written by the same writer into the slots past n must not
change the output of a query at position n - 1, while junk in rows n.. of
the shape (what the drill's change_tail writes) does.
"""

from __future__ import annotations

import json
import sys

KV_HEADS, HEAD, BLOCK, HEADS = 2, 32, 32, 4


def block_rows(isa: str, n: int, seed: int = 0) -> dict:
    import torch

    import vllm._custom_ops as ops

    gen = torch.Generator().manual_seed(seed)
    blocks = 1

    def views(kv):
        return kv.view(blocks, KV_HEADS, BLOCK * 2, HEAD).chunk(2, dim=2)

    def write(kv, k, v, slots):
        kc, vc = views(kv)
        ops.cpu_attn_reshape_and_cache(k, v, kc, vc, torch.tensor(slots, dtype=torch.int64), isa,
                                       k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")

    def attend(kv, q):
        kc, vc = views(kv)
        qsl, sl = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([n], dtype=torch.int32)
        meta = ops.cpu_attn_get_scheduler_metadata(1, HEADS, KV_HEADS, HEAD, sl, torch.bfloat16, qsl, True, -1, isa,
                                                   False)
        out = torch.empty(1, HEADS, HEAD, dtype=torch.bfloat16)
        ops.cpu_attention_with_kv_cache(query=q, key_cache=kc, value_cache=vc, output=out, query_start_loc=qsl,
                                        seq_lens=sl, scale=HEAD ** -0.5, causal=True, alibi_slopes=None,
                                        sliding_window=-1, block_table=torch.zeros(1, 1, dtype=torch.int32),
                                        softcap=0.0, scheduler_metadata=meta, s_aux=None)
        return out

    shape = (blocks, KV_HEADS, BLOCK, 2 * HEAD)
    k = torch.randn(BLOCK, KV_HEADS, HEAD, generator=gen).to(torch.bfloat16)
    v = torch.randn(BLOCK, KV_HEADS, HEAD, generator=gen).to(torch.bfloat16)
    q = torch.randn(1, HEADS, HEAD, generator=gen).to(torch.bfloat16)
    marked = torch.zeros(shape, dtype=torch.bfloat16)
    write(marked, torch.ones_like(k[:n]), torch.ones_like(v[:n]), list(range(n)))
    valid = sorted({int(r) for r in (marked[0] != 0).any(dim=-1).nonzero()[:, 1].tolist()})
    base = torch.zeros(shape, dtype=torch.bfloat16)
    write(base, k[:n], v[:n], list(range(n)))
    ref = attend(base.clone(), q)
    past = base.clone()
    write(past, k[n:] * 3, v[n:] * 3, list(range(n, BLOCK)))
    rows = base.clone()
    rows[0, :, n:, :] = rows[0, :, :BLOCK - n, :] * 3 + 1
    # The checksum (docs/definition.md) of the block as the checksum worker
    # reads this tensor (layout "HND"), before and after one valid row it
    # misses is changed: a corruption of the request's KV it cannot see.
    from vllm_kvchecksum.core.api import layer_block_checksums

    missed = [r for r in valid if r >= n]
    flipped = base.clone()
    if missed:
        flipped[0, :, missed[0], :] += 1
    same_sum = bool((layer_block_checksums(base, [0], n) == layer_block_checksums(flipped, [0], n)).all())
    return {"isa": isa, "valid_tokens": n, "rows_holding_them": valid, "rows_a_token_row_reading_covers": n,
            "valid_rows_missed": missed,
            "output_changed_by_changing_a_missed_row": bool(missed) and bool((attend(flipped, q) != ref).any()),
            "checksum_unchanged_by_it": bool(missed) and same_sum,
            "output_changed_by_junk_in_the_slots_past_n": bool((attend(past, q) != ref).any()),
            "output_changed_by_junk_in_rows_n_and_up": bool((attend(rows, q) != ref).any())}


def main() -> int:
    import torch

    from vllm.platforms import current_platform

    current_platform.import_kernels()
    isas = ["vec"]
    if torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()  # what the CPU worker does at start (patch 0018)
        isas.insert(0, "amx")  # vLLM's choice for bf16 with AMX (cpu_attn._get_attn_isa)
    json.dump([block_rows(isa, n) for isa in isas for n in (5, 12, 22)], sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
