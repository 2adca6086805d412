"""A numpy-backed stand-in for the part of CuPy graphdist uses, so CI without a GPU runs the
GPU backend's tests (tests/device/test_gpu_sim.py starts them with NUMBA_ENABLE_CUDASIM=1, which
runs the CUDA kernels in numba's simulator).

It is strict where CuPy is, and checks what an eager host run would otherwise hide:
- a host numpy array mixed into a device call is a TypeError, as in CuPy;
- an array used while another device is current is a ValueError, as in CuPy;
- an event recorded on a stream of another device than the current one is an error, as in
  CUDA;
- stream ordering is checked with vector clocks: reading an array written on another
  stream, or writing one another stream read, without an event wait in between raises
  `StreamRace`. Work on one stream is ordered; everything else must be made so. The
  CUDA kernels (numba's simulator, launched under `install()`) count too: every array
  argument is read on the current stream, and every one whose bytes the kernel changed is
  written there; so do NCCL's all-reduces, on the stream each rank names.
- events carry the host time they were recorded at (the stand-in runs work as it is
  queued), so `cuda.get_elapsed_time` gives milliseconds between two of them.

GRAPHDIST_FAKE_CUPY=N sets the number of physical GPUs.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import os
import sys
import threading
import time
import types
import typing

import numpy as np

_tls = threading.local()
_ptrs = itertools.count(1)


class StreamRace(AssertionError):
    """Two streams touched one buffer with no event between them."""


def device_count() -> int:
    return int(os.environ.get("GRAPHDIST_FAKE_CUPY", "2"))


def _current_device() -> int:
    return getattr(_tls, "device", 0)


# ---------------------------------------------------------------- streams and events

class Event:
    def __init__(self, block: bool = False, disable_timing: bool = False):
        self.device = _current_device()
        self.clock: dict = {}
        self.time = None if disable_timing else 0.0   # perf_counter when recorded

    def synchronize(self) -> None:
        pass


def get_elapsed_time(start: Event, end: Event) -> float:
    """Milliseconds from `start` to `end` (cudaEventElapsedTime)."""
    if start.time is None or end.time is None:
        raise RuntimeError("cudaErrorInvalidResourceHandle: an event without timing")
    return (end.time - start.time) * 1e3


_streams: dict = {}      # ptr -> Stream (what an NCCL call names its stream by)


class Stream:
    def __init__(self, non_blocking: bool = False, *, _null: bool = False):
        self.device = _current_device()
        self.ptr = 0 if _null else next(_ptrs)
        self.clock: dict = {self.ptr: 0}
        self._saved = []
        _streams[self.ptr] = self

    def use(self):
        _tls.stream = self
        return self

    def __enter__(self):
        self._saved.append(getattr(_tls, "stream", None))
        return self.use()

    def __exit__(self, *exc):
        _tls.stream = self._saved.pop()
        return False

    def record(self, event: Event | None = None) -> Event:
        event = event or Event()
        if self.ptr and event.device != self.device:
            raise RuntimeError(f"cudaEventRecord: event of device {event.device} on a stream "
                               f"of device {self.device} (invalid resource handle)")
        event.clock = dict(self.clock)
        if event.time is not None:
            event.time = time.perf_counter()
        return event

    def wait_event(self, event: Event) -> None:
        for s, t in event.clock.items():
            self.clock[s] = max(self.clock.get(s, 0), t)

    def synchronize(self) -> None:
        pass

    def tick(self) -> int:
        self.clock[self.ptr] = self.clock.get(self.ptr, 0) + 1
        return self.clock[self.ptr]


Stream.null = Stream(_null=True)


def get_current_stream() -> Stream:
    return getattr(_tls, "stream", None) or Stream.null


class Device:
    def __init__(self, device: int | None = None):
        self.id = _current_device() if device is None else int(device)
        if not 0 <= self.id < device_count():
            raise RuntimeError(f"cudaErrorInvalidDevice: device {self.id}")
        self._saved = []

    def use(self) -> None:
        _tls.device = self.id

    def __enter__(self):
        self._saved.append(_current_device())
        self.use()
        return self

    def __exit__(self, *exc):
        _tls.device = self._saved.pop()
        return False

    def synchronize(self) -> None:
        pass

    def __eq__(self, other):
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self):
        return self.id


# ---------------------------------------------------------------- arrays

class _Stamps:
    """Who last wrote one buffer, and who read it since: (stream ptr, that stream's tick)."""

    def __init__(self, root):
        self.root = root                   # kept, so its id is not reused meanwhile
        self.writer: tuple | None = None
        self.readers: dict = {}


_stamps: dict = {}   # id(root buffer) -> _Stamps


def _root(a: np.ndarray):
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _stamps_of(a) -> _Stamps:
    root = _root(a)
    stamps = _stamps.get(id(root))
    if stamps is None or stamps.root is not root:
        stamps = _stamps[id(root)] = _Stamps(root)
    return stamps


def _unordered(stream: Stream, stamp) -> bool:
    """Did `stamp` (ptr, tick) happen on another stream, not yet waited on by `stream`?"""
    return stamp is not None and stamp[0] != stream.ptr and stream.clock.get(stamp[0], 0) < stamp[1]


def _touch(reads, writes, stream: Stream | None = None) -> None:
    """Vector-clock check of the reads and writes of `stream` (the current one)."""
    stream = stream or get_current_stream()
    if stream.ptr == 0:          # the null stream waits for all others: always ordered
        return
    tick = stream.tick()
    for a in reads:
        stamps = _stamps_of(a)
        if _unordered(stream, stamps.writer):
            raise StreamRace(f"read on stream {stream.ptr} of a buffer written on stream "
                             f"{stamps.writer[0]} with no event wait after the write")
        stamps.readers[stream.ptr] = tick
    for a in writes:
        stamps = _stamps_of(a)
        for reader in stamps.readers.items():
            if _unordered(stream, reader):
                raise StreamRace(f"write on stream {stream.ptr} of a buffer read on stream "
                                 f"{reader[0]} with no event wait after the read")
        if _unordered(stream, stamps.writer):
            raise StreamRace(f"write on stream {stream.ptr} of a buffer written on stream "
                             f"{stamps.writer[0]} with no event wait after that write")
        stamps.writer = (stream.ptr, tick)
        stamps.readers = {}


class ndarray(np.ndarray):
    """A host array tagged with the device it lives on."""

    def __array_finalize__(self, obj):
        self._dev = getattr(obj, "_dev", _current_device())

    @property
    def device(self) -> Device:
        return Device(self._dev)

    @property
    def data(self):
        ptr = self.__array_interface__["data"][0]
        _by_ptr[ptr] = self        # what an NCCL call on this pointer touches
        return types.SimpleNamespace(ptr=ptr)

    def get(self, stream=None) -> np.ndarray:
        _touch([self], [])
        return np.array(self.view(np.ndarray))

    def set(self, arr, stream=None) -> None:
        _touch([], [self])
        if np.shape(arr) != self.shape:         # CuPy's set neither broadcasts nor reshapes
            raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: "
                             f"{np.shape(arr)}")
        np.copyto(self.view(np.ndarray), arr)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        return _Checked(getattr(ufunc, method))(*inputs, **kwargs)

    def copy(self, order="C"):
        _check([self])
        return _new(self)

    def astype(self, dtype, copy=True):
        _check([self])
        return _new(self, dtype)

    def __setitem__(self, index, value):
        if isinstance(value, np.ndarray):   # scalar stores are a kernel's (the simulator's)
            _check([self, value])
            _touch([value] if isinstance(value, ndarray) else [], [self])
        super().__setitem__(index, _raw(value))

    def __float__(self):
        return float(self.get())

    def __int__(self):
        return int(self.get())


_by_ptr: dict = {}   # data pointer -> the array whose `.data.ptr` gave it


def _arrays(tree):
    if isinstance(tree, np.ndarray):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for t in tree:
            yield from _arrays(t)


def _check(values) -> None:
    device = _current_device()
    for a in _arrays(list(values)):
        if not isinstance(a, ndarray):
            raise TypeError(f"Unsupported type {type(a)} (a host array in a device call)")
        if a._dev != device:
            raise ValueError(f"Array device must be same as the current device: array "
                             f"device = {a._dev} while current = {device}")


def _raw(tree):
    if isinstance(tree, ndarray):
        return tree.view(np.ndarray)
    if isinstance(tree, list):
        return [_raw(t) for t in tree]
    if isinstance(tree, tuple):
        return tuple(_raw(t) for t in tree)
    return tree


def _wrap(result):
    if isinstance(result, (tuple, list)):
        return type(result)(_wrap(r) for r in result)
    if isinstance(result, (np.ndarray, np.generic)) and not isinstance(result, ndarray):
        out = np.asarray(result).view(ndarray)
        out._dev = _current_device()
        return out
    return result


_OUT_FIRST = {"copyto"}        # functions whose first argument is written


class _Checked:
    """A numpy function or ufunc method run the CuPy way: device arrays only, on the
    current device, ordered on the current stream; results are device arrays."""

    def __init__(self, fn, name: str = ""):
        self.fn = fn
        self.name = name or getattr(fn, "__name__", "")

    def __call__(self, *args, **kwargs):
        out = kwargs.get("out")
        outs = out if isinstance(out, tuple) else (out,) if out is not None else ()
        written = list(outs) + (list(args[:1]) if self.name in _OUT_FIRST else [])
        if self.name == "at":
            written.append(args[0])
        read = [a for a in _arrays(list(args) + [kwargs.get("where")])
                if not any(a is w for w in written)]
        _check(list(args) + list(outs) + [kwargs.get("where")])
        _touch(read, written)
        if out is not None:
            kwargs["out"] = _raw(out)
        result = self.fn(*_raw(args), **{k: _raw(v) for k, v in kwargs.items()})
        if out is not None:     # a ufunc's out= comes as a tuple; one output is returned alone
            return out[0] if isinstance(out, tuple) and len(out) == 1 else out
        return _wrap(result)

    def __getattr__(self, name):
        return _Checked(getattr(self.fn, name), name)


def _new(value, dtype=None):
    """A new array on the current device; from a device array it is a copy queued on the
    current stream (CuPy copies between devices that way too)."""
    if isinstance(value, ndarray):
        _touch([value], [])
    out = np.array(_raw(value), dtype=dtype, order="C").view(ndarray)
    out._dev = _current_device()
    _touch([], [out])
    return out


def array(value, dtype=None, copy=True):
    return _new(value, dtype)


def asarray(value, dtype=None):
    if isinstance(value, ndarray) and value._dev == _current_device() and (
            dtype is None or np.dtype(dtype) == value.dtype):
        return value
    return _new(value, dtype)


ascontiguousarray = asarray


def _maker(name):
    fn = getattr(np, name)

    def make(*args, **kwargs):
        out = fn(*_raw(args), **kwargs).view(ndarray)
        out._dev = _current_device()
        _touch([], [out])
        return out
    return make


empty, zeros, ones, full, arange = (_maker(n) for n in ("empty", "zeros", "ones", "full",
                                                         "arange"))


def asnumpy(a, stream=None):
    return a.get() if isinstance(a, ndarray) else np.asarray(a)


def __getattr__(name):
    obj = getattr(np, name)
    return _Checked(obj, name) if callable(obj) and not isinstance(obj, type) else obj


# ---------------------------------------------------------------- cupy.cuda

class _Nccl(types.ModuleType):
    NCCL_SUM = 0
    NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64, NCCL_INT32, NCCL_INT64 = range(5)
    _DTYPES: typing.ClassVar = {0: np.float16, 1: np.float32, 2: np.float64, 3: np.int32,
                                4: np.int64}

    available = True

    def __init__(self):
        super().__init__("cupy.cuda.nccl")
        self._pending = None
        self.calls = 0

    def groupStart(self):
        self._pending = []

    def groupEnd(self):
        pending, self._pending = self._pending, None
        by_clique: dict = {}
        for call in pending:
            by_clique.setdefault(call[0].clique, []).append(call)
        for calls in by_clique.values():
            calls.sort(key=lambda c: c[0].rank)
            if len(calls) != calls[0][0].size:
                raise RuntimeError("NCCL: not every rank joined the all-reduce (deadlock)")
            for c in calls:        # each rank reads and writes its buffers on its stream
                _touch([_by_ptr[c[1]]], [_by_ptr[c[2]]], _streams[c[5]])
            views = [_at(c[1], c[3], self._DTYPES[c[4]]) for c in calls]
            total = views[0].copy()
            for v in views[1:]:
                total += v
            for c in calls:
                _at(c[2], c[3], self._DTYPES[c[4]])[...] = total
            self.calls += 1

    class NcclCommunicator:
        def __init__(self, clique, rank, size):
            self.clique, self.rank, self.size = clique, rank, size

        @classmethod
        def initAll(cls, devices):
            if len(set(devices)) != len(devices):
                raise RuntimeError("NCCL: duplicate GPU detected (ncclInvalidUsage)")
            clique = object()
            return [cls(clique, r, len(devices)) for r in range(len(devices))]

        def allReduce(self, send, recv, count, dtype, op, stream):
            nccl = sys.modules["cupy"].cuda.nccl
            if nccl._pending is None:
                raise RuntimeError("NCCL: several ranks from one thread need groupStart()")
            nccl._pending.append((self, send, recv, count, dtype, stream))


def _at(ptr: int, count: int, dtype) -> np.ndarray:
    nbytes = count * np.dtype(dtype).itemsize
    return np.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype=dtype)


cuda = types.SimpleNamespace(
    Device=Device, Stream=Stream, Event=Event, get_current_stream=get_current_stream,
    get_elapsed_time=get_elapsed_time,
    runtime=types.SimpleNamespace(getDeviceCount=device_count, deviceSynchronize=lambda: None),
    nccl=_Nccl())


def _checked_launch(call):
    """A simulated CUDA kernel's launch, stream-checked: its array arguments are read on
    the current stream, and those whose bytes it changed are written there."""
    @functools.wraps(call)
    def launch(kernel, *args):
        if kernel._device:              # a device function called from a kernel
            return call(kernel, *args)
        arrays = [a for a in [*_arrays(list(args)), *_tabled(args)] if isinstance(a, ndarray)]
        before = [a.view(np.ndarray).tobytes() for a in arrays]
        _touch(arrays, [])
        result = call(kernel, *args)
        _touch([], [a for a, b in zip(arrays, before) if a.view(np.ndarray).tobytes() != b])
        return result
    launch.checked = True
    return launch


def _tabled(args):
    """The buffers a multi-tensor kernel reaches through its table of addresses (a 2-D
    uint64 argument, kernels/common.gpu_tables; under the simulator its entries are keys
    of the views it registered)."""
    from graphdist.kernels.common import _SIMULATED

    for a in args:
        if isinstance(a, np.ndarray) and a.dtype == np.uint64 and a.ndim == 2:
            for key in a.reshape(-1):
                view = _SIMULATED[int(key)]
                yield getattr(view, "_ary", view)


def install() -> None:
    """Make `import cupy` give this module, and stream-check the simulated kernels."""
    module = sys.modules[__name__]
    module.ndarray = ndarray
    sys.modules["cupy"] = module
    sys.modules["cupy.cuda"] = cuda
    sys.modules["cupy.cuda.nccl"] = cuda.nccl
    from numba import config

    if config.ENABLE_CUDASIM:
        from numba.cuda.simulator.kernel import FakeCUDAKernel

        if not getattr(FakeCUDAKernel.__call__, "checked", False):
            FakeCUDAKernel.__call__ = _checked_launch(FakeCUDAKernel.__call__)
