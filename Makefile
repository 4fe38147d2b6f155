# One command to train (`make run`), one to test (`make test`, what CI runs); `make check` is the
# fast inner loop (lint, types, every test that starts no process). All create .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: run test check lint bench clean

# `python -P`: never put the working directory (with its top-level operator/ folder) on sys.path.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -P -m venv $(VENV)
	$(BIN)/python -P -m pip install --quiet --upgrade pip
	$(BIN)/python -P -m pip install --quiet -e '.[dev]'
	touch $@

run: $(VENV)/.installed
	$(BIN)/diloco run examples/quickstart.yaml --out runs/quickstart

lint: $(VENV)/.installed
	$(BIN)/ruff check .
	bash scripts/typecheck.sh

check: lint
	$(BIN)/pytest -m "not e2e"

test: lint
	bash scripts/system-deps.sh
	$(BIN)/pytest

bench: $(VENV)/.installed
	bash bench/run_all.sh

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
