"""The host backend: `Backend`, what the lowering and the variables need from a device, as
numpy in host memory does it; every other device's backend extends it (device/gpu.py).

It sits apart from backends.py, which finds a device's backend and so imports gpu.py (lazily),
so that gpu.py can build on it without an import circle.
"""

from __future__ import annotations

import contextlib
import sys

import numpy as np


class Backend:
    """What the lowering and the variables need from a device."""

    kind = "cpu"          # the key into runtime/kernel_table.py
    xp = np               # numpy or cupy
    ordered = False       # True: work is queued on a stream; cross-device reads need events

    def __init__(self, device: str = "cpu:0"):
        self.device = device

    def empty(self, shape, dtype):
        return self.xp.empty(shape, dtype=dtype)

    def from_host(self, value):
        """A new array on this device holding `value` (a numpy array or scalar)."""
        return np.array(host_value(value))

    def to_device(self, value):
        """A step argument on this device: copied, unless it already lies there."""
        return self.from_host(value)

    def to_host(self, array) -> np.ndarray:
        """A numpy array with the device array's value (the array itself on the host)."""
        return array

    def copy_in(self, dst, src) -> None:
        """Overwrite device array `dst` with host value `src` (same shape)."""
        np.copyto(dst, src)

    def current(self):
        """A context in which array calls run on this device (for work done at compile
        time; the compiled program switches devices itself)."""
        return contextlib.nullcontext()


    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device!r})"


def is_device_array(x) -> bool:
    """A GPU array: CuPy's, or any other with the CUDA array interface."""
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(x, cupy.ndarray):
        return True
    return not isinstance(x, np.ndarray) and hasattr(x, "__cuda_array_interface__")


def host_value(x):
    """x as a host value: device arrays are copied to the host, anything else is kept."""
    return x.get() if is_device_array(x) and hasattr(x, "get") else x
