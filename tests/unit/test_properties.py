"""Property tests: random shapes, layouts and requests against the reference,
on both CPU paths (Numba, PyTorch; the cpu_path fixture)."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reference
from kvcaches import random_cache, to_layout
from vllm_kvchecksum import layer_block_checksums
from vllm_kvchecksum.core.kernels import torch_path

pytestmark = pytest.mark.usefixtures("cpu_path")

SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@st.composite
def layers(draw):
    kernel_tokens = draw(st.sampled_from([1, 2, 3, 4]))
    per_block = draw(st.sampled_from([1, 2, 3]))
    block_size = kernel_tokens * per_block
    num_blocks = draw(st.integers(1, 4))
    heads = draw(st.integers(1, 3))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float32, torch.uint8]))
    split = draw(st.booleans())
    cells = [8 * draw(st.integers(1, 3)) for _ in range(2 if split else 1)]
    seed = draw(st.integers(0, 2**16))
    logical = [random_cache(num_blocks, heads, block_size, c, dtype, seed + i)
               for i, c in enumerate(cells)]
    layout = draw(st.sampled_from(["HND", "NHD"]))
    padded = draw(st.booleans())
    caches = [to_layout(c, layout, kernel_tokens, padded) for c in logical]
    ids = draw(st.lists(st.integers(0, num_blocks - 1), min_size=0, max_size=5))
    first = draw(st.integers(0, 3))
    num_tokens = draw(st.integers(0, (first + len(ids) + 1) * block_size))
    return dict(caches=caches, ids=ids, num_tokens=num_tokens, first=first,
                layer=draw(st.integers(0, 100)),
                first_head=draw(st.sampled_from([0, 1, 2**15, 2**16 - heads])),
                layout=layout, block_size=block_size)


@SETTINGS
@given(layers(), st.sampled_from([1, 64, torch_path.GATHER_CHUNK_BYTES]))
def test_random_layers_match_reference(monkeypatch, case, chunk_bytes):
    monkeypatch.setattr(torch_path, "GATHER_CHUNK_BYTES", chunk_bytes)
    kw = dict(first_block_position=case["first"], layer=case["layer"],
              first_head=case["first_head"], layout=case["layout"],
              block_size=case["block_size"])
    got = layer_block_checksums(case["caches"], case["ids"], case["num_tokens"], **kw)
    want = reference.layer_checksums(case["caches"], case["ids"], case["num_tokens"], **kw)
    assert [int(v) for v in got] == want


@SETTINGS
@given(layers())
def test_blocks_add_up_over_the_request(case):
    """Any split of a request into consecutive runs of blocks sums the same:
    per-block values equal the sum of their single-block calls."""
    kw = dict(layer=case["layer"], first_head=case["first_head"],
              layout=case["layout"], block_size=case["block_size"])
    ids, first, n = case["ids"], case["first"], case["num_tokens"]
    together = layer_block_checksums(case["caches"], ids, n, first_block_position=first, **kw)
    one_by_one = [layer_block_checksums(case["caches"], [b], n,
                                        first_block_position=first + i, **kw)[0]
                  for i, b in enumerate(ids)]
    assert list(together) == one_by_one
