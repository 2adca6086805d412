# `make run` and `make test` work on a fresh machine with only Python 3.10+ and pip.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: run test bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q -e ".[test,mpi]"
	touch $@

run: $(VENV)/.installed
	$(BIN)/graphdist demo

test: $(VENV)/.installed-test
	$(BIN)/lint-imports --no-logo --no-cache
	$(BIN)/python -m pytest -q

bench: $(VENV)/.installed
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) build *.egg-info
