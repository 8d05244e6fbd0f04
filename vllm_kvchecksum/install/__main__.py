"""`python -m vllm_kvchecksum.install`: the `vllm-kvchecksum` console script."""

import sys

from .cli import main

sys.exit(main())
