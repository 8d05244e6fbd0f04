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
