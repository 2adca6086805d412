"""The host backend: `Backend`, what the compiler and the runtime need to know about a device
kind and what they need from one of its devices, as numpy in host memory does it; every
other backend extends it (device/gpu.py; a new kind is a subclass registered with
`device.backends.register_backend`).

A backend *declares* what its kind can do (`shares_host_memory`, `ordered`,
`merges_replicas`, `threads`, `accelerator`, `default_lowering`, `kernel_kind`, `nccl`):
the pipeline, the lowering, the strategies and the CLI ask these, never the kind's name.

It sits apart from backends.py, which holds the registry and imports gpu.py, so that gpu.py
can build on it without an import circle.
"""

from __future__ import annotations

import contextlib
import sys

import numpy as np

from graphdist import config

# the kernel kind of the Numba CPU kernels (runtime/kernel_table.py's `kind="cpu"` entries):
# any backend on numpy arrays in host memory can name it and reuse them
HOST_KERNELS = "cpu"


class Backend:
    """What the compiler and the runtime need from a device kind and its devices.

    The registry (device/backends.py) holds one Backend per kind; `for_device(name)` gives
    the one that runs a device (the same object for host kinds, one per stream otherwise).
    """

    kind = "cpu"                  # the device kind: its devices are named "kind:N"
    kernel_kind = HOST_KERNELS    # the key into runtime/kernel_table.py's entries
    xp = np                       # the array module: numpy or cupy
    shares_host_memory = True     # arrays live in host memory: host kernels may read them all
    ordered = False               # work is queued on a stream; cross-device reads need events
    merges_replicas = True        # replicas may run as one batched program ("merged" mode)
    threads = True                # each device may run its program in its own host thread
    accelerator = False           # MirroredStrategy() with no devices takes all of this kind
    nccl = False                  # its devices can join an NCCL communicator
    default_lowering = "host"     # the cross-device ops' lowering for devices of this kind only

    def __init__(self, device: str | None = None):
        self.device = device or f"{self.kind}:0"

    # ------------------------------------------------------------ discovery
    def physical_count(self) -> int:
        """How many physical devices of this kind the machine has."""
        return 1

    def device_count(self) -> int:
        """How many devices of this kind there are: the logical count set with
        `gd.config.set_logical_device_count(kind, n)`, else one per physical device (none
        where there is no physical one)."""
        physical = self.physical_count()
        return (config.logical_device_count(self.kind) or physical) if physical else 0

    def has_device(self, index: int) -> bool:
        """Whether "kind:index" names a device that can run work."""
        return 0 <= index < self.device_count()

    def for_device(self, device: str) -> Backend:
        """The backend that runs `device` (canonical "kind:N"): host memory has no streams,
        so one object serves every device of the kind."""
        return self

    def describe(self, device: str) -> str:
        """A line for `graphdist devices`."""
        return device

    # ------------------------------------------------------------ buffers
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

    # ------------------------------------------------------------ streams
    # Host work is done when the call returns: nothing to order. The lowering asks `ordered`
    # first and never emits these for a host backend; the benchmark may call synchronize.
    def enter(self) -> None:
        """Make this device (and its stream) current for the calling thread."""

    def record(self):
        """An event marking the work queued so far (None: host work is already done)."""
        return None

    def wait(self, event) -> None:
        """Queue a wait for `event` before this device's later work."""

    def synchronize(self) -> None:
        """Block until this device's queued work is done."""

    def restoring_caller(self):
        """A context that gives the caller back its current device and stream after a
        program that switches between the devices' streams (nothing to do on the host)."""
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


class CpuBackend(Backend):
    """cpu:N: numpy in host memory. Any cpu:N is a valid logical device (they share the
    host's cores); `gd.devices("cpu")` lists cpu:0, or cpu:0..n-1 after
    `gd.config.set_logical_device_count("cpu", n)`."""

    def has_device(self, index: int) -> bool:
        return index >= 0
