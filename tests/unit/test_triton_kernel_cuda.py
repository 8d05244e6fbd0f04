"""The compiled Triton kernel on CUDA: the same checks as the interpreted
run (kernel_checks.py), plus the automatic path choice. Skipped without a
CUDA device; needs torch and triton, not vllm."""

import pytest
import torch

from vllm_kvchecksum.kernels import triton_available

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(
    not (torch.cuda.is_available() and triton_available()),
    reason="needs a CUDA device and triton")]

import kernel_checks  # noqa: E402


@pytest.mark.parametrize("check", kernel_checks.CHECKS, ids=lambda c: c.__name__)
def test_kernel_on_cuda(check):
    check("cuda")
    torch.cuda.synchronize()


def test_cuda_caches_pick_the_kernel():
    from vllm_kvchecksum.layer_view import LayerView
    view = LayerView([torch.zeros(2, 1, 4, 8, dtype=torch.bfloat16, device="cuda")],
                     block_size=4, layer=0)
    assert view.path == "triton"


def test_public_function_on_cuda():
    from kvcaches import random_cache

    import reference
    from vllm_kvchecksum import layer_block_checksums
    k, v = random_cache(6, 4, 16, 256, seed=1), random_cache(6, 4, 16, 256, seed=2)
    got = layer_block_checksums((k.cuda(), v.cuda()), [5, 0, 3], 40, layer=9, first_head=4)
    want = reference.layer_checksums([k, v], [5, 0, 3], 40, layer=9, first_head=4)
    assert [int(x) for x in got] == want
