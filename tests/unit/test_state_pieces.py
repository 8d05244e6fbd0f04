"""Mamba (SSM) state rows in 16- and 32-bit pieces, on both CPU paths.

A state segment is checksummed per row (a channel or head of the state):
its pieces are the row's elements read as unsigned 2- or 4-byte integers,
zero-extended to 64 bits, and row r of a segment whose first global row is
first_head has the factor of head first_head + r. The worker builds each
segment as a [blocks, rows, 1, elements] view of an int8 page tensor
(kernel_checks.state_view), possibly with a strided element dimension, at an
offset that need not be 8-byte aligned. The interpreted Triton kernel runs
the same states in test_triton_kernel.py (kernel_checks.check_state_pieces
and check_large_state_spans_chunks).
"""

import numpy as np
import pytest
import torch

import reference
from kernel_checks import (state_accumulate, state_page, state_reference,
                           state_rows, state_segments, state_view)
from vllm_kvchecksum.core.definition import MAX_KV_HEADS_PER_LAYER
from vllm_kvchecksum.core.kernels import torch_path
from vllm_kvchecksum.core.layer_view import LayerView

pytestmark = pytest.mark.timeout(60)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
          "int16": torch.int16, "int32": torch.int32}


def got(out, column=0):
    return (out[:, column] - 5).numpy().view(np.uint64).tolist()


def signed_reference(page, segments, block_ids, layer):
    """What reading the elements as signed (sign-extended) would give."""
    values = []
    for b in block_ids:
        total = 0
        for seg in segments:
            for row, elements in state_rows(page, b, *seg):
                signed = elements.view(f"<i{elements.dtype.itemsize}").tolist()
                total += reference.factor(layer, row) * sum(
                    int(v) * (2 * j + 1) for j, v in enumerate(signed))
        values.append(total % 2**64)
    return values


@pytest.mark.parametrize("name", DTYPES)
def test_states_in_a_page_match_reference(name, cpu_path):
    """Contiguous ((dim, len) conv, (heads, hd*ds) temporal) and strided
    ((len, dim) conv, as a permute and as as_strided) states at unaligned
    offsets of a padded page, block ids out of order, an empty row."""
    dtype = DTYPES[name]
    page = state_page(5, 1000, seed=21)
    segs = state_segments(dtype)
    ids, valid = [3, 0, 4, 1, 2], [1, 1, 1, 1, 0]
    for layer, column in ((3, 0), (2**20 + 1, 1)):
        out = state_accumulate(page, segs, ids, valid, layer=layer, path=cpu_path,
                               cols=2, column=column)
        assert (out[:, 1 - column] == 5).all()
        want = state_reference(page, segs, ids[:4], layer)
        assert got(out, column) == want + [0], layer
        # The page's elements have their sign bit set often enough that a
        # signed reading would differ in every block.
        signed = signed_reference(page, segs, ids[:4], layer)
        assert all(s != w for s, w in zip(signed, want))


@pytest.mark.parametrize("name", ["bf16", "fp32"])
def test_first_row_offsets_and_segment_sums(name, cpu_path):
    """A segment's rows take global rows first_head.. : splitting a state into
    two segments with the right first rows gives the whole state's value, and
    wrong first rows do not."""
    dtype = DTYPES[name]
    esize = torch.empty(0, dtype=dtype).element_size()
    page = state_page(3, 12 * 5 * esize + 2 * esize, seed=22)
    offset = esize if esize == 2 else 4
    ids, valid = [2, 0, 1], [1, 1, 1]
    base = MAX_KV_HEADS_PER_LAYER - 12
    whole = state_accumulate(page, [(offset, dtype, "rows", 12, 5, base)], ids, valid,
                             layer=9, path=cpu_path)
    assert got(whole) == state_reference(
        page, [(offset, dtype, "rows", 12, 5, base)], ids, 9)
    halves = [(offset, dtype, "rows", 7, 5, base),
              (offset + 7 * 5 * esize, dtype, "rows", 5, 5, base + 7)]
    assert torch.equal(state_accumulate(page, halves, ids, valid, layer=9, path=cpu_path),
                       whole)
    shifted = [halves[0], (*halves[1][:5], base + 6)]
    assert not torch.equal(
        state_accumulate(page, shifted, ids, valid, layer=9, path=cpu_path), whole)


@pytest.mark.parametrize("name", ["bf16", "int32"])
@pytest.mark.parametrize("ids", [[1, 2, 3, 4], [4, 1, 3, 0]])
def test_chunked_and_in_place_gathers(monkeypatch, name, ids, cpu_path):
    """Chunks of one block (each summed in place, a strided view of the page)
    and of all blocks (consecutive ids in place, others gathered) agree."""
    dtype = DTYPES[name]
    page = state_page(5, 1000, seed=23)
    segs = state_segments(dtype)
    valid = [1] * len(ids)
    want = state_reference(page, segs, ids, 5)
    assert got(state_accumulate(page, segs, ids, valid, layer=5, path=cpu_path)) == want
    monkeypatch.setattr(torch_path, "CPU_CHUNK_BYTES", 8)
    assert got(state_accumulate(page, segs, ids, valid, layer=5, path=cpu_path)) == want


def test_view_is_not_a_copy():
    page = state_page(4, 1000, seed=24)
    view = state_view(page, 6, torch.float16, "elements", 10, 3)  # (len 3, dim 10)
    assert view.shape == (4, 10, 1, 3) and view.stride()[1::2] == (1, 10)
    lv = LayerView(view, block_size=1, layer=2, first_head=40, piece_bits=16)
    cache = lv.caches[0]
    assert cache.pieces.dtype == torch.int16 and cache.pieces.data_ptr() == view.data_ptr()
    assert cache.piece_stride == 10 and cache.num_pieces == 3
    assert (lv.num_blocks, lv.num_heads, lv.pieces_per_token) == (4, 10, 3)
    assert lv.block_bytes == 10 * 3 * 2
    lv32 = LayerView(state_view(page, 4, torch.float32, "rows", 4, 9), block_size=1,
                     layer=0, piece_bits=32)
    assert lv32.caches[0].pieces.dtype == torch.int32 and lv32.caches[0].piece_stride == 1
    assert lv32.block_bytes == 4 * 9 * 4


@pytest.mark.parametrize("dtype,bits", [
    (torch.bfloat16, 32), (torch.float32, 16), (torch.int8, 16), (torch.float64, 32),
    (torch.int64, 16)])
def test_wrong_element_size_is_refused(dtype, bits):
    cache = torch.zeros(2, 3, 1, 4, dtype=dtype)
    esize = cache.element_size()
    match = (rf"cache is {dtype} \({esize}-byte elements\), but piece_bits={bits} "
             rf"reads each element as one {bits // 8}-byte piece")
    with pytest.raises(ValueError, match=match):
        LayerView(cache, block_size=1, layer=0, piece_bits=bits)


def test_unsupported_width_is_refused():
    with pytest.raises(ValueError, match="piece_bits=8 is not implemented"):
        LayerView(torch.zeros(2, 3, 1, 4, dtype=torch.int8), block_size=1, layer=0,
                  piece_bits=8)


def test_worked_example(cpu_path):
    """Two rows of two int16 elements, by hand: -1 and -32768 count as 65535
    and 32768, element j has weight 2j+1, rows 2 and 3 of layer 1."""
    state = torch.tensor([[-1, 1], [2, -32768]], dtype=torch.int16).view(1, 2, 1, 2)
    out = torch.zeros(1, 1, dtype=torch.int64)
    one = torch.ones(1, dtype=torch.int64)
    LayerView(state, block_size=1, layer=1, first_head=2, piece_bits=16).accumulate(
        out, 0, one - 1, one - 1, one)
    m2, m3 = 2 * (2**16 + 2) + 1, 2 * (2**16 + 3) + 1
    want = (m2 * (65535 * 1 + 1 * 3) + m3 * (2 * 1 + 32768 * 3)) % 2**64
    assert out.numpy().view(np.uint64)[0, 0] == want
    assert reference.state_checksum(1, [(2, state[0, 0, 0].numpy()),
                                        (3, state[0, 1, 0].numpy())]) == want
