"""One real vLLM engine (CPU, tiny Llama) that answers, from its worker, whether
the worker process may run AMX tile instructions. Run as a subprocess by
test_cpu_amx_permission.py: prints one line, ANSWER and JSON, {"amx_permitted": [per worker]}.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc of a function


def amx_permitted(worker=None) -> bool:
    """arch_prctl(ARCH_GET_XCOMP_PERM): whether this process holds the AMX tile
    data state (XFEATURE_XTILEDATA, bit 18), which AMX instructions need."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    features = ctypes.c_uint64(0)
    sys_arch_prctl, arch_get_xcomp_perm = 158, 0x1022
    return libc.syscall(sys_arch_prctl, arch_get_xcomp_perm, ctypes.byref(features)) == 0 and bool(
        features.value & (1 << 18))


def main() -> None:
    from vllm import LLM

    llm = LLM(model=sys.argv[1], dtype="bfloat16", enforce_eager=True, block_size=32, max_model_len=512,
              kv_cache_memory_bytes=64 * 2**20, seed=0)
    # Right after start-up: the profiling and warm-up forwards have run, no request has.
    print("ANSWER " + json.dumps({"amx_permitted": llm.collective_rpc(amx_permitted)}), flush=True)
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
