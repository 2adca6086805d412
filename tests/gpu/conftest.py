"""With GRAPHDIST_FAKE_CUPY=N set (tests/device/test_gpu_sim.py does), `import cupy` gives the
numpy-backed stand-in of tests/gpu/fake_cupy.py with N physical GPUs; otherwise the real
CuPy is used, and these tests skip where there is no GPU."""

import os
import sys

if os.environ.get("GRAPHDIST_FAKE_CUPY"):
    sys.path.insert(0, os.path.dirname(__file__))
    import fake_cupy

    fake_cupy.install()
