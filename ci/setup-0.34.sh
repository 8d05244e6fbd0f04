#!/usr/bin/env bash
# Build build/venv-0.34.0: the vLLM 0.34.0 workbench, from the package index
# alone (docs/workbench.md, "The vLLM 0.34.0 base"). It runs vLLM 0.34's
# scheduler and connector tests on the CPU, not its engine: there is no
# triton-cpu on the index and no CPU build of vLLM 0.34's compiled ops.
#
#   1. requirements/cpu-0.34.txt, every package pinned (torch 2.14.1 and
#      torchvision 0.29.1 come from this machine's disk, no download);
#   2. vllm==0.34.0 with --no-deps: its wheel requires flashinfer-python==0.7.3
#      and torch==2.14.0, neither installable here; the tests import vLLM from
#      the source tree they run in (PYTHONPATH), the wheel gives the dist
#      metadata and the `vllm` that `python -c 'import vllm'` finds;
#   3. this project's package, editable, without dependencies.
#
# Never touches .venv. Two stamps in the venv: one of requirements/cpu-0.34.txt
# and the vLLM version (when it changes, the venv is rebuilt from scratch), one
# of pyproject.toml and setup.py (when only that changes, only this project is
# reinstalled: seconds, not minutes). FORCE=1 rebuilds from scratch. Prints the
# time of each stage.
#
#   ci/setup-0.34.sh           build, or say it is current
#   ci/setup-0.34.sh --check   exit 0 if current, 1 if not (builds nothing)
#
# VENV_034 puts the venv elsewhere (the workbench's tests); the script deletes
# only a folder that is a virtualenv (pyvenv.cfg) or empty.
set -euo pipefail
cd "$(dirname "$0")/.."
unset PYTHONDONTWRITEBYTECODE  # Python writes bytecode on first import (Makefile)
VLLM_VERSION=0.34.0
VENV=${VENV_034:-build/venv-$VLLM_VERSION}
PYTHON=${PYTHON:-python3}
REQS=requirements/cpu-0.34.txt
stamp=$VENV/.kvcs-requirements-$VLLM_VERSION
project_stamp=$VENV/.kvcs-project
case "${1:-}" in ""|--check) ;; *) echo "usage: $0 [--check]" >&2; exit 2;; esac

want=$( { echo "vllm==$VLLM_VERSION"; cat "$REQS"; } | sha256sum | cut -d' ' -f1)
want_project=$(cat pyproject.toml setup.py | sha256sum | cut -d' ' -f1)
if [ ! -x "$VENV/bin/python" ]; then why="no $VENV/bin/python"
elif [ ! -f "$stamp" ]; then why="no stamp $stamp"
elif [ "$(cat "$stamp")" != "$want" ]; then why="$REQS or the vLLM version changed since $stamp"
else why=""; fi
project_why=""
if [ -z "$why" ] && { [ ! -f "$project_stamp" ] || [ "$(cat "$project_stamp")" != "$want_project" ]; }; then
  project_why="pyproject.toml or setup.py changed since $project_stamp"
fi
if [ "${1:-}" = --check ]; then
  if [ -z "$why$project_why" ]; then echo "[setup-0.34] $VENV is current"; exit 0; fi
  echo "[setup-0.34] $VENV is not current: ${why:-$project_why}"; exit 1
fi
if [ -z "${FORCE:-}" ] && [ -z "$why" ]; then
  if [ -n "$project_why" ]; then
    echo "[setup-0.34] reinstalling this project into $VENV: $project_why"
    "$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | { grep -v "is ignored: it is neither" || true; }
    echo "$want_project" > "$project_stamp"
  fi
  echo "[setup-0.34] $VENV is current with $REQS and vllm==$VLLM_VERSION"
  exit 0
fi
if [ -e "$VENV" ] && [ ! -f "$VENV/pyvenv.cfg" ] && [ -n "$(ls -A "$VENV")" ]; then
  echo "[setup-0.34] refusing to replace $VENV: it is not a virtualenv (no pyvenv.cfg) and not empty;" \
       "move it away or point VENV_034 elsewhere" >&2
  exit 2
fi
echo "[setup-0.34] building $VENV: ${why:-FORCE=1}"

# Mooncake's transfer engine links libibverbs even for TCP (as ci/setup.sh).
if ! ldconfig -p | grep -q 'libibverbs.so.1 '; then
  if [ "$(id -u)" = 0 ]; then
    echo "[setup-0.34] installing libibverbs1 and librdmacm1 (Debian) for Mooncake"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 librdmacm1 >/dev/null
  else
    echo "[setup-0.34] not root: install libibverbs1 and librdmacm1 yourself for the Mooncake tests" >&2
  fi
fi

start=$(date +%s)
stage() {  # stage NAME COMMAND...: run it, then say how long it took
  local name=$1 t0
  shift
  t0=$(date +%s)
  echo "[setup-0.34] $name"
  if ! "$@" 2>&1 | { grep -v "is ignored: it is neither" || true; }; then
    echo "[setup-0.34] failed: $name" >&2
    exit 1
  fi
  echo "[setup-0.34] $name took $(( $(date +%s) - t0 )) s"
}

# A venv from an older stamp (or FORCE) is built anew: pins may have gone down.
if [ -e "$VENV" ]; then rm -rf "$VENV"; fi
mkdir -p "$(dirname "$VENV")"
stage "creating $VENV" "$PYTHON" -m venv "$VENV"
py=$VENV/bin/python
stage "pip 25.3" "$py" -m pip install -q --upgrade pip==25.3
stage "installing $REQS" "$py" -m pip install -q -r "$REQS"
stage "installing vllm==$VLLM_VERSION (no dependencies)" "$py" -m pip install -q --no-deps "vllm==$VLLM_VERSION"
stage "installing this project (editable, no dependencies)" \
  "$py" -m pip install -q --no-deps --no-build-isolation -e .
# Fail here, not in the tests: the venv's own vLLM imports as the CPU platform.
stage "checking the imports" env VLLM_TARGET_DEVICE=cpu "$py" -c "
import importlib.metadata as md, torch, numba, nixl, pytest, vllm_kvchecksum
from vllm.platforms import current_platform
assert md.version('vllm') == '$VLLM_VERSION', md.version('vllm')
assert current_platform.is_cpu(), current_platform
print('vllm', md.version('vllm'), 'torch', torch.__version__, 'platform', type(current_platform).__name__)
"
echo "$want" > "$stamp"
echo "$want_project" > "$project_stamp"
echo "[setup-0.34] $VENV built in $(( $(date +%s) - start )) s ($(du -sh "$VENV" | cut -f1))"
