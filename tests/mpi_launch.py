"""What the multi-worker tests share: the mpiexec beside this Python (the mpich of the `mpi`
extra) and a skip marker for where it is missing. Every launch sets its own hard timeout."""

import importlib.util
import os
import shutil
import sys

import pytest

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi")   # tests/mpi/

MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
if not os.path.exists(MPIEXEC):
    MPIEXEC = shutil.which("mpiexec")
needs_mpi = pytest.mark.skipif(
    importlib.util.find_spec("mpi4py") is None or MPIEXEC is None,
    reason="the mpi extra (mpi4py and mpich) is not installed: pip install 'graphdist[mpi]'")
