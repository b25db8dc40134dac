# The two commands a newcomer runs: `make quickstart` and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
# Quiet TensorFlow's C++ start-up banner.
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: quickstart test test-all lint format clean

# The venv is rebuilt whenever the package metadata changes.
$(VENV)/.installed: setup.cfg pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found; set PYTHON=/path/to/python3.11" >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

quickstart: $(VENV)/.installed
	$(PY) -m pretrain_lm.main --config=configs/bert.py:size=tiny --workdir=workdirs/quickstart

# Two workers: the suite is mostly XLA compiles, which use one core each.
test: $(VENV)/.installed
	$(PY) -m pytest -q -n 2

# Includes tests marked `slow`.
test-all: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 -m ''

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check pretrain_lm configs tests
	$(VENV)/bin/ruff format --check pretrain_lm configs tests

format: $(VENV)/.installed
	$(VENV)/bin/ruff format pretrain_lm configs tests
	$(VENV)/bin/ruff check --fix pretrain_lm configs tests

clean:
	rm -rf $(VENV) workdirs
