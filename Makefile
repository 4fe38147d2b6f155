# One command to train (`make run`), one to test (`make test`); both create .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: run test bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

run: $(VENV)/.installed
	$(BIN)/diloco run examples/quickstart.yaml --out runs/quickstart

test: $(VENV)/.installed
	bash scripts/system-deps.sh
	$(BIN)/pytest

bench: $(VENV)/.installed
	bash bench/run_all.sh

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
