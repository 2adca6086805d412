"""The GPU backend: gpu:N devices on CuPy arrays, one CUDA stream per logical device.

Logical GPUs map round robin onto the physical ones (gpu:i runs on physical i % count), so
`gd.config.set_logical_device_count("gpu", 4)` on one card gives four devices that share
its memory but each queue work on their own stream. The compiled program of a step is
issued from one host thread: launches are asynchronous, so the streams overlap on the
GPU while Python moves on. A value read on another device's stream is ordered by an
event (see streams.py); a result handed to the caller is copied to the host on the stream
that made it.
"""

from __future__ import annotations

import functools
import threading

import numpy as np

from graphdist.device.host import Backend

# the kernel kind of the Numba CUDA kernels (runtime/adapters' CUDA entries)
CUDA_KERNELS = "gpu"


def cupy():
    import cupy as cp  # optional: the `cuda` extra

    return cp


@functools.cache
def physical_gpu_count() -> int:
    try:
        import cupy  # noqa: PLC0415 - optional, imported only when asked about GPUs

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no cupy, no driver, no device: all mean "no GPU"
        return 0


def physical_gpu_of(device: str) -> int:
    """The physical GPU a logical one runs on: round robin, gpu:i on i % physical count.

    >>> physical_gpu_of("gpu:5") == 5 % max(physical_gpu_count(), 1)
    True
    """
    return int(str(device).partition(":")[2]) % max(physical_gpu_count(), 1)


class GpuKind(Backend):
    """The gpu device kind: what it can do, its discovery, and its devices' backends (made
    on first use, when CuPy is imported). Registered in device/backends.py."""

    kind = "gpu"
    kernel_kind = CUDA_KERNELS
    shares_host_memory = False
    ordered = True
    merges_replicas = False     # each GPU has its own memory and stream: no batched program
    threads = False             # one host thread issues every stream's work (launches are async)
    accelerator = True
    nccl = True
    default_lowering = "nccl"   # logical GPUs sharing a physical one are summed there

    @property
    def xp(self):
        return cupy()

    def physical_count(self) -> int:
        return physical_gpu_count()

    def for_device(self, device: str) -> GpuBackend:
        return gpu_backend(device)

    def describe(self, device: str) -> str:
        return f"{device}  (physical GPU {physical_gpu_of(device)})"

    def restoring_caller(self):
        return restored_stream()


class GpuBackend(GpuKind):
    """One logical GPU: its physical device, its stream, and moves to and from the host."""

    def __init__(self, device: str, physical: int):
        super().__init__(device)
        cp = cupy()
        self.physical = physical
        self.cuda_device = cp.cuda.Device(physical)
        with self.cuda_device:
            self.stream = cp.cuda.Stream(non_blocking=False)
        self._numba_streams: dict = {}

    # ------------------------------------------------------------ buffers
    def empty(self, shape, dtype):
        with self.cuda_device:
            return self.xp.empty(shape, dtype=dtype)

    def from_host(self, value):
        """Copy a host value (or another device's array) to this device, on its stream:
        later work on this stream sees it without any other wait."""
        with self.cuda_device, self.stream:
            return self.xp.array(value, copy=True)

    def to_device(self, value):
        """A step argument: a CuPy array already on this GPU is used as is (no copy; the
        step never writes its arguments), anything else is copied over."""
        if isinstance(value, self.xp.ndarray) and value.device.id == self.physical:
            return value
        return self.from_host(value)

    def to_host(self, array) -> np.ndarray:
        if isinstance(array, (np.ndarray, np.generic)):
            return np.asarray(array)
        with self.cuda_device, self.stream:
            return array.get(stream=self.stream)   # waits for this stream's work

    def copy_in(self, dst, src) -> None:
        with self.cuda_device, self.stream:
            if isinstance(src, (np.ndarray, np.generic)):
                dst.set(np.require(src, dst.dtype, "C"), stream=self.stream)   # 0-d stays 0-d
            else:
                dst[...] = src
        self.stream.synchronize()   # `src` may be a host buffer the caller reuses at once

    def current(self):
        return self.cuda_device

    # ------------------------------------------------------------ streams
    def enter(self) -> None:
        """Make this device and its stream current for the calling thread."""
        self.cuda_device.use()
        self.stream.use()

    def record(self):
        with self.cuda_device:      # an event belongs to the device of the stream it marks
            return self.stream.record()

    def wait(self, event) -> None:
        self.stream.wait_event(event)

    def synchronize(self) -> None:
        self.stream.synchronize()

    @functools.cached_property
    def comm_stream(self):
        """A second stream of this device, for the collectives that run beside its compute
        (overlap: runtime/overlap.py), made on first use."""
        with self.cuda_device:
            return cupy().cuda.Stream(non_blocking=False)

    def numba_stream(self, stream=None):
        """This device's stream (or `stream`) as numba sees it, for the CUDA kernels (0
        under the simulator)."""
        stream = self.stream if stream is None else stream
        if stream.ptr not in self._numba_streams:
            from numba import cuda

            external = getattr(cuda, "external_stream", None)   # the simulator has none
            self._numba_streams[stream.ptr] = external(stream.ptr) if external else 0
        return self._numba_streams[stream.ptr]


class restored_stream:
    """Gives the caller back its current device and stream after a step, even a failed one."""

    def __enter__(self):
        cp = cupy()
        self.device = cp.cuda.Device()
        self.stream = cp.cuda.get_current_stream()
        return self

    def __exit__(self, *exc):
        self.device.use()
        self.stream.use()
        return False


_lock = threading.Lock()
_made: dict[str, GpuBackend] = {}


def gpu_backend(device: str) -> GpuBackend:
    """The backend of logical GPU `device` ("gpu:N"), made once per process."""
    backend = _made.get(device)
    if backend is not None:
        return backend
    if physical_gpu_count() == 0:
        raise ValueError(f"device {device!r}: no GPU here (CuPy with a CUDA device is needed; "
                         "install graphdist[cuda])")
    with _lock:
        if device not in _made:
            _made[device] = GpuBackend(device, physical_gpu_of(device))
        return _made[device]


def current_numba_stream():
    """The current CuPy stream as numba sees it: the stream a kernel adapter launches on
    (inside a compiled step, the stream of the device running the node)."""
    ptr = cupy().cuda.get_current_stream().ptr
    for backend in list(_made.values()):
        if backend.stream.ptr == ptr:
            return backend.numba_stream()
    from numba import cuda

    external = getattr(cuda, "external_stream", None)
    return external(ptr) if external and ptr else 0
