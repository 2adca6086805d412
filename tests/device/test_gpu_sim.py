"""The GPU backend without a GPU: tests/gpu/test_backend_gpu.py on the numpy-backed CuPy
stand-in (tests/gpu/fake_cupy.py, which checks device placement and stream ordering) with
the CUDA kernels in numba's simulator, in a child process (both are set up at import).
Run once with 2 physical GPUs (NCCL between them) and once with 1 (logical GPUs only)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("physical", [1, 2])
def test_gpu_backend_on_the_simulated_gpu(physical):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", GRAPHDIST_FAKE_CUPY=str(physical))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "-m", "gpu",
           "tests/gpu/test_backend_gpu.py"]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "passed" in summary and "skipped" not in summary, summary


def test_the_stand_in_catches_unordered_streams_and_misplaced_arrays():
    """fake_cupy's checks fail when they should (what makes the runs above meaningful)."""
    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    import fake_cupy as cp

    with cp.cuda.Device(0):
        a_stream, b_stream = cp.cuda.Stream(), cp.cuda.Stream()
        with a_stream:
            x = cp.ones(4, "float32")
        with b_stream, pytest.raises(cp.StreamRace, match="read"):
            cp.add(x, 1)                                    # read before a wait: RAW
        with b_stream:
            b_stream.wait_event(a_stream.record())
            y = cp.add(x, 1)                                # ordered now
        with a_stream, pytest.raises(cp.StreamRace, match="write"):
            cp.multiply(x, 2, out=x)                        # overwrite under b's read: WAR
        with pytest.raises(TypeError, match="host array"):
            cp.add(y, np.ones(4, np.float32))
    with cp.cuda.Device(1):
        with pytest.raises(ValueError, match="device"):
            cp.add(y, 1)
        with pytest.raises(RuntimeError, match="invalid resource handle"):
            a_stream.record()                              # event of device 1, stream of 0


def test_the_gpu_benchmark_runs_on_the_simulated_gpu():
    """bench/gpu.py --quick end to end (what a GPU session runs in full)."""
    code = ("import sys; sys.path.insert(0, 'tests/gpu'); import fake_cupy; fake_cupy.install()\n"
            "from bench import gpu\n"
            "r = gpu.main(['--quick', '--no-save'])\n"
            "assert r['adam']['fused_nodes'] == 1, r\n"
            "assert r['adam']['graphdist fused Adam']['GB_per_s'] > 0\n")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", GRAPHDIST_FAKE_CUPY="1")
    proc = subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "graphdist fused Adam" in proc.stdout
