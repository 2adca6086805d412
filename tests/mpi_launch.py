"""What the multi-worker tests share: the mpiexec beside this Python (the mpich of the `mpi`
extra), a skip marker for where it is missing, and `two_workers`, which runs a script of
tests/mpi/ as 2 workers under either launcher with a hard timeout (a hang fails the test
instead of stalling the suite)."""

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi")   # tests/mpi/

MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
if not os.path.exists(MPIEXEC):
    MPIEXEC = shutil.which("mpiexec")
needs_mpi = pytest.mark.skipif(
    importlib.util.find_spec("mpi4py") is None or MPIEXEC is None,
    reason="the mpi extra (mpi4py and mpich) is not installed: pip install 'graphdist[mpi]'")

LAUNCHERS = ("mpiexec", "graphdist launch")


def two_workers(script: str, args: list, launcher: str, timeout: float = 60):
    """Run tests/mpi/`script` with `args` as 2 workers under `launcher` (one of LAUNCHERS);
    the finished process (output captured), after at most `timeout` seconds."""
    path = os.path.join(SCRIPTS, script)
    start = ([MPIEXEC, "-n", "2", sys.executable] if launcher == "mpiexec"
             else [sys.executable, "-m", "graphdist", "launch", "-n", "2"])
    return subprocess.run([*start, path, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
