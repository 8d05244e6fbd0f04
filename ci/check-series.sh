#!/usr/bin/env bash
# Every prefix of the series applies to the pristine base, imports, and
# passes the tests its patch names; CHECK_SERIES_JOBS prefixes at a time
# (default 2, each in a worktree of its own; 1 checks them one by one).
set -euo pipefail
cd "$(dirname "$0")/../scripts"
unset PYTHONDONTWRITEBYTECODE  # Python writes bytecode on first import (Makefile)
exec ../.venv/bin/python -m workbench check-series --device "${VLLM_DEVICE:-cpu}" --jobs "${CHECK_SERIES_JOBS:-2}"
