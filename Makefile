# The README's commands. Each does its own set-up from a fresh clone.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: setup train test lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

## The main job: a short tp=2 training run on 2 local ranks.
train: $(STAMP)
	$(BIN)/oases train $(ARGS)

## The test suite (and lint).
test: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info runs
	find src -name '*.nbi' -o -name '*.nbc' | xargs rm -f  # numba's disk cache (planner/jit.py)
