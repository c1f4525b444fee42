# The README's two set-up commands: `make demo` and `make test`. Both create .venv if missing.
# torch is installed first, pinned to the CPU build on disk (torch==2.13.0); the package's own
# range (torch>=2.4) then installs nothing more. See DEVELOPERS.md.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.grpokit-installed

.PHONY: demo test lint format bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --disable-pip-version-check "$(TORCH)"
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[dev]"
	touch $@

demo: $(STAMP)
	$(VENV)/bin/grpokit demo

test: lint
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks scripts
	$(VENV)/bin/ruff format --check src tests benchmarks scripts

format: $(STAMP)
	$(VENV)/bin/ruff format src tests benchmarks scripts
	$(VENV)/bin/ruff check --fix src tests benchmarks scripts

bench: $(STAMP)
	$(PY) benchmarks/bench_logprobs.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .ruff_cache
