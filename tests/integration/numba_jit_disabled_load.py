"""A verified load between a real producer and a real consumer (pd_harness:
patched vLLM schedulers, real KVChecksumWorkers over CPU caches), for
test_numba_jit_disabled.py to run in a process with NUMBA_DISABLE_JIT=1.
A 200-token prompt: each checksum covers twelve full blocks in one call,
the case where the Numba pass, run as Python, raised in the workers' step.
Prints one line, ANSWER and JSON: the sides' counters, the paths their
views took, the warnings logged.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "unit")]


def main() -> None:
    try:  # vLLM 0.34 without triton-cpu: scripts/workbench/triton_switch.py (on PYTHONPATH there)
        import triton_switch
    except ImportError:
        pass
    else:
        triton_switch.install()
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    for name in ("vllm_kvchecksum", "vllm.kv_checksum"):
        logging.getLogger(name).addHandler(Keep(logging.WARNING))

    from pd_harness import load, make_side, prefill, prompt_of, stats

    producer = make_side("kv_producer", fail_closed=True)
    consumer = make_side("kv_consumer", fail_closed=True)
    preq, params = prefill(producer, prompt_of(200))
    result = load(consumer, producer, preq, params)
    paths = sorted({cache.view.path for side in (producer, consumer) for w in side.workers
                    for plan in w.checksums.plans.values() for cache in plan.caches})
    print("ANSWER " + json.dumps({"producer": stats(producer), "consumer": stats(consumer), "paths": paths,
                                  "next_scheduled": result.next_scheduled, "warnings": records}), flush=True)


if __name__ == "__main__":
    main()
