#!/bin/sh
# What a machine with a GPU runs: the GPU tests on the real CuPy and the GPU benchmarks.
# Needs python3 with numpy, numba (+ numba-cuda), networkx, threadpoolctl, pytest and
# CuPy; writes the benchmark's JSON into $OUT when that is set (else bench/results/runs/).
#     sh tools/gpu_check.sh
# GPU_PARTS picks parts (default "tests bench overlap profile"); GPU_*_LIMIT their seconds.
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
set +e
# Each part runs even when the one before failed, under its own time limit, so one
# unattended run reports all of them; the exit status says whether any failed.
nvidia-smi -L 2>/dev/null
$PY -c "import numpy, numba, cupy; print('numpy', numpy.__version__, 'numba', numba.__version__, 'cupy', cupy.__version__)"
$PY -c "import graphdist as gd; print('devices:', gd.devices())"; status=$?
PARTS=${GPU_PARTS:-tests bench overlap profile}
part() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }
# every GPU test: the backend, the kernels, check_numerics, and the overlapped program
# (tests/gpu/test_overlap_gpu.py: NCCL on the communication streams, bits on = off)
if part tests; then
  timeout ${GPU_TEST_LIMIT:-300} $PY -m pytest -q -p no:cacheprovider -rs -m gpu tests/gpu || status=1
fi
if [ -n "$OUT" ]; then export BENCH_OUT="$OUT"; fi
if part bench; then timeout ${GPU_BENCH_LIMIT:-200} $PY -m bench.gpu || status=1; fi
# exposed communication with overlap on and off, 4 logical GPUs, the benchmark MLP
if part overlap; then
  timeout ${GPU_OVERLAP_LIMIT:-150} $PY -m bench.overlap --gpu --models mlp --steps 10 \
    --profile-steps 3 || status=1
fi
# where the steps' time goes: host dispatch against the GPU, the host's profile
if part profile; then
  timeout ${GPU_PROFILE_LIMIT:-150} $PY -W ignore tools/gpu_profile.py || status=1
fi
echo "gpu_check: exit $status"
exit $status
