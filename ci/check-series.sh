#!/usr/bin/env bash
# Every prefix of the series applies to the pristine base, imports, and
# passes the tests its patch names.
set -euo pipefail
cd "$(dirname "$0")/../scripts"
exec ../.venv/bin/python -m workbench check-series --device "${VLLM_DEVICE:-cpu}"
