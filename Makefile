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
# PyTorch's CPU wheel (2.13.0+cpu; PyPI's Linux wheel bundles CUDA) is installed first, alone,
# with its index as an extra index. Where that index cannot be reached pip only warns and
# takes torch 2.13.0 from the other indexes and find-links (PyPI's CUDA build, or a local
# +cpu wheel): --retries 0 --timeout 15 keep that to seconds. (Named in
# bench/requirements.txt, an unreachable index cost ~8 s of retries for every package: 6 min
# 44 s to resolve the file, 11 s now; pip never fails on it.)
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_PIN := torch==2.13.0

$(BENCH_BIN)/python:
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_BIN)/python -m pip install -q --upgrade pip

$(BENCH_VENV)/.installed: $(BENCH_BIN)/python bench/requirements.txt pyproject.toml
	$(BENCH_BIN)/python -m pip install -q --no-deps --retries 0 --timeout 15 \
		--extra-index-url $(TORCH_INDEX) "$(TORCH_PIN)"
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
