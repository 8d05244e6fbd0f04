"""Run kernel_checks on CPU under Triton's interpreter, in a fresh process.

TRITON_INTERPRET must be set before triton is first imported, which a
pytest process that already imported it cannot undo; test_triton_kernel.py
therefore runs this script as a subprocess. It prints one line per check
and a final line "launches N" counting the kernel launches, and exits
non-zero if a check fails or the kernel is not the interpreted one.
"""

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(os.path.dirname(_HERE))]

import kernel_checks  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from vllm_kvchecksum.core.kernels import triton_kernel  # noqa: E402


def main() -> int:
    if not isinstance(triton_kernel._layer_checksum_kernel, InterpretedFunction):
        print("the kernel is not running under the interpreter")
        return 1
    for check in kernel_checks.CHECKS:
        before = triton_kernel.launch_count
        check("cpu")
        launched = triton_kernel.launch_count - before
        print(f"{check.__name__} ok, {launched} launches")
        if launched == 0:
            print(f"{check.__name__} launched no kernel")
            return 1
    print(f"launches {triton_kernel.launch_count}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
