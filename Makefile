# vllm-kvchecksum: the patch series against vLLM v0.32.0 (carried on v0.34.0) and its workbench.
# `make help` lists the targets; docs/workbench.md explains each.

VLLM_DEVICE ?= cpu
VLLM_VERSION ?= 0.34.0
VLLM_GIT ?=
VLLM_REF ?= main
VLLM_SRC ?=
MODEL ?=
DEMO_ARGS ?=
SOAK_ARGS ?=
BASE ?=
PY := .venv/bin/python
# Python writes bytecode (__pycache__) on first import, so later processes read it instead of
# compiling again: setup installs without bytecode (ci/setup.sh), and an environment that sets
# PYTHONDONTWRITEBYTECODE (this workplace's does) would otherwise make every process compile
# torch, transformers and vLLM from source: about 9 s of CPU more per process importing vLLM,
# over the several hundred processes of make test and check-series (docs/workbench.md, CI time).
unexport PYTHONDONTWRITEBYTECODE
WORKBENCH := cd scripts && ../$(PY) -m workbench

.PHONY: help demo soak rollback setup setup-0.34 test test-0.34 test-unit test-e2e test-upstream test-upstream-0.34 apply unapply wheels refresh check-series check-series-0.34 in-step rebase-check bench clean

help: ## list the targets
	@grep -E '^[a-z0-9.-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | expand -t 16

setup: ## build .venv: vLLM v0.32.0 + series in build/vllm, importable (VLLM_DEVICE=cpu|cuda)
	VLLM_DEVICE=$(VLLM_DEVICE) FORCE=$(FORCE) ci/setup.sh

setup-0.34: setup ## build/venv-0.34.0 (vLLM 0.34.0 from the package index) and build/vllm-0.34.0 (0.34 + patches/v0.34.0); no engine
	ci/setup-0.34.sh
	@$(WORKBENCH) prepare --base 0.34.0

demo: setup ## real P/D servers catching injected KV faults: table + build/demo/report.json (DEMO_ARGS=--help)
	PYTHONPATH=scripts $(PY) -m kvcs_demo --device $(VLLM_DEVICE) $(if $(MODEL),--model $(MODEL)) $(DEMO_ARGS)

.PHONY: demo-0.34
demo-0.34: ## vLLM 0.34.0 on a GPU host: a venv with its CUDA wheel, the series applied in place, the demo on it (MODEL=DIR; GPU_PYTHON=, DRY_RUN=1)
	python3 scripts/gpu_demo_034.py $(if $(GPU_PYTHON),--python "$(GPU_PYTHON)") $(if $(filter command line environment,$(origin VLLM_DEVICE)),--device $(VLLM_DEVICE)) $(if $(DRY_RUN),--dry-run) -- $(if $(MODEL),--model $(MODEL)) $(DEMO_ARGS)

soak: setup ## real P/D servers under load and the lease race, judged by ground truth: build/soak/report.json (SOAK_ARGS=--help)
	PYTHONPATH=scripts $(PY) -m kvcs_soak --device $(VLLM_DEVICE) $(if $(MODEL),--model-path $(MODEL)) $(SOAK_ARGS)

rollback: setup ## real servers: a bad block recomputed from itself, and kept out of the prefix cache: build/rollback/report.json
	PYTHONPATH=scripts $(PY) -m kvcs_demo.rollback $(ROLLBACK_ARGS)

test: setup ## every test: package, workbench, integration, e2e demo, upstream gate
	ci/test.sh

test-unit: setup ## the project's own tests, without the e2e demo (tests/)
	$(PY) -m pytest -p no:cacheprovider -q -n 2 -m "not e2e" tests

test-e2e: setup ## the end-to-end test alone: a short make demo on real servers
	$(PY) -m pytest -p no:cacheprovider -q -s -m e2e tests/e2e

test-upstream: setup ## the upstream regression gate alone
	$(WORKBENCH) upstream --jobs 2

test-0.34: setup-0.34 ## the series on vLLM 0.34.0: the project's unit and integration tests there (no engine); GATE=1 adds its upstream gate
	ci/test-0.34.sh $(if $(GATE),--gate)

test-upstream-0.34: setup-0.34 ## the upstream gate on vLLM 0.34.0, on VLLM_TREE (default build/vllm-0.34.0)
	$(WORKBENCH) upstream --base 0.34.0 --jobs 2 --tree "$(abspath $(or $(VLLM_TREE),build/vllm-0.34.0))"

apply: ## apply the series to a vLLM source tree VLLM_SRC (v0.32.0 git checkout or sdist; pip installs: vllm-kvchecksum apply)
	@test -n "$(VLLM_SRC)" || { echo "usage: make apply VLLM_SRC=/path/to/vllm-0.32.0" >&2; exit 2; }
	@$(WORKBENCH) apply "$(abspath $(VLLM_SRC))"

unapply: ## remove the series from the source tree VLLM_SRC (pip installs: vllm-kvchecksum undo)
	@test -n "$(VLLM_SRC)" || { echo "usage: make unapply VLLM_SRC=/path/to/vllm-0.32.0" >&2; exit 2; }
	@$(WORKBENCH) unapply "$(abspath $(VLLM_SRC))"

# Needs no .venv: any python3 with pip (setuptools>=78 there skips the isolated build).
WHEELS_PY := $(if $(wildcard $(PY)),$(PY),python3)

wheels: ## build/wheels/: the helper's wheel + the release wheel patched (VLLM_DEVICE=cpu|cuda; docs/install.md)
	$(WHEELS_PY) scripts/build_wheels.py --device $(VLLM_DEVICE) --out build/wheels

refresh: ## rewrite patches/ from the commits on top of the base in build/vllm (BASE=0.34.0: patches/v0.34.0 from build/vllm-0.34.0)
	@$(WORKBENCH) refresh $(if $(BASE),--base $(BASE))

in-step: ## the series on v0.34.0 is in step with v0.32.0 (patches/v0.34.0/from-v0.32.0.txt; RECORD=1 records after a port)
	@$(WORKBENCH) in-step $(if $(RECORD),--record)

check-series: setup ## every prefix of the series applies, imports, passes its tests
	ci/check-series.sh

check-series-0.34: setup-0.34 ## the same for the series on vLLM 0.34.0 (patches/v0.34.0), without the engine tests
	@$(WORKBENCH) check-series --base 0.34.0 --jobs $${CHECK_SERIES_JOBS:-2}

rebase-check: setup ## report how the series applies to VLLM_VERSION (default 0.34.0), or VLLM_REF of VLLM_GIT
	VLLM_GIT="$(VLLM_GIT)" VLLM_REF="$(VLLM_REF)" ci/rebase-check.sh $(VLLM_VERSION)

bench: setup ## checksum benchmarks (figures in docs/performance.md)
	$(PY) scripts/bench_checksum.py

clean: ## remove build/ (downloads included) and .venv
	rm -rf build .venv
