"""Patch 0017's two CPU pieces on their own, against the single scan and the
Triton kernel's contract: the scan's per-chunk states and the checkpoint store.

The real-engine test (test_cpu_mamba2_prefix_caching.py) shows the outputs;
these pin what it cannot see on a tiny model: bit-equality with one scan,
the state dtype, the gate z, rows without a checkpoint before rows with one,
and a conv state wider than its history (speculative slots).
"""

from __future__ import annotations

import pytest
import torch
from vllm.platforms import current_platform

# vLLM's CPU Mamba2 ops are compiled (vllm._C): the v0.32.0 base only (tests/conftest.py).
pytestmark = [pytest.mark.skipif(not current_platform.is_cpu(), reason="the CPU path of vLLM's Mamba2 ops"),
              pytest.mark.cpu_runtime]

HEADS, HEAD_DIM, GROUPS, DSTATE, CHUNK = 4, 8, 1, 16, 32
F32_SLACK = 1e-5  # states are O(1-10); float32 regrouping moves them by ~1e-7
BF16_ULP = 2 ** -5  # outputs are bf16 of O(1): one rounding step at most


def close(a: torch.Tensor, b: torch.Tensor, atol: float) -> bool:
    return a.shape == b.shape and bool(((a.float() - b.float()).abs() <= atol).all())


def scan(**kw):
    from vllm.model_executor.layers.mamba.ops.cpu.mamba_ssm import _mamba_chunk_scan_combined_fwd_cpu

    current_platform.import_kernels()
    return _mamba_chunk_scan_combined_fwd_cpu(**kw)


def chunking(lengths: list[int]):
    """cu_seqlens, and the chunks of each sequence as vLLM cuts them (chunk ends
    at multiples of CHUNK within the sequence): cu_chunk_seqlens, seq_idx,
    last_chunk_indices."""
    cu, bounds, owners, last = [0], [0], [], []
    for i, n in enumerate(lengths):
        start = cu[-1]
        cu.append(start + n)
        for end in list(range(CHUNK, n, CHUNK)) + [n]:
            bounds.append(start + end)
            owners.append(i)
        last.append(len(owners) - 1)
    t = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    return t(cu), t(bounds), t(owners), t(last)


def inputs(lengths: list[int], *, gate: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(x=r(total, HEADS, HEAD_DIM).bfloat16(), dt=r(total, HEADS).bfloat16(), A=-r(HEADS).abs().float(),
                B=r(total, GROUPS, DSTATE).bfloat16(), C=r(total, GROUPS, DSTATE).bfloat16(),
                D=r(HEADS).float(), z=r(total, HEADS, HEAD_DIM).bfloat16() if gate else None,
                initial_states=r(len(lengths), HEADS, HEAD_DIM, DSTATE).float(), dt_bias=r(HEADS).float())


def run(lengths, *, gate, intermediate, state_dtype=torch.float32, seed=0):
    cu, bounds, owners, last = chunking(lengths)
    kw = inputs(lengths, gate=gate, seed=seed)
    out = torch.zeros(sum(lengths), HEADS, HEAD_DIM, dtype=torch.bfloat16)
    states = scan(chunk_size=CHUNK, out=out, cu_seqlens=cu, cu_chunk_seqlens=bounds, seq_idx=owners,
                  last_chunk_indices=last, dt_softplus=True, return_intermediate_states=intermediate,
                  state_dtype=state_dtype, **kw)
    return out, states, last


@pytest.mark.parametrize("gate", [False, True], ids=["no-gate", "gate-z"])
def test_per_chunk_states_scan_equals_one_scan(gate):
    lengths = [70, 150, 33, 64]  # chunks: 3, 5, 2, 2 (a chunk may be short; one ends on the sequence)
    out_one, final_one, _ = run(lengths, gate=gate, intermediate=False)
    out_waves, chunk_states, last = run(lengths, gate=gate, intermediate=True)
    assert chunk_states.dtype == torch.float32 and chunk_states.shape == (12, HEADS, HEAD_DIM, DSTATE)
    # Equal to float32 rounding: the op's sums may group differently when a
    # sequence is cut (seen here: bit-equal for these lengths, 3e-8 for others).
    assert close(out_waves, out_one, BF16_ULP)  # every token's output (bf16)
    assert close(chunk_states[last.long()], final_one, F32_SLACK)  # each sequence's final state


def test_each_chunk_state_is_the_state_of_the_prefix_it_ends():
    # Sequence 1 of [70, 150]: its chunk ends 32, 64, 96, 128, 150. The state at
    # each is the final state of a scan of that prefix alone (same inputs).
    lengths = [70, 150]
    _, chunk_states, _ = run(lengths, gate=False, intermediate=True)
    full = inputs(lengths, gate=False)
    for k, end in enumerate([32, 64, 96, 128, 150]):
        rows = torch.arange(70, 70 + end)
        kw = {name: (v.index_select(0, rows) if name in ("x", "dt", "B", "C") else v) for name, v in full.items()}
        kw["initial_states"] = full["initial_states"][1:2]
        cu, bounds, owners, last = chunking([end])
        out = torch.zeros(end, HEADS, HEAD_DIM, dtype=torch.bfloat16)
        final = scan(chunk_size=CHUNK, out=out, cu_seqlens=cu, cu_chunk_seqlens=bounds, seq_idx=owners,
                     last_chunk_indices=last, dt_softplus=True, state_dtype=torch.float32, **kw)
        assert close(chunk_states[3 + k], final[0], F32_SLACK), f"chunk ending at {end}"


def test_per_chunk_states_come_in_the_state_dtype_asked_for():
    _, states, _ = run([70], gate=False, intermediate=True, state_dtype=torch.bfloat16)
    assert states.dtype == torch.bfloat16
    _, states, _ = run([70], gate=False, intermediate=True, state_dtype=torch.float32)
    assert states.dtype == torch.float32


def test_checkpoint_store_writes_rows_with_a_checkpoint_only_and_the_first_state_len_slots():
    from vllm.model_executor.layers.mamba.checkpoint import MambaPrefillCheckpointMetadata
    from vllm.model_executor.layers.mamba.ops.ssd_checkpoint import store_prefill_checkpoint

    dim, state_len, spec = 6, 3, 2  # a conv state wider than its history: speculative slots
    query_start = torch.tensor([0, 40, 100, 170], dtype=torch.int32)
    tokens = 200
    x = torch.arange(dim * tokens, dtype=torch.float32).view(dim, tokens)
    chunk_states = torch.randn(9, HEADS, HEAD_DIM, DSTATE)
    conv = torch.full((10, dim, state_len + spec), -1.0)
    ssm = torch.full((10, HEADS, HEAD_DIM, DSTATE), -1.0)
    # Row 0 has no checkpoint (offset 0) and comes first; rows 1 and 3 have one.
    offsets, blocks, chunks = [0, 32, 0, 16], [0, 5, 0, 7], [-1, 3, -1, 8]
    meta = MambaPrefillCheckpointMetadata(torch.tensor(offsets, dtype=torch.int32),
                                          torch.tensor(blocks, dtype=torch.int64))
    store_prefill_checkpoint(meta, torch.tensor(chunks), x, conv, chunk_states, ssm, query_start,
                             state_len=state_len)
    for row, block in ((1, 5), (3, 7)):
        end = int(query_start[row]) + offsets[row]
        assert torch.equal(conv[block, :, :state_len], x[:, end - state_len:end]), row
        assert torch.equal(ssm[block], chunk_states[chunks[row]]), row
    assert (conv[:, :, state_len:] == -1).all()  # the speculative slots are left as they were
    untouched = [b for b in range(10) if b not in (5, 7)]
    assert (conv[untouched] == -1).all() and (ssm[untouched] == -1).all()
