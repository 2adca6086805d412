# `make run` and `make test` work on a fresh machine with only Python 3.10+ and pip.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: run test bench bench-plots clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml setup.py
	$(BIN)/python -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: $(BIN)/python pyproject.toml setup.py
	$(BIN)/python -m pip install -q -e ".[test,mpi]"
	touch $@

run: $(VENV)/.installed
	$(BIN)/graphdist demo

# the wheel as users install it (tools/wheel_check.sh), the layering, then the suite
test: $(VENV)/.installed-test
	sh tools/wheel_check.sh $(BIN)/python
	$(BIN)/lint-imports --no-logo --no-cache
	$(BIN)/python -m pytest -q

# the benchmarks' own environment: graphdist (with MPI) beside the peers it is compared with
# (TensorFlow, JAX, PyTorch CPU builds) and matplotlib for the plots (bench/requirements.txt)
BENCH_VENV := .venv-bench
BENCH_BIN := $(BENCH_VENV)/bin

$(BENCH_BIN)/python:
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_BIN)/python -m pip install -q --upgrade pip

$(BENCH_VENV)/.installed: $(BENCH_BIN)/python bench/requirements.txt pyproject.toml
	$(BENCH_BIN)/python -m pip install -q -r bench/requirements.txt
	$(BENCH_BIN)/python -m pip install -q -e ".[mpi]"
	touch $@

bench: $(BENCH_VENV)/.installed
	$(BENCH_BIN)/graphdist bench --suite

# redraw docs/img/bench-*.png from the committed bench/results/*.json (no reruns)
bench-plots: $(BENCH_VENV)/.installed
	$(BENCH_BIN)/python -m bench.plots

clean:
	rm -rf $(VENV) build dist *.egg-info
