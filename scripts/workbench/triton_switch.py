"""pytest plugin (`-p triton_switch`): vLLM 0.34 configs on an x86 CPU without triton-cpu.

Why it exists. vLLM 0.34's x86 CPU model runner compiles its kernels with
triton-cpu, so `CpuPlatform.check_and_update_config` raises "vLLM on x86 CPUs
requires Triton (triton-cpu)" when Triton has no CPU backend. triton-cpu is
not on the package index (vLLM's requirements/cpu.txt takes it from GitHub
releases), so the 0.34 workbench (build/venv-0.34.0) has none, and every
scheduler or connector test that builds a `VllmConfig` would fail there,
before it tests anything the series touches.

What it does. While `CpuPlatform.check_and_update_config` runs, and only
then, `vllm.triton_utils.HAS_TRITON` reads True; everywhere else it keeps what
vLLM found (False here: Triton is installed, with no CPU backend). The
`triton`/`tl` placeholders, the CPU worker's choice of model runner and every
other reader of HAS_TRITON see the truth.

No forward pass can run under it: there is still no triton-cpu to compile the
CPU model runner's kernels, and no CPU build of vLLM 0.34's compiled ops
(`vllm._C`). A test that starts an engine or runs a model fails as before;
the gate's baseline, recorded on unpatched 0.34.0 under this same switch,
leaves such tests out.

Where it is used. The 0.34 upstream gate passes `-p triton_switch` to its test
processes (scripts/workbench/ is on their PYTHONPATH); so does `python -m
workbench pytest --base 0.34.0` for the project's own tests (bases.py).
Nothing is installed into a venv. On a vLLM
whose config check does not refuse (0.32.0 only warns), it changes nothing.
Child processes (engine cores, `python -c` subprocesses) do not load it.
"""

from __future__ import annotations

import functools

# "on: ...", or "off: <why>"; shown in pytest's header.
STATE = "off: not configured"
# What vLLM 0.34's check raises: "vLLM on x86 CPUs requires Triton (triton-cpu)."
REFUSAL = "requires Triton"


def install() -> str:
    """Wrap CpuPlatform.check_and_update_config; return the state in words."""
    global STATE
    try:
        import vllm.triton_utils as triton_utils
        from vllm.platforms.cpu import CpuPlatform
    except ImportError as exc:
        STATE = f"off: vLLM's CPU platform does not import ({exc})"
        return STATE
    check = CpuPlatform.__dict__.get("check_and_update_config")
    func = getattr(check, "__func__", None)
    if func is None or getattr(func, "_kvcs_triton_switch", False):
        STATE = "on" if func is not None else "off: CpuPlatform has no check_and_update_config"
        return STATE
    # Only a config check that refuses to go on without Triton (vLLM 0.34) is
    # wrapped; 0.32.0's reads HAS_TRITON too, but only to log a warning.
    if not any(isinstance(c, str) and REFUSAL in c for c in func.__code__.co_consts):
        STATE = f"off: CpuPlatform.check_and_update_config does not raise {REFUSAL!r} (nothing to switch)"
        return STATE

    @functools.wraps(func)
    def check_and_update_config(cls, vllm_config):
        found = triton_utils.HAS_TRITON
        triton_utils.HAS_TRITON = True
        try:
            return func(cls, vllm_config)
        finally:
            triton_utils.HAS_TRITON = found

    check_and_update_config._kvcs_triton_switch = True
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    STATE = (f"on: CpuPlatform's config check sees Triton (HAS_TRITON is {triton_utils.HAS_TRITON} "
             "elsewhere); no forward pass can run")
    return STATE


def pytest_configure(config):
    install()


def pytest_report_header(config):
    return f"triton_switch: {STATE}"
