#!/usr/bin/env bash
# Report how the series applies to another vLLM release (default 0.34.0).
# Informational: conflicts do not fail it; the report goes to build/.
set -euo pipefail
cd "$(dirname "$0")/../scripts"
exec ../.venv/bin/python -m workbench rebase-check "${1:-${VLLM_VERSION:-0.34.0}}"
