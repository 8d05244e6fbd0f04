"""Checks of the Triton kernel against the PyTorch path and the reference.

Shared by test_triton_kernel.py (run interpreted, TRITON_INTERPRET=1, on
CPU tensors, in a subprocess: see run_interpreted_kernel_checks.py) and
test_triton_kernel_cuda.py (compiled, on CUDA). Shapes stay small so the
interpreter finishes in seconds. Each check raises AssertionError on a
mismatch. The Mamba state helpers (state_page, state_view, state_rows,
state_accumulate, ...) also serve test_state_pieces.py.
"""

from __future__ import annotations

import numpy as np
import torch

import reference
from kvcaches import random_cache, to_layout
from vllm_kvchecksum.core.layer_view import LayerView
from vllm_kvchecksum.core.rows import RequestBlocks, build_rows


def _both_paths(caches, device, rows, *, block_size, layer, first_head, layout,
                cols=1, column=0):
    """out from the kernel (on the caches as given: strided views stay
    strided) and from the PyTorch path (on CPU copies)."""
    ids, t0, valid = (torch.tensor(r, dtype=torch.int64) for r in rows)
    results = []
    for path, dev in (("triton", device), ("torch", "cpu")):
        on_dev = [c if c.device == torch.device(dev) else c.to(dev) for c in caches]
        view = LayerView(on_dev, block_size=block_size,
                         layer=layer, first_head=first_head, layout=layout, path=path)
        assert view.path == path
        out = torch.full((len(ids), cols), 5, dtype=torch.int64, device=dev)
        view.accumulate(out, column, ids.to(dev), t0.to(dev), valid.to(dev))
        results.append(out.cpu())
    return results


def _rows(ids, first_position, num_tokens, block_size):
    t0 = [(first_position + i) * block_size for i in range(len(ids))]
    return ids, t0, [max(0, min(block_size, num_tokens - f)) for f in t0]


def check_layouts_and_splits(device):
    """HND/NHD, kernel-block splits, strided views, partial and empty blocks,
    and a layer with a large slice factor."""
    k, v = random_cache(5, 3, 8, 32, seed=1), random_cache(5, 3, 8, 32, seed=2)
    ids, first, n = [3, 0, 4, 1, 2], 1, 8 * 4 + 5  # positions 1..5: partial, empty
    for layout, kt, padded in (("HND", 8, False), ("NHD", 8, False), ("HND", 2, True),
                               ("NHD", 4, False)):
        caches = [to_layout(c.to(device), layout, kt, padded) for c in (k, v)]
        for layer, first_head in ((0, 0), (2**20, 2**16 - 3)):
            kernel, torch_out = _both_paths(caches, device, _rows(ids, first, n, 8),
                                            block_size=8, layer=layer,
                                            first_head=first_head, layout=layout)
            assert torch.equal(kernel, torch_out), (layout, kt, layer)
            assert caches[0].is_contiguous() != padded  # strided views reach the kernel
            want = reference.layer_checksums(caches, ids, n, first_block_position=first,
                                             layer=layer, first_head=first_head,
                                             layout=layout, block_size=8)
            got = (kernel[:, 0] - 5).numpy().view(np.uint64).tolist()
            assert got == want, (layout, kt, layer)
            assert got[-1] == 0


def check_multi_tile_rows(device):
    """One-head blocks of 32 tokens x 36 pieces: several tiles, not a power of
    two, so tiling and tail masking are exercised; plus a combined cache."""
    cache = random_cache(3, 1, 32, 36 * 8, seed=3)
    for n in (96, 70, 33):
        rows = _rows([2, 0, 1], 0, n, 32)
        kernel, torch_out = _both_paths([cache], device, rows, block_size=32,
                                        layer=7, first_head=1, layout="HND")
        assert torch.equal(kernel, torch_out), n
        want = reference.layer_checksums([cache], [2, 0, 1], n, layer=7,
                                         first_head=1, block_size=32)
        assert (kernel[:, 0] - 5).numpy().view(np.uint64).tolist() == want


def check_large_rows_span_chunks(device):
    """A row of more than one 16K-piece chunk is summed by several programs."""
    cache = random_cache(2, 2, 4, 2304 * 8, seed=4)  # 18432 pieces per row
    kernel, torch_out = _both_paths([cache], device, _rows([1, 0], 0, 7, 4),
                                    block_size=4, layer=1, first_head=0, layout="HND")
    assert torch.equal(kernel, torch_out)


def check_one_column_of_a_wider_matrix(device):
    """A layer's sums land in its column; the others stay untouched."""
    k, v = random_cache(4, 2, 4, 16, seed=5), random_cache(4, 2, 4, 16, seed=6)
    kernel, torch_out = _both_paths([k, v], device, _rows([3, 1, 2], 0, 10, 4),
                                    block_size=4, layer=3, first_head=0,
                                    layout="HND", cols=3, column=1)
    assert torch.equal(kernel, torch_out)
    assert (kernel[:, [0, 2]] == 5).all()
    assert (kernel[:, 1] != 5).all()


def check_rows_of_two_groups(device):
    """Rows built for two requests in two groups (odd first group, loads
    starting past the first block, partial last blocks), one device copy."""
    sizes = [4, 8]
    groups = [[RequestBlocks([7, 3, 9], 0, 10), RequestBlocks([4, 1], 2, 15)],
              [RequestBlocks([2, 5], 1, 21), RequestBlocks([0], 3, 30)]]
    caches = [[random_cache(10, 2, bs, 16, seed=10 * g + i).to(device) for i in range(2)]
              for g, bs in enumerate(sizes)]
    rows = build_rows(groups, sizes, pin_memory=torch.device(device).type == "cuda")
    table = rows.to_device(device)
    out = torch.zeros(table.shape[1], 2, dtype=torch.int64, device=device)
    for g, bs in enumerate(sizes):
        start, count = rows.groups[g]
        view = LayerView(caches[g], block_size=bs, layer=2, first_head=4, path="triton")
        view.warm_up()
        view.accumulate(out[start:start + count], g, *rows.group_rows(table, g))
    out = out.cpu()
    for g, bs in enumerate(sizes):
        for (ids, first, n), (start, count) in zip(groups[g], rows.requests[g]):
            want = reference.layer_checksums([c.cpu() for c in caches[g]], ids, n,
                                             first_block_position=first, layer=2,
                                             first_head=4, block_size=bs)
            assert out[start:start + count, g].numpy().view(np.uint64).tolist() == want


# Mamba (SSM) states: 16/32-bit pieces, one per element, zero-extended.
# A page is an int8 [blocks, page_bytes] tensor holding several states at
# byte offsets that are element-aligned but not 8-byte aligned, with padding
# between them, as a hybrid model's page does. The caller (the worker)
# slices a state out of the page, views it as its dtype and then as
# [blocks, rows, 1, elements], HND with block_size=1.

NP_UNSIGNED = {2: "<u2", 4: "<u4"}


def state_page(num_blocks, page_bytes, seed):
    """Random page bytes (about half the elements have their sign bit set)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-128, 128, (num_blocks, page_bytes), dtype=torch.int8,
                         generator=gen)


def state_view(page, offset, dtype, layout, rows, elements):
    """A state of rows x elements at byte `offset` of each block's page, as
    [blocks, rows, 1, elements]. layout "rows": stored (rows, elements),
    like a dim-first conv state (dim, len) or a temporal state
    (heads, hd*ds); "elements": stored (elements, rows), like a (len, dim)
    conv state, so rows have stride 1 and elements stride `rows`;
    "as_strided": the same storage as "elements", built with as_strided."""
    esize = torch.empty(0, dtype=dtype).element_size()
    flat = page[:, offset:offset + rows * elements * esize].view(dtype)
    blocks = page.shape[0]
    if layout == "rows":
        return flat.view(blocks, rows, elements).unsqueeze(2)
    if layout == "elements":
        return flat.view(blocks, elements, rows).permute(0, 2, 1).unsqueeze(2)
    assert layout == "as_strided"
    return flat.as_strided((blocks, rows, 1, elements),
                           (flat.stride(0), 1, rows * elements, rows),
                           flat.storage_offset())


def state_rows(page, block, offset, dtype, layout, rows, elements, first_row):
    """The reference's input for one block of a state: (global row, elements
    as unsigned NumPy ints), decoded from the page's raw bytes by NumPy."""
    esize = torch.empty(0, dtype=dtype).element_size()
    raw = page[block].cpu().numpy().view(np.uint8)[offset:offset + rows * elements * esize]
    a = raw.view(NP_UNSIGNED[esize])
    if layout == "rows":
        table = a.reshape(rows, elements)
    else:
        table = a.reshape(elements, rows).T
    return [(first_row + r, table[r].copy()) for r in range(rows)]


def state_reference(page, segments, block_ids, layer):
    """reference.state_checksum of each listed block, summed over segments
    ((offset, dtype, layout, rows, elements, first_row) tuples)."""
    return [reference.state_checksum(
        layer, [row for seg in segments for row in state_rows(page, b, *seg)])
        for b in block_ids]


def state_accumulate(page, segments, block_ids, valid, *, layer, path, cols=1,
                     column=0):
    """out after accumulating every segment of the page, as a LayerView per
    segment (block_size=1, piece_bits from the dtype), into `column`."""
    device = page.device
    ids = torch.tensor(block_ids, dtype=torch.int64, device=device)
    valid = torch.tensor(valid, dtype=torch.int64, device=device)
    first = torch.zeros_like(ids)
    out = torch.full((len(block_ids), cols), 5, dtype=torch.int64, device=device)
    for offset, dtype, layout, rows, elements, first_row in segments:
        view = state_view(page, offset, dtype, layout, rows, elements)
        bits = 8 * view.element_size()
        lv = LayerView(view, block_size=1, layer=layer, first_head=first_row,
                       layout="HND", path=path, piece_bits=bits)
        assert lv.path == path
        assert lv.caches[0].pieces.data_ptr() == view.data_ptr()  # no copy
        lv.accumulate(out, column, ids, first, valid)
    return out.cpu()


def state_segments(dtype):
    """Three states of one layer in a 5-block page of 1000 bytes: a dim-first
    conv state, a (len, dim) conv state (strided elements), a temporal state;
    element-aligned, not 8-byte aligned offsets, padding between them."""
    esize = torch.empty(0, dtype=dtype).element_size()
    first = 2 if esize == 2 else 4
    segs, offset, row = [], first, 3
    for layout, rows, elements in (("rows", 6, 3), ("elements", 10, 3),
                                   ("rows", 3, 20), ("as_strided", 7, 4)):
        segs.append((offset, dtype, layout, rows, elements, row))
        end = offset + rows * elements * esize
        offset = -(-end // 8) * 8 + 8 + first  # padding, then unaligned again
        row += rows
    assert offset <= 1000 and all(s[0] % 8 for s in segs)
    return segs


def check_state_pieces(device):
    """16- and 32-bit pieces: contiguous and strided element dims, unaligned
    states in a padded page, block ids in any order, an empty row, and a large
    layer and first row."""
    for dtype in (torch.bfloat16, torch.float32):
        page = state_page(5, 1000, seed=11)
        segs = state_segments(dtype)
        ids, valid = [3, 0, 4, 1, 2], [1, 1, 1, 1, 0]
        for layer in (0, 2**20):
            kernel = state_accumulate(page.to(device), segs, ids, valid, layer=layer,
                                      path="triton", cols=2, column=1)
            torch_out = state_accumulate(page, segs, ids, valid, layer=layer,
                                         path="torch", cols=2, column=1)
            assert torch.equal(kernel, torch_out), (dtype, layer)
            assert (kernel[:, 0] == 5).all()
            got = (kernel[:, 1] - 5).numpy().view(np.uint64).tolist()
            want = state_reference(page, segs, ids[:4], layer) + [0]
            assert got == want, (dtype, layer)


def check_large_state_spans_chunks(device):
    """A Mamba-sized state of 24K pieces per block (more than the kernel's
    16K-piece chunk), stored (len, dim), so rows are strided."""
    for dtype in (torch.bfloat16, torch.float32):
        esize = torch.empty(0, dtype=dtype).element_size()
        rows, elements = 8192, 3
        page = state_page(2, rows * elements * esize + 4 * esize, seed=12)
        segs = [(2 * esize, dtype, "elements", rows, elements, 64)]
        kernel = state_accumulate(page.to(device), segs, [1, 0], [1, 1], layer=7,
                                  path="triton")
        got = (kernel[:, 0] - 5).numpy().view(np.uint64).tolist()
        assert got == state_reference(page, segs, [1, 0], 7), dtype


def check_warm_up_adds_nothing(device):
    view = LayerView([random_cache(2, 1, 4, 8, seed=7).to(device)], block_size=4,
                     layer=0, path="triton")
    view.warm_up()


CHECKS = [check_layouts_and_splits, check_multi_tile_rows, check_large_rows_span_chunks,
          check_one_column_of_a_wider_matrix, check_rows_of_two_groups,
          check_warm_up_adds_nothing, check_state_pieces, check_large_state_spans_chunks]
