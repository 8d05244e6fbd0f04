"""Loaded by the demo's CPU servers only (this directory is on their PYTHONPATH).

The CPU demo runs up to eight vLLM servers (24 processes) on two cores. Two
polling loops that cost nothing on a GPU host starve each other there, and
each is turned down here, by environment variable, in these processes only:

- KVCS_NIXL_PTHR_DELAY_US: NIXL's Python wrapper creates every agent with
  pthrDelay = 0, so its UCX progress thread polls without pause and keeps a
  core busy per server even when idle. Agents are created with this pause
  (microseconds) between progress rounds instead.
- KVCS_SHM_BUSY_LOOP_S: a worker reading vLLM's shared-memory message queue
  spins (sched_yield) for 1 s after each message before it sleeps on its
  socket; with many servers those spins take the cores from the ones with
  work. Readers spin this long instead.

No checksum code and no vLLM decision changes; the GPU demo does not use
this directory.
"""

import importlib.abc
import importlib.util
import os
import sys


def _pause_nixl_progress_thread(delay_us: int) -> None:
    try:
        import nixl._api as api
    except Exception:  # no NIXL here: nothing to do
        return
    bind = api.nixlBind
    create = bind.nixlAgent

    def agent_with_pause(name, config):
        config.pthrDelay = delay_us
        return create(name, config)

    bind.nixlAgent = agent_with_pause


_SHM_MODULE = "vllm.distributed.device_communicators.shm_broadcast"


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls `patch(module)` once the named module is imported (not before:
    importing vLLM here would change its start-up order)."""

    def __init__(self, name, patch):
        self.name, self.patch = name, patch

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module, patch = spec.loader.exec_module, self.patch

        def exec_and_patch(module):
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


def _shorter_shm_spin(seconds: float):
    def patch(module):
        init = module.SpinCondition.__init__

        def init_with_spin(self, is_reader, context, notify_address, busy_loop_s=1):
            init(self, is_reader, context, notify_address, busy_loop_s=min(busy_loop_s, seconds))

        module.SpinCondition.__init__ = init_with_spin

    sys.meta_path.insert(0, _AfterImport(_SHM_MODULE, patch))


if os.environ.get("KVCS_NIXL_PTHR_DELAY_US"):
    _pause_nixl_progress_thread(int(os.environ["KVCS_NIXL_PTHR_DELAY_US"]))
if os.environ.get("KVCS_SHM_BUSY_LOOP_S"):
    _shorter_shm_spin(float(os.environ["KVCS_SHM_BUSY_LOOP_S"]))
