"""Make the repo root (for vllm_kvchecksum) and this folder (for the test
helpers: reference, kvcaches, kernel_checks) importable, however pytest is
invoked."""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))
for _path in (_HERE, _ROOT):
    if _path not in sys.path:
        sys.path.insert(0, _path)


import pytest  # noqa: E402


@pytest.fixture(params=["numba", "torch"])
def cpu_path(request, monkeypatch):
    """Run a test once per CPU code path: the Numba pass (the default on CPU)
    and the PyTorch fallback (what runs where numba does not import).

    LayerView's "auto" picks the path, so tests that build views without
    naming one exercise both; the value is the path they get.
    """
    from vllm_kvchecksum.core import kernels
    if request.param == "numba":
        assert kernels.numba_available(), (
            "numba does not import; vLLM installs it, and the Numba path is "
            "the default on CPU")
    else:
        monkeypatch.setattr(kernels, "numba_available", lambda: False)
    return request.param
