#!/usr/bin/env bash
# Every test of the project: the helper package's unit tests, the workbench's
# and the integration tests on the patched vLLM, the end-to-end demo test on
# real servers, then the upstream gate.
# Exits non-zero on any failure, and on a pytest run that collected no test.
set -euo pipefail
cd "$(dirname "$0")/.."
unset PYTHONDONTWRITEBYTECODE  # Python writes bytecode on first import (Makefile)
start=$(date +%s)
status=0
echo "== project tests (tests/, without e2e) =="
.venv/bin/python -m pytest -p no:cacheprovider -q -n 2 -m "not e2e" tests || status=$?
if [ "$status" = 5 ]; then echo "pytest collected no tests: that is a failure" >&2; fi
echo "== end to end: a short make demo on real servers (tests/e2e) =="
e2e_start=$(date +%s)
e2e=0
.venv/bin/python -m pytest -p no:cacheprovider -q -s -m e2e tests/e2e || e2e=$?
echo "e2e took $(( $(date +%s) - e2e_start )) s"
status=$((status ? status : e2e))
echo "== upstream regression gate =="
(cd scripts && ../.venv/bin/python -m workbench upstream --jobs 2) || status=$((status ? status : 1))
echo "make test took $(( $(date +%s) - start )) s"
exit "$status"
