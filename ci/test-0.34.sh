#!/usr/bin/env bash
# The series on vLLM 0.34.0, where no engine runs (docs/workbench.md, "Two
# bases"): the project's unit and integration tests against the patched 0.34
# tree (build/vllm-0.34.0) with build/venv-0.34.0 and the Triton switch.
# Tests marked e2e or cpu_runtime need vLLM's CPU runtime: they run on v0.32.0.
# With --gate, then vLLM 0.34's own tests of the files the series touches
# (the upstream gate; make test-upstream-0.34 runs it alone).
# Exits non-zero on any failure, and on a pytest run that collected no test.
set -euo pipefail
cd "$(dirname "$0")/.."
unset PYTHONDONTWRITEBYTECODE  # Python writes bytecode on first import (Makefile)
start=$(date +%s)
status=0
echo "== project tests on vLLM 0.34.0 (tests/unit, tests/integration; not e2e or cpu_runtime) =="
# The tree, venv, PYTHONPATH and Triton switch of the base: scripts/workbench/bases.py.
(cd scripts && ../.venv/bin/python -m workbench pytest --base 0.34.0 -- \
  -p no:cacheprovider -q -n 2 -m "not e2e" tests/unit tests/integration) || status=$?
if [ "$status" = 5 ]; then echo "pytest collected no tests: that is a failure" >&2; fi
echo "project tests on 0.34.0 took $(( $(date +%s) - start )) s"
if [ "${1:-}" = --gate ]; then
  echo "== upstream regression gate on vLLM 0.34.0 =="
  (cd scripts && ../.venv/bin/python -m workbench upstream --base 0.34.0 --jobs 2) \
    || status=$((status ? status : 1))
fi
echo "make test-0.34 took $(( $(date +%s) - start )) s"
exit "$status"
