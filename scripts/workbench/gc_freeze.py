"""pytest plugin (`-p gc_freeze`): vLLM's per-test cleanup without re-walking every import.

Why it exists. vLLM's `tests/conftest.py` runs `cleanup_dist_env_and_memory()`
after every test (autouse `cleanup_fixture`). That function calls
`gc.unfreeze()` and then a full `gc.collect()`. With torch, transformers and
vLLM imported, a full collection walks millions of long-lived objects that can
never be garbage: 0.41 s per test on vLLM 0.34.0 here, 124 s of the 170 s that
`tests/v1/core/test_scheduler.py` took (cProfile, 2026-12-07). The upstream gate
runs thousands of such tests on both bases.

What it does. When collection has finished (every test module imported), it
collects once and freezes what is alive (`gc.freeze()`: those objects move to
the permanent generation, which collections skip), and it makes `gc.unfreeze()`
a no-op until pytest ends, so vLLM's cleanup cannot thaw them again. Objects a
test creates are not frozen and are collected as before; only garbage that
existed before the first test and the objects an in-process engine freezes
itself stay in memory (a little more memory, never a different outcome).
Nothing else in the test process changes: the tests, vLLM's code and its
cleanup all run as they are.

Where it is used. The upstream gate passes `-p gc_freeze` to every test
process, for the baseline run on the unpatched base and for the patched tree
alike (scripts/workbench/upstream.py), so a baseline and a gate run differ only
in the tree. `KVCS_GC_FREEZE=0` turns it off (to compare, or to rule it out).
"""

from __future__ import annotations

import gc
import os

_thaw = gc.unfreeze
STATE = "off: collection has not finished"


def _stay_frozen() -> None:
    """Stands in for gc.unfreeze() while the tests run (see the module docstring)."""


def pytest_collection_finish(session) -> None:
    global STATE
    if os.environ.get("KVCS_GC_FREEZE", "1") == "0":
        STATE = "off: KVCS_GC_FREEZE=0"
        return
    gc.collect()
    gc.freeze()
    gc.unfreeze = _stay_frozen
    STATE = f"on: {gc.get_freeze_count()} objects frozen after collection"


def pytest_report_header(config) -> str:
    return "gc_freeze: objects alive after collection are frozen; vLLM's per-test gc.collect() skips them"


def pytest_unconfigure(config) -> None:
    gc.unfreeze = _thaw
