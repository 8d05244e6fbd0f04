"""The Triton kernel, run by Triton's interpreter on CPU tensors.

The interpreter must be chosen before triton is imported, so the checks
(kernel_checks.py) run in a subprocess; it fails unless the kernel is the
interpreted one and every check launched it.
"""

import os
import subprocess
import sys

import pytest

from vllm_kvchecksum.core.kernels import triton_available

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "run_interpreted_kernel_checks.py")


@pytest.mark.skipif(not triton_available(), reason="triton does not import")
def test_kernel_interpreted_matches_torch_path_and_reference():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    import kernel_checks
    assert [line.split()[0] for line in lines[:-1]] == [c.__name__ for c in kernel_checks.CHECKS]
    assert int(lines[-1].split()[1]) > 0
