#!/usr/bin/env bash
# Every test of the project: the helper package's unit tests, the workbench's
# and the integration tests on the patched vLLM, then the upstream gate.
# Exits non-zero on any failure, and on a pytest run that collected no test.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
status=0
echo "== project tests (tests/) =="
.venv/bin/python -m pytest -p no:cacheprovider -q -n 2 tests || status=$?
if [ "$status" = 5 ]; then echo "pytest collected no tests: that is a failure" >&2; fi
echo "== upstream regression gate =="
(cd scripts && ../.venv/bin/python -m workbench upstream --jobs 2) || status=$((status ? status : 1))
echo "make test took $(( $(date +%s) - start )) s"
exit "$status"
