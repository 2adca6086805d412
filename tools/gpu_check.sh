#!/bin/sh
# What a machine with a GPU runs: the GPU tests on the real CuPy and the GPU benchmarks.
# Needs python3 with numpy, numba (+ numba-cuda), networkx, threadpoolctl, pytest and
# CuPy; writes the benchmark's JSON into $OUT when that is set (else bench/results/runs/).
#     sh tools/gpu_check.sh
set -e
PY=${PYTHON:-python3}
# That machine has no network: an old setuptools there cannot build this pyproject.toml, so
# fall back to the package laid out as the wheel lays it, on PYTHONPATH.
if ! $PY -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1; then
  LAYOUT=$(mktemp -d)
  cp -r graphdist "$LAYOUT/graphdist"
  cp -r kernels "$LAYOUT/graphdist/kernels"
  cp -r examples "$LAYOUT/graphdist/examples"
  export PYTHONPATH="$LAYOUT:$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
  echo "gpu_check: editable install failed; running graphdist from $LAYOUT"
fi
$PY -c "import graphdist as gd; print('devices:', gd.devices())"
$PY -m pytest -q -p no:cacheprovider -rs -m gpu tests/gpu
if [ -n "$OUT" ]; then BENCH_OUT="$OUT" $PY -m bench.gpu; else $PY -m bench.gpu; fi
