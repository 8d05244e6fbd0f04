"""Loaded by the demo's CPU servers only (this directory is on their PYTHONPATH).

NIXL's Python wrapper creates every agent with pthrDelay = 0: its UCX
progress thread then polls without pause and keeps one core busy per agent
even when idle. The CPU demo runs eight servers on two cores, so eight such
threads would starve the engines. With KVCS_NIXL_PTHR_DELAY_US set, the
agents are created with that pause (microseconds) between progress rounds
instead. Nothing else changes: no vLLM or checksum code, and the GPU demo
does not use this directory.
"""

import os


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


_delay = os.environ.get("KVCS_NIXL_PTHR_DELAY_US")
if _delay:
    _pause_nixl_progress_thread(int(_delay))
