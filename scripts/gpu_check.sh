#!/usr/bin/env bash
# The checks that need a GPU, as one short script: the Triton kernel's CUDA
# tests (bit-exact with the PyTorch path and the NumPy reference: attention
# KV in 8-byte pieces, Mamba state rows in 2- and 4-byte pieces, a state
# spanning two kernel chunks) and the CUDA benchmark (each path next to a
# device-to-device copy of the same bytes, in the same run); where numba
# imports on that machine, also the Numba pass's tests and its CPU benchmark
# (the host's CPU of a GPU box, with its vector flags), next to the CUDA
# figures.
#
# Runs where torch, triton and a CUDA device are, without vLLM: only the
# vLLM-free package (vllm_kvchecksum's definition, views, kernels, host copy)
# is used, so it is the same check for both bases (v0.32.0 and v0.34.0). What
# the worker hooks of vLLM 0.34's Model Runner V2 rest on beyond the kernels is
# the host copy, ordered after the stream current when the copy starts (not
# the one at init; the runner may switch): test_host_copy.py's CUDA test runs
# that on a busy non-default stream. The hooks themselves need vLLM on a GPU:
# `make demo-0.34` (docs/workbench.md, "GPU hosts").
# tests/install/test_gpu_demo_034.py checks that these files import no vLLM.
#
#   bash scripts/gpu_check.sh [OUT_DIR]        # default: $OUT, else build/gpu-check
#
# With the device tool (docs/performance.md, "GPU"): pytest is installed from
# wheels carried along when the machine lacks it. Here, once:
#   .venv/bin/python -m pip download -q pytest -d build/gpu-wheels
# then run, carrying build/gpu-wheels:
#   bash scripts/gpu_check.sh            (timeout_s 420: tests ~1 min, benchmarks ~3 min)
# OUT_DIR gets device.txt, tests.log, bench.log and bench.md (the tables, with
# the GPU name, to paste into docs/performance.md).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-build/gpu-check}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

"$py" - <<'EOF' 2>&1 | tee "$out/device.txt"
import torch
assert torch.cuda.is_available(), "no CUDA device: nothing to check here"
import triton
print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"triton {triton.__version__}")
EOF

if ! "$py" -c "import pytest" 2>/dev/null; then
    test -d build/gpu-wheels || { echo "pytest is missing and build/gpu-wheels was not carried" >&2; exit 2; }
    "$py" -m pip install -q --no-index --find-links build/gpu-wheels pytest
fi

status=0
# -p no:cacheprovider: the tree may be read-only; the rest of tests/ needs vLLM.
"$py" -m pytest -p no:cacheprovider -q -rs tests/unit/test_triton_kernel_cuda.py \
    tests/unit/test_state_pieces.py tests/unit/test_definition.py tests/unit/test_host_copy.py 2>&1 | tee "$out/tests.log" || status=1
sections=cuda
if "$py" -c "import numba" 2>/dev/null; then
    "$py" -m pytest -p no:cacheprovider -q -rs tests/unit/test_numba_path.py 2>&1 \
        | tee -a "$out/tests.log" || status=1
    sections=cuda,cpu
else
    echo "numba does not import here: no Numba pass figures" | tee -a "$out/tests.log"
fi
"$py" scripts/bench_checksum.py --only "$sections" --markdown "$out/bench.md" 2>&1 | tee "$out/bench.log" || status=1
exit $status
