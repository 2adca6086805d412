"""Thread and BLAS settings chosen at import (graphdist/device/threads.py)."""

from __future__ import annotations

import os
import subprocess
import sys

from graphdist.device import threads


def _env_after_import(env: dict) -> str:
    code = "import graphdist, os; print(os.environ.get('OPENBLAS_CORETYPE'), " \
           "os.environ.get('OMP_WAIT_POLICY'))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120, check=True)
    return done.stdout.split()


def test_avx512_kernels_chosen_only_when_unset_and_supported():
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE",
                                                             "OMP_WAIT_POLICY")}
    with open("/proc/cpuinfo") as f:
        flags = set(next((line for line in f if line.startswith("flags")), "").split())
    expected = "SkylakeX" if threads._AVX512 <= flags else "None"
    assert _env_after_import(env) == [expected, "passive"]
    env.update(OPENBLAS_CORETYPE="Haswell", OMP_WAIT_POLICY="active")   # explicit wins
    assert _env_after_import(env) == ["Haswell", "active"]


def test_share_of_cores_per_worker():
    assert threads.share(1) == threads.cores()
    assert threads.share(10 * threads.cores()) == 1


def test_workers_give_way_only_when_more_of_them_than_cores_share_the_host(monkeypatch):
    monkeypatch.setattr(threads, "_affinity_of", {})   # read once per process: read anew
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(threads, "_processes_per_host", [2])
    assert not threads.oversubscribed()          # 2 workers on 2 cores: spin
    monkeypatch.setattr(threads, "_processes_per_host", [4])
    assert threads.oversubscribed()              # 4 on 2: yield while waiting
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {1})
    threads._affinity_of.clear()                 # (a process pinned as it starts)
    assert not threads.oversubscribed()          # pinned apart by mpiexec: a core each


def test_devices_names_the_blas_kernels_and_says_when_avx2_is_pinned_on_avx512(monkeypatch):
    monkeypatch.setattr(threads, "_cpu_flags", lambda: set(threads._AVX512))
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")
    monkeypatch.setitem(threads.ENV_SET, "OPENBLAS_CORETYPE", None)
    text = threads.blas_kernels()
    assert "Haswell (set in the environment)" in text and "unset OPENBLAS_CORETYPE" in text
    monkeypatch.setattr(threads, "_cpu_flags", lambda: {"avx2"})     # no AVX-512: no hint
    assert "unset" not in threads.blas_kernels()
    monkeypatch.setenv("OPENBLAS_CORETYPE", "SkylakeX")
    monkeypatch.setitem(threads.ENV_SET, "OPENBLAS_CORETYPE", "SkylakeX")
    assert threads.blas_kernels() == "OPENBLAS_CORETYPE=SkylakeX (set by graphdist)"


def _timeout_after_import(env: dict) -> str:
    code = "import graphdist, os; print(os.environ.get('OPENBLAS_THREAD_TIMEOUT'))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120, check=True)
    return done.stdout.strip()


def test_openblas_workers_spin_across_back_to_back_gemms_unless_told_otherwise():
    # 2^14 TSC ticks (~6 us): awake between a layer's two gradient GEMMs, asleep before a
    # Numba kernel gets going; 4 (the minimum) woke a sleeping worker at every GEMM
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    assert _timeout_after_import(env) == "14"
    env["OPENBLAS_THREAD_TIMEOUT"] = "9"                                 # explicit wins
    assert _timeout_after_import(env) == "9"


def _timeout_after_numpy_then_graphdist(env: dict) -> list:
    code = ("import ctypes, numpy as np\n"
            "a = np.ones((300, 300)); a @ a                  # OpenBLAS's threads started\n"
            "import graphdist, os\n"
            "from graphdist.kernels.gemm import numpy_module_handle\n"
            "read = numpy_module_handle().openblas_thread_timeout\n"
            "read.restype = ctypes.c_int\n"
            "print(os.environ.get('OPENBLAS_THREAD_TIMEOUT'), read(), (a @ a)[0, 0])\n")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120, check=True)
    return done.stdout.split()


def test_numpy_imported_first_gets_the_timeout_too():
    # OpenBLAS already loaded: graphdist has it read its environment again and restart its
    # threads (the next GEMM starts them with the new timeout), and GEMMs go on working
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    assert _timeout_after_numpy_then_graphdist(env) == ["14", "14", "300.0"]
    env["OPENBLAS_THREAD_TIMEOUT"] = "9"                                 # explicit wins
    assert _timeout_after_numpy_then_graphdist(env) == ["9", "9", "300.0"]
