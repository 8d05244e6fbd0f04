"""The compiled Triton kernel on CUDA: the same checks as the interpreted
run (kernel_checks.py), plus the automatic path choice, Mamba state pieces
(16/32-bit) against the PyTorch path on the same device, and a Mamba-sized
state spanning two kernel chunks. Skipped without a CUDA device; needs
torch and triton, not vllm."""

import pytest
import torch

from vllm_kvchecksum.core.kernels import triton_available

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(
    not (torch.cuda.is_available() and triton_available()),
    reason="needs a CUDA device and triton")]

import kernel_checks  # noqa: E402


@pytest.mark.parametrize("check", kernel_checks.CHECKS, ids=lambda c: c.__name__)
def test_kernel_on_cuda(check):
    check("cuda")
    torch.cuda.synchronize()


def test_cuda_caches_pick_the_kernel():
    from vllm_kvchecksum.core.layer_view import LayerView
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int32],
                         ids=str)
def test_state_pieces_kernel_equals_torch_path_on_cuda(dtype):
    """2- and 4-byte pieces, contiguous and strided element dims, unaligned
    states in a page: the kernel and the PyTorch path on the same device
    (every row masked, no host sync) agree bit for bit, and with the
    reference."""
    page = kernel_checks.state_page(5, 1000, seed=31)
    segs = kernel_checks.state_segments(dtype)
    ids, valid = [3, 0, 4, 1, 2], [1, 1, 1, 1, 0]
    outs = [kernel_checks.state_accumulate(page.cuda(), segs, ids, valid, layer=6, path=path,
                                           cols=2, column=1) for path in ("triton", "torch")]
    torch.cuda.synchronize()
    assert torch.equal(outs[0], outs[1])
    got = (outs[0][:, 1] - 5).numpy().view("uint64").tolist()
    assert got == kernel_checks.state_reference(page, segs, ids[:4], 6) + [0]


@pytest.mark.parametrize("layout", ["rows", "elements"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_mamba_sized_state_on_cuda(dtype, layout):
    """A state of 24K pieces per block (a (3, 8192) conv state, stored
    (len, dim) or (dim, len)): more than CHUNK_PIECES, so each block spans two
    kernel chunks; equal to the definition."""
    from vllm_kvchecksum.core.kernels import triton_kernel
    rows, elements = 8192, 3
    assert triton_kernel.CHUNK_PIECES < rows * elements < 2 * triton_kernel.CHUNK_PIECES
    esize = torch.empty(0, dtype=dtype).element_size()
    page = kernel_checks.state_page(3, rows * elements * esize + 8 * esize, seed=32)
    segs = [(2 * esize, dtype, layout, rows, elements, 100)]
    ids = [2, 0, 1]
    kernel = kernel_checks.state_accumulate(page.cuda(), segs, ids, [1, 1, 1], layer=11,
                                            path="triton")
    torch.cuda.synchronize()
    got = (kernel[:, 0] - 5).numpy().view("uint64").tolist()
    assert got == kernel_checks.state_reference(page, segs, ids, 11)
