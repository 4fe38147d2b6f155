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

# The syncer image's install, exactly (`pip install '.[cloud]'`, no `learner` extra: no JAX): the slim lane runs
# the syncer, the operator and the base commands in it (tests/system/test_slim.py). Rebuilt when the
# package changes, since a non-editable install holds a copy.
SLIM := .venv-slim
$(SLIM)/.installed: pyproject.toml $(shell find diloco syncer operator apps -name '*.py' -o -name '*.proto')
	test -d $(SLIM) || $(PYTHON) -P -m venv $(SLIM)
	$(SLIM)/bin/python -P -m pip install --quiet --upgrade pip
	$(SLIM)/bin/python -P -m pip install --quiet '.[cloud]'
	rm -rf build
	touch $@

run: $(VENV)/.installed
	$(BIN)/diloco run examples/quickstart.yaml --out runs/quickstart

lint: $(VENV)/.installed
	$(BIN)/ruff check .
	bash scripts/typecheck.sh
	bash scripts/imports.sh

check: lint
	$(BIN)/pytest -m "not e2e and not slow"

# The realapi lane needs a Kubernetes 1.20 control plane: built from Debian's sources on first
# use (about 8 minutes), cached under ~/.cache/decoupled-diloco after.
test: lint $(SLIM)/.installed
	bash scripts/system-deps.sh
	bash scripts/control-plane.sh build
	$(BIN)/pytest

bench: $(VENV)/.installed
	bash bench/run_all.sh

clean:
	rm -rf $(VENV) $(SLIM) runs .pytest_cache .hypothesis

# The real images: builds the base (debootstrap), both Dockerfiles (buildah) and trains a tiny job
# in podman containers, as the operator runs them (docs/IMAGES.md). Root; minutes on first build.
.PHONY: test-images
test-images: $(VENV)/.installed
	DILOCO_TEST_IMAGES=1 $(BIN)/pytest -m images -s tests/system/test_images.py

# A real node: the kubelet and kube-proxy from the control plane's tree, Debian's containerd and
# runc, the images of test-images inside it; the chart and a sized-down examples/k8s-cpu-kind.yaml
# run there end to end (docs/DEVELOPMENT.md, "A real node"). Root; the first run builds for minutes.
.PHONY: test-cluster
test-cluster: $(VENV)/.installed
	DILOCO_TEST_CLUSTER=1 $(BIN)/pytest -m cluster -s tests/cluster/test_cluster.py
