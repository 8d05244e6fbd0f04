#!/usr/bin/env bash
# Report how the series applies to another vLLM release (default 0.34.0), or,
# with VLLM_GIT set, to the ref VLLM_REF (default main) of that git repository.
# Informational: conflicts do not fail it; the report goes to build/.
set -euo pipefail
if [ -n "${VLLM_GIT:-}" ]; then
    src="$VLLM_GIT"
    # A local path is relative to where make ran; the command runs in scripts/.
    if [ -e "$src" ]; then src="$(cd "$src" && pwd)"; fi
    cd "$(dirname "$0")/../scripts"
    exec ../.venv/bin/python -m workbench rebase-check --git "$src" --ref "${VLLM_REF:-main}"
fi
cd "$(dirname "$0")/../scripts"
exec ../.venv/bin/python -m workbench rebase-check "${1:-${VLLM_VERSION:-0.34.0}}"
