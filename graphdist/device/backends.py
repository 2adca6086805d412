"""Device backends: the array module (numpy or CuPy) and buffer moves of a device.

CuPy is imported only when a gpu:N device is used, so `import graphdist` needs no CUDA.
A host backend has no streams: its `enter`, `record` and `wait` are never called (the
lowering asks `ordered` first). The base class and the host's helpers are in host.py.
"""

from __future__ import annotations

from graphdist.device.host import Backend, host_value, is_device_array  # noqa: F401

CPU = Backend()


def backend_for(device: str) -> Backend:
    if device.startswith("cpu"):
        return CPU
    from graphdist.device.gpu import gpu_backend  # lazily: imports cupy

    return gpu_backend(device)
