"""Moving checksum values from the device to host memory without a host sync.

Mirrors the model runner's copy of sampled tokens: at the time of the copy a
side stream waits on the stream that computed the values (taken then, not
cached: the runner may switch streams after init), a non-blocking copy to
pinned memory is queued on the side stream, and a blocking event is recorded
after it. Whoever needs the values later, on any thread, waits only for that
event. The device values stay referenced until the copy is done.

On devices without CUDA streams (the CPU backend) `StubStream` and
`StubEvent` stand in: the copy is then a plain synchronous copy and the
event is always complete. The stubs exist only because CPU tensors have no
streams; they are not used when CUDA is available.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import torch


class StubStream:
    """Stands in for torch.cuda.Stream on devices without streams (CPU)."""

    def wait_stream(self, other) -> None:  # noqa: D102 - nothing to order on CPU
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class StubEvent:
    """Stands in for torch.cuda.Event on CPU: recorded work is already done."""

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def uses_streams(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available()


def new_copy_stream(device: torch.device):
    """The worker's side stream for checksum copies (one per worker)."""
    return torch.cuda.Stream(device=device) if uses_streams(device) else StubStream()


class PendingHostCopy:
    """Device values being copied to host; `complete()` waits and delivers them.

    `deliver` receives the values as a uint64 numpy array of the device
    tensor's shape, exactly once.
    """

    def __init__(self, values: torch.Tensor, copy_stream, deliver: Callable[[np.ndarray], None]):
        self._deliver = deliver
        self._lock = threading.Lock()
        self._done = False
        self._device_values: torch.Tensor | None = values
        if uses_streams(values.device):
            current = torch.cuda.current_stream(values.device)
            copy_stream.wait_stream(current)
            with torch.cuda.stream(copy_stream):
                self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
                self._host.copy_(values, non_blocking=True)
                self._event = torch.cuda.Event(blocking=True)
                self._event.record(copy_stream)
        else:
            self._host = values.to("cpu", copy=True)
            self._event = StubEvent()

    def complete(self) -> None:
        with self._lock:
            if self._done:
                return
            self._event.synchronize()
            host = self._host.numpy().view(np.uint64)
            self._device_values = None
            self._done = True
            self._deliver(host)
