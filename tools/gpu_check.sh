#!/bin/sh
# What a machine with a GPU runs: the GPU tests on the real CuPy and the GPU benchmarks.
# Needs python3 with numpy, numba (+ numba-cuda), networkx, threadpoolctl, pytest and
# CuPy; copies the benchmark's JSON to $OUT when that is set.
#     sh tools/gpu_check.sh
set -e
PY=${PYTHON:-python3}
$PY -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
$PY -c "import graphdist as gd; print('devices:', gd.devices())"
$PY -m pytest -q -p no:cacheprovider -rs -m gpu tests/gpu
$PY -m bench.gpu
[ -n "$OUT" ] && cp bench/results/gpu*.json "$OUT"/ || true
