"""vLLM's CPU workers on a CPU with AMX hold the AMX tile state from start-up.

Linux runs AMX tile instructions only in a process that asked for them
(arch_prctl ARCH_REQ_XCOMP_PERM). oneDNN asks on its first bf16 matmul;
vLLM's CPU attention picks its "amx" ISA on such CPUs and never asks. A
P/D consumer without KV checksums decodes loaded KV as its first forward, no
bf16 matmul before the attention: its worker died of SIGILL ("Fatal Python
error: Illegal instruction" in cpu_attention_with_kv_cache), seen in the
demo's checksums-off TTFT baseline on a Sapphire Rapids machine. Checked
consumers survived only because the checksum worker's own torch ops had
asked first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# An engine or a CPU kernel of vLLM: the v0.32.0 base only (tests/conftest.py).
pytestmark = pytest.mark.cpu_runtime

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "build" / "tiny-llama"


@pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(), reason="this CPU has no AMX (torch.cpu._is_amx_tile_supported())")
def test_cpu_worker_may_run_amx_before_its_first_request(tmp_path):
    subprocess.run([sys.executable, "scripts/make_tiny_model.py", str(MODEL)], cwd=ROOT, check=True, timeout=600,
                   capture_output=True)
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1", VLLM_TARGET_DEVICE="cpu",
               HF_HOME=str(ROOT / "build" / "hf-home"), HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("cpu_amx_engine.py")), str(MODEL)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    answers = [ln for ln in proc.stdout.splitlines() if ln.startswith("ANSWER ")]
    assert proc.returncode == 0 and answers, (proc.stdout + proc.stderr)[-6000:]
    assert json.loads(answers[0][len("ANSWER "):]) == {"amx_permitted": [True]}
    # Granted, so the worker says nothing about AMX (its warning is for a refusal).
    assert "AMX tile state" not in proc.stdout + proc.stderr


def test_this_test_process_reads_the_permission_as_the_engine_does():
    # The probe itself: a fresh interpreter holds no AMX state; torch's
    # _init_amx asks for it (where the CPU has AMX).
    sys.path.insert(0, str(Path(__file__).parent))
    code = ("from cpu_amx_engine import amx_permitted; import torch; a = amx_permitted(); "
            "ok = torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx(); print(a, amx_permitted() == bool(ok))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parent)
    assert proc.stdout.split() == ["False", "True"], proc.stdout + proc.stderr
