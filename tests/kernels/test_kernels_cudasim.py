"""The CUDA kernels without a GPU: tests/gpu/test_kernels_gpu.py under Numba's CUDA simulator,
and every kernel compiled to PTX by NVVM (the real CUDA typing and codegen) where NVVM exists.

The simulator flag is read when numba is first imported, so those tests run in a child process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import numba
import pytest
from numba import cuda
from numba import types as nt

ROOT = Path(__file__).resolve().parents[2]


def test_cuda_kernels_under_the_simulator():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    args = ["-q", "-p", "no:cacheprovider", "-rs", "-m", "gpu", "tests/gpu/test_kernels_gpu.py"]
    cmd = [sys.executable, "-m", "pytest", *args]
    proc = subprocess.run(
        cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "passed" in summary and "skipped" not in summary, summary


def _nvvm_available():
    if numba.config.ENABLE_CUDASIM:
        return False
    try:
        from numba.cuda.cudadrv import nvvm

        return nvvm.is_available()
    except (ImportError, OSError, RuntimeError):  # no CUDA toolkit at all
        return False


@pytest.mark.skipif(not _nvvm_available(), reason="needs NVVM (a CUDA toolkit)")
def test_cuda_kernels_compile_to_ptx(monkeypatch):
    if cuda.is_available():
        pytest.skip("a GPU is present: tests/gpu runs the kernels themselves")
    from graphdist.kernels import adam, reduce, sgd

    # device functions ask the driver for the current device's compute capability; pretend one
    monkeypatch.setattr(
        numba.cuda.dispatcher,
        "get_current_device",
        lambda: types.SimpleNamespace(compute_capability=(8, 0)),
    )
    h = nt.float64[::1]                     # the hyper-parameter vector
    for f, a in [(nt.float32, nt.float32[::1]), (nt.float64, nt.float64[::1])]:
        kernels = [
            (sgd._sgd_kernel, (a, a, a, h, nt.boolean)),
            (adam._adam_kernel, (a, a, a, a, h)),
            (reduce._scale_kernel, (a, nt.float64, nt.float64[::1])),
            # the multi-tensor kernels: (addresses, chunks, like, ...), common.gpu_tables
            (reduce._all_reduce_kernel, (nt.uint64[:, ::1], nt.int64[:, ::1], a, nt.int64, f,
                                         nt.boolean)),
            (adam._adam_multi_kernel, (nt.uint64[:, ::1], nt.int64[:, ::1], a, h)),
            (sgd._sgd_multi_kernel, (nt.uint64[:, ::1], nt.int64[:, ::1], a, h, nt.boolean)),
        ]
        for kernel, signature in kernels:
            ptx, _ = cuda.compile_ptx(kernel.py_func, signature, cc=(8, 0))
            assert ".entry" in ptx, kernel.py_func.__name__
            if kernel.py_func.__name__.startswith(("_sgd", "_adam")) and f == nt.float32:
                # the float64 hyper-parameters are rounded to float32 (round to nearest, as
                # numpy's float32(x) on the host), and the update itself runs in float32
                assert "cvt.rn.f32.f64" in ptx and "fma.rn.f64" not in ptx, kernel.py_func
