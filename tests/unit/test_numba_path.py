"""The Numba pass: chosen on CPU, equal to the PyTorch path at real sizes,
safe with bad block ids, and compiled once (on disk) rather than per request.

The reference tests (test_layer_view, test_properties, test_state_pieces) run
on both CPU paths; these cover what only the compiled pass has.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import reference
from kvcaches import random_cache, to_layout
from vllm_kvchecksum.core import kernels
from vllm_kvchecksum.core.kernels import numba_path
from vllm_kvchecksum.core.layer_view import LayerView

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def kv(blocks, heads, tokens, head_size, layout="HND", dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (blocks, heads, tokens, head_size) if layout == "HND" else (
        blocks, tokens, heads, head_size)
    return [torch.randn(shape, generator=gen).to(dtype) for _ in range(2)]


def both_paths(caches, ids, t0, valid, **kw):
    outs = []
    for path in ("numba", "torch"):
        view = LayerView(caches, path=path, **kw)
        out = torch.full((len(ids), 2), 3, dtype=torch.int64)
        view.accumulate(out, 1, torch.tensor(ids), torch.tensor(t0), torch.tensor(valid))
        outs.append(out)
    return outs


def test_auto_picks_numba_on_cpu_and_torch_without_it(monkeypatch):
    k, v = kv(4, 2, 16, 64)
    view = LayerView([k, v], block_size=16, layer=0)
    assert view.path == "numba"
    before = numba_path.call_count
    out = torch.zeros(1, 1, dtype=torch.int64)
    one = torch.ones(1, dtype=torch.int64)
    view.accumulate(out, 0, one, one * 0, one * 16)
    assert numba_path.call_count == before + 1 and out[0, 0] != 0
    monkeypatch.setattr(kernels, "numba_available", lambda: False)
    assert LayerView([k, v], block_size=16, layer=0).path == "torch"
    with pytest.raises(ValueError, match="numba does not import"):
        LayerView([k, v], block_size=16, layer=0, path="numba")


def test_a_device_cache_never_takes_the_numba_path():
    k = torch.empty(4, 2, 16, 64, dtype=torch.bfloat16, device="meta")
    assert LayerView([k], block_size=16, layer=0).path == "torch"
    with pytest.raises(ValueError, match="host memory"):
        LayerView([k], block_size=16, layer=0, path="numba")


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_valid_counts_past_the_block_count_as_full(layout):
    caches = kv(4, 2, 8, 64, layout)
    ids, t0 = [1, 0], [0, 16]
    over, full = (both_paths(caches, ids, t0, valid, block_size=16, layer=1, layout=layout)
                  for valid in ([20, 16 + 8 * 10**6], [16, 16]))
    assert torch.equal(over[0], full[0]) and torch.equal(over[1], full[1])


def test_a_layer_of_no_heads_adds_nothing():
    k = torch.zeros(4, 0, 16, 64, dtype=torch.bfloat16)
    view = LayerView([k, k], block_size=16, layer=0, path="numba")
    out = torch.full((1, 1), 9, dtype=torch.int64)
    view.accumulate(out, 0, torch.tensor([1]), torch.tensor([0]), torch.tensor([16]))
    assert out[0, 0] == 9


def test_a_device_view_switched_to_numba_refuses():
    k = torch.empty(4, 2, 16, 64, dtype=torch.bfloat16, device="meta")
    view = LayerView([k], block_size=16, layer=0)
    view.path = "numba"
    rows = torch.zeros(1, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match="host memory"):
        view.accumulate(torch.zeros(1, 1, dtype=torch.int64, device="meta"), 0, rows, rows, rows)


def test_numba_that_does_not_import_is_unavailable(monkeypatch):
    kernels.numba_available.cache_clear()
    monkeypatch.setitem(sys.modules, "numba", None)  # import numba raises ImportError
    try:
        assert kernels.numba_available() is False
    finally:
        kernels.numba_available.cache_clear()


def test_a_layer_of_no_blocks():
    k = torch.zeros(0, 2, 16, 80, dtype=torch.bfloat16)[..., :64]  # padded cells
    view = LayerView([k, k], block_size=16, layer=0, path="numba")
    out = torch.zeros(1, 1, dtype=torch.int64)
    view.accumulate(out, 0, torch.tensor([7]), torch.tensor([0]), torch.tensor([0]))
    assert out[0, 0] == 0
    with pytest.raises(IndexError, match="outside the layer's 0 blocks"):
        view.accumulate(out, 0, torch.tensor([0]), torch.tensor([0]), torch.tensor([1]))


@pytest.mark.parametrize("layout,tokens,block_size,head_size", [
    ("HND", 16, 16, 128),  # 32 pieces a token, the common case
    ("NHD", 16, 16, 128),
    ("HND", 16, 32, 80),  # two kernel blocks a block; 20 pieces (vector remainder)
    ("NHD", 8, 16, 96),
    ("HND", 16, 16, 576),  # an MLA-sized cell: 144 pieces
])
def test_equals_the_torch_path_at_real_sizes(layout, tokens, block_size, head_size):
    caches = kv(24, 4, tokens, head_size, layout, seed=head_size)
    rng = np.random.default_rng(head_size)
    blocks = 24 // (block_size // tokens)
    ids = rng.permutation(blocks).tolist()
    t0 = [block_size * i for i in range(blocks)]
    valid = [block_size] * blocks
    valid[-1], valid[3], valid[5] = 5, 0, block_size - 1  # partial rows, an empty one
    numba_out, torch_out = both_paths(caches, ids, t0, valid, block_size=block_size,
                                      layer=7, first_head=12, layout=layout)
    assert torch.equal(numba_out, torch_out)
    assert (numba_out[:, 0] == 3).all() and numba_out[3, 1] == 3


@pytest.mark.parametrize("kernel_tokens,padded", [(8, False), (4, False), (8, True)])
def test_rows_of_full_and_partial_blocks_match_the_reference(kernel_tokens, padded):
    """Full blocks in groups of four (and the ones left over), partial and
    empty rows between them, repeated ids: every row's value is the
    reference's for that one block, and no other row's."""
    caches = [to_layout(random_cache(10, 3, 8, 32, seed=s), "HND", kernel_tokens, padded)
              for s in (5, 6)]
    rng = np.random.default_rng(kernel_tokens)
    rows = 23
    ids = rng.integers(0, 10, rows).tolist()
    positions = rng.integers(0, 50, rows).tolist()
    valid = [8] * rows
    for r, v in ((2, 3), (7, 0), (8, 1), (15, 7), (16, 0), (22, 5)):
        valid[r] = v
    ids[7] = 10**9  # empty rows' ids are never read
    view = LayerView(caches, block_size=8, layer=11, first_head=6, path="numba")
    assert view.path == "numba" and (view.caches[0].token_stride == 4) != padded
    out = torch.full((rows, 3), 17, dtype=torch.int64)
    view.accumulate(out, 2, torch.tensor(ids), torch.tensor(positions) * 8, torch.tensor(valid))
    got = (out[:, 2] - 17).numpy().view(np.uint64).tolist()
    want = [0 if v == 0 else reference.layer_checksums(caches, [b], 8 * pos + v, first_block_position=pos,
                                                       layer=11, first_head=6, block_size=8)[0]
            for b, pos, v in zip(ids, positions, valid)]
    assert got == want
    assert (out[:, :2] == 17).all()


@pytest.mark.parametrize("bad", [24, -1, 10**12])
@pytest.mark.parametrize("kernel_tokens", [16, 8])  # 8: two kernel blocks a block
def test_a_bad_block_id_raises_and_adds_nothing(bad, kernel_tokens):
    k, v = kv(24 * 16 // kernel_tokens, 2, kernel_tokens, 64)
    view = LayerView([k, v], block_size=16, layer=0, path="numba")
    out = torch.full((3, 1), 5, dtype=torch.int64)
    ids = torch.tensor([1, bad, 2])
    with pytest.raises(IndexError, match=f"block id {bad} of row 1 is outside the layer's 24 "):
        view.accumulate(out, 0, ids, torch.tensor([0, 16, 32]), torch.tensor([16, 16, 16]))
    assert (out == 5).all()  # every id is checked before anything is added
    # An empty row's id is never read, whatever it holds.
    view.accumulate(out, 0, ids, torch.tensor([0, 16, 32]), torch.tensor([16, 0, 16]))
    assert out[1, 0] == 5 and out[0, 0] != 5


_START = """
import json, sys, torch
sys.path.insert(0, {root!r})
from vllm_kvchecksum.core.kernels import numba_path
from vllm_kvchecksum.core.layer_view import LayerView
k = torch.zeros(4, 2, 16, 64, dtype=torch.bfloat16)
LayerView([k, k], block_size=16, layer=0).warm_up()
stats = numba_path._cache_rows.stats
print(json.dumps({{"hits": len(stats.cache_hits), "misses": len(stats.cache_misses),
                  "signatures": len(numba_path._cache_rows.signatures)}}))
"""


def test_the_pass_compiles_once_and_later_starts_load_it(tmp_path):
    """A fresh worker compiles the pass (all three piece widths, in one order)
    when it first chooses it, not in a request; the next one loads it from
    numba's disk cache."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    code = _START.format(root=ROOT)

    def start():
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=300, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])

    assert start() == {"hits": 0, "misses": 3, "signatures": 3}
    assert start() == {"hits": 3, "misses": 0, "signatures": 3}


def test_odd_arguments_take_the_compiled_signatures():
    """A non-contiguous out, ids, positions or counts are copied to the one
    signature, never compiled anew in a request, and give the same sums."""
    k, v = kv(8, 2, 16, 64)
    view = LayerView([k, v], block_size=16, layer=2, path="numba")
    ids, t0, valid = torch.tensor([3, 1, 6, 0]), torch.tensor([0, 16, 32, 48]), torch.tensor([16, 9, 16, 0])
    want = torch.zeros(4, 2, dtype=torch.int64)
    view.accumulate(want, 1, ids, t0, valid)
    wide = torch.zeros(2, 4, dtype=torch.int64).t()  # out transposed: not C-contiguous
    spread = [torch.stack([x, x], 1)[:, 0] for x in (ids, t0, valid)]  # stride 2
    assert not wide.is_contiguous() and not spread[0].is_contiguous()
    view.accumulate(wide, 1, *spread)
    assert torch.equal(wide, want) and len(numba_path._cache_rows.signatures) == 3


def test_two_layers_into_one_column_of_a_non_contiguous_out():
    """Layers of one group add into the same column: through a non-contiguous
    out (copied for the pass and written back) the column must end as the
    sum of both layers, as on the PyTorch path, not with the first counted twice."""
    first, second = kv(8, 2, 16, 64, seed=1), kv(8, 2, 16, 64, seed=2)
    ids, t0, valid = torch.tensor([3, 1, 6, 0]), torch.tensor([0, 16, 32, 48]), torch.tensor([16, 9, 16, 0])
    outs = {}
    for path in ("numba", "torch"):
        out = torch.zeros(3, 4, dtype=torch.int64).t()  # not C-contiguous
        out[:, 0] = 7  # another group's column: left as it is
        for layer, caches in enumerate((first, second)):
            LayerView(caches, block_size=16, layer=layer, path=path).accumulate(out, 1, ids, t0, valid)
        outs[path] = out
    assert not outs["numba"].is_contiguous()
    assert torch.equal(outs["numba"], outs["torch"]) and (outs["numba"][:3, 1] != 0).all()
    assert (outs["numba"][:, 0] == 7).all() and (outs["numba"][:, 2] == 0).all()


def test_rows_sharing_memory_are_refused(cpu_path):
    k, v = kv(4, 2, 16, 64)
    view = LayerView([k, v], block_size=16, layer=0)
    out = torch.zeros(1, 1, dtype=torch.int64).expand(3, 1)
    rows = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="rows share memory"):
        view.accumulate(out, 0, rows, rows * 16, torch.full((3,), 16))


@pytest.mark.parametrize("bits,dtype", [(16, torch.float16), (32, torch.float32)])
def test_one_element_read_as_every_piece(bits, dtype):
    """A narrow state whose element dimension has stride 0 (expand()): both
    paths read the one element as each piece."""
    gen = torch.Generator().manual_seed(bits)
    state = torch.randn(5, 3, 1, 1, generator=gen).to(dtype).expand(5, 3, 1, 7)
    outs = []
    for path in ("numba", "torch"):
        view = LayerView(state, block_size=1, layer=4, first_head=2, piece_bits=bits, path=path)
        assert view.caches[0].piece_stride == 0
        out = torch.zeros(4, 1, dtype=torch.int64)
        view.accumulate(out, 0, torch.tensor([4, 0, 2, 1]), torch.zeros(4, dtype=torch.int64),
                        torch.tensor([1, 1, 0, 1]))
        outs.append(out)
    assert torch.equal(*outs) and (outs[0][[0, 1, 3]] != 0).all()


def test_without_a_disk_cache_the_pass_still_compiles(caplog):
    """Code numba cannot cache (here: defined with no source file, as with
    no writable cache folder) is compiled per process, with a warning."""
    params = ", ".join(f"a{i}" for i in range(22))
    namespace = {}
    exec(f"def rows({params}):\n    return a1 + 1\n", namespace)
    with caplog.at_level("WARNING"):
        rows = numba_path._compiled(namespace["rows"])
    assert "cannot be cached on disk" in caplog.text and "NUMBA_CACHE_DIR" in caplog.text
    one = np.zeros(1, dtype=np.int64)
    args = [one.view(np.uint16)[:1].copy()] + [5] * 9 + [one] * 3 + [0] * 3 + \
        [np.zeros((1, 1), dtype=np.int64), 0, np.zeros(1, dtype=np.uint32), 0, 0, 0]
    assert rows(*args) == 6


def test_a_pass_that_does_not_import_leaves_the_pytorch_path(monkeypatch, caplog):
    kernels.numba_available.cache_clear()
    monkeypatch.setitem(sys.modules, "vllm_kvchecksum.core.kernels.numba_path", None)
    try:
        with caplog.at_level("WARNING"):
            assert kernels.numba_available() is False
        assert "numba imports but the compiled CPU pass does not" in caplog.text
    finally:
        kernels.numba_available.cache_clear()


def test_reassigning_the_path_switches_code():
    k, v = kv(4, 2, 16, 64)
    view = LayerView([k, v], block_size=16, layer=0)
    one = torch.ones(1, dtype=torch.int64)
    outs = []
    for path in ("numba", "torch"):
        view.path = path
        calls = numba_path.call_count
        out = torch.zeros(1, 1, dtype=torch.int64)
        view.accumulate(out, 0, one, one * 0, one * 16)
        assert numba_path.call_count == calls + (path == "numba")
        outs.append(out)
    assert torch.equal(*outs)
