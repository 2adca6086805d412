"""With GRAPHDIST_FAKE_CUPY=N set (tests/device/test_gpu_sim.py does), `import cupy` gives the
numpy-backed stand-in of tests/gpu/fake_cupy.py with N physical GPUs; otherwise the real
CuPy is used, and these tests skip where there is no GPU."""

import os
import sys

if os.environ.get("GRAPHDIST_FAKE_CUPY"):
    sys.path.insert(0, os.path.dirname(__file__))
    import fake_cupy

    fake_cupy.install()


import pytest  # noqa: E402

from graphdist import config  # noqa: E402


@pytest.fixture
def logical_gpus():
    """Four logical GPUs over whatever physical ones there are (round robin); the logical
    device counts and the overlap setting as they were after."""
    before = dict(config._state["logical_devices"])
    config.set_logical_device_count("gpu", 4)
    yield [f"gpu:{i}" for i in range(4)]
    config._state["logical_devices"].clear()
    config._state["logical_devices"].update(before)
    config.set_overlap(True)
