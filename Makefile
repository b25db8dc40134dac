# The two commands a newcomer runs: `make quickstart` and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
# Files of the test extra's packages that only Python 3.12 can compile.
PY312_ONLY := torch/testing/_internal/py312_intrinsics\.py$$
# pip byte-compiles on one core (half an install's time); compileall on all
# of them. One torch test file is Python 3.12 syntax, which pip skips too;
# any other file that does not compile stops the install.
COMPILE := $(PY) -m compileall -qq -j 0 -x '$(PY312_ONLY)' $(VENV)/lib

.PHONY: quickstart test test-all bench lint format clean

# The venv is rebuilt whenever the package metadata changes. The quickstart
# needs the package alone; `make test` adds the test extra (torch,
# transformers, Beam, Jupyter) on top.
$(VENV)/.installed: setup.cfg pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found; set PYTHON=/path/to/python3.11" >&2; exit 1; }
	rm -f $(VENV)/.test-installed
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile -e .
	$(COMPILE)
	touch $@

$(VENV)/.test-installed: $(VENV)/.installed
	$(PY) -m pip install --quiet --no-compile -e ".[test]"
	$(COMPILE)
	touch $@

quickstart: $(VENV)/.installed
	$(PY) -m pretrain_lm.main --config=configs/bert.py:size=tiny --workdir=workdirs/quickstart

# Two tiers, both run: the unit tier (functions and modules, a few minutes)
# and the integration tier (whole runs: presets trained, resume, multi-host,
# faults, launchers, notebooks; tests/conftest.py lists its files), sharing
# one compilation cache. Two workers: the suite is mostly XLA compiles,
# which use one core each. Each tier ends with its slowest tests.
TIER = $(PY) -m pytest -q -n 2 --durations=15 -m
test: $(VENV)/.test-installed
	@cache=$$(mktemp -d) && trap 'rm -rf "$$cache"' EXIT && \
	export JAX_COMPILATION_CACHE_DIR="$$cache" && \
	echo '== unit tier ==' && $(TIER) 'not integration and not slow' && \
	echo '== integration tier ==' && $(TIER) 'integration and not slow'

# Both tiers and the tests marked `slow`.
test-all: $(VENV)/.test-installed
	$(PY) -m pytest -q -n 2 -m ''

# The default benchmarks (a few minutes on a laptop CPU): BERT-small's train
# step, its input pipeline, and GPT-2 small's decoding. Result tables, peer
# comparisons and commands for every model: experiments/benchmarks.
BENCH := $(PY) -m pretrain_lm.bench
bench: $(VENV)/.installed
	$(BENCH) --config=configs/bert.py:size=small
	$(BENCH) --config=configs/bert.py:size=small --what=pipeline
	$(BENCH) --config=configs/gpt.py:size=small --what=decode --repeats=1

lint: $(VENV)/.test-installed
	$(VENV)/bin/ruff check pretrain_lm configs tests experiments
	$(VENV)/bin/ruff format --check pretrain_lm configs tests experiments

format: $(VENV)/.test-installed
	$(VENV)/bin/ruff format pretrain_lm configs tests experiments
	$(VENV)/bin/ruff check --fix pretrain_lm configs tests experiments

clean:
	rm -rf $(VENV) workdirs
