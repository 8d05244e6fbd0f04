"""Checksum values reach host memory through their own copy stream and event."""

import threading

import numpy as np
import pytest
import torch

from vllm_kvchecksum.core.host_copy import PendingHostCopy, StubEvent, StubStream, new_copy_stream

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_cpu_copy_is_synchronous_and_delivers_once():
    got = []
    values = torch.tensor([[-1, 2], [3, 4]], dtype=torch.int64)
    copy = PendingHostCopy(values, new_copy_stream(values.device), got.append)
    assert isinstance(new_copy_stream(values.device), StubStream)
    assert isinstance(copy._event, StubEvent)
    values.zero_()  # the copy was taken when queued, not when completed
    t = threading.Thread(target=copy.complete)
    t.start()
    t.join()
    copy.complete()
    assert len(got) == 1
    assert got[0].dtype == np.uint64
    assert got[0].tolist() == [[2**64 - 1, 2], [3, 4]]


@cuda
@pytest.mark.cuda
def test_finalize_from_another_thread_while_main_stream_is_busy():
    """The copy is ordered after the values on the stream that computed them,
    so a reader on another thread sees them even while that stream is busy."""
    device = torch.device("cuda")
    side = new_copy_stream(device)
    main = torch.cuda.Stream(device)
    got = []
    with torch.cuda.stream(main):
        big = torch.randn(4096, 4096, device=device)
        values = torch.zeros(8, 2, dtype=torch.int64, device=device)
        for _ in range(20):  # keep the stream busy before the values are written
            big = big @ big
            big /= big.norm()
        values += torch.arange(16, device=device, dtype=torch.int64).view(8, 2)
        copy = PendingHostCopy(values, side, got.append)
        for _ in range(20):  # and after
            big = big @ big
    t = threading.Thread(target=copy.complete)
    t.start()
    t.join()
    assert got[0].tolist() == np.arange(16, dtype=np.uint64).reshape(8, 2).tolist()
