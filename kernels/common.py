"""Helpers shared by the kernel modules: flat views, typed tensor lists, chunk tables, grids.

No update math lives here; that is in sgd.py, adam.py and reduce.py.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Sequence

import numba
import numpy as np
from numba import config, cuda, njit, typed, types

try:                                   # numba-cuda, the CUDA target's own package
    from numba.cuda.extending import intrinsic
except ImportError:                    # the CUDA target inside numba itself
    from numba.core.extending import intrinsic

CHUNK = 1 << 16  # elements per (tensor, chunk) row of a multi-tensor CPU call
# CUDA threads per block; the simulator runs each thread as a Python thread, so keep blocks small
THREADS = 32 if config.ENABLE_CUDASIM else 256


def flat(x: np.ndarray) -> np.ndarray:
    """A 1-D view of a C-contiguous host buffer, so kernels can update it in place.

    >>> flat(np.zeros((2, 3), np.float32)).shape
    (6,)
    """
    if not isinstance(x, np.ndarray):
        raise TypeError(f"kernel: expected a numpy ndarray to update in place, got {type(x)}")
    if not x.flags.c_contiguous:
        raise ValueError(f"kernel: expected a C-contiguous buffer, got strides {x.strides}")
    return x.reshape(-1)


def readable(x):
    """An input a kernel only reads, as an array: numpy gives a 0-d result back as a numpy
    scalar, which has no buffer to view (a 0-d gradient). Never for buffers updated in
    place: those must be the arrays themselves."""
    return np.asarray(x) if isinstance(x, np.generic) else x


def readables(xs):
    """`readable` over a list of inputs (a typed List is passed through)."""
    return xs if isinstance(xs, typed.List) else [readable(x) for x in xs]


def same_dtype(name: str, *arrays) -> None:
    """Raise TypeError unless every array (or typed List of arrays) has the first one's dtype."""
    dtypes = [a.dtype if hasattr(a, "dtype") else a[0].dtype for a in arrays if a is not None]
    for dtype in dtypes[1:]:
        if dtype != dtypes[0]:
            raise TypeError(f"{name}: expected one dtype, got {dtypes[0]} and {dtype}")


def tensor_list(arrays: Sequence[np.ndarray]) -> typed.List:
    """A numba typed List of flat views, the form the multi-tensor CPU kernels take.

    Building one costs about 2.5 us per tensor; buffers that live across steps (parameters,
    slots) can be converted once and passed again, a typed List is passed through as is.

    >>> len(tensor_list([np.zeros(3), np.zeros((2, 2))]))
    2
    """
    if isinstance(arrays, typed.List):
        return arrays
    if len(arrays) == 0:
        raise ValueError("kernel: expected at least one tensor, got an empty list")
    dtype = arrays[0].dtype
    for a in arrays:
        if a.dtype != dtype:
            raise TypeError(
                f"kernel: tensors of one call must share a dtype, got {dtype} and {a.dtype}"
            )
    return typed.List([flat(a) for a in arrays])


# below this many bytes touched a parallel kernel runs on one thread: waking the thread
# team costs more than the work (select over 16K floats: 84 us on 2 threads, 3 us on 1)
PARALLEL_MIN_BYTES = 1 << 20


# The Numba thread count each thread's parallel kernels run on, kept here per thread and
# set only when it changes: numba.set_num_threads and get_num_threads cost about 25 us a
# call (a lock and the thread pool's launch check), and one thread for each small kernel
# and back again took ~0.8 ms of each device program of the tutorial CNN's step (four of
# them with a thread per device). A small kernel leaves the count at one; the next large
# one sets it back to what its thread wants (want_numba_threads).
_numba = threading.local()


def want_numba_threads(n: int | None) -> int | None:
    """This thread's large parallel kernels run on n threads from now on (None: every
    Numba thread); returns what it wanted before."""
    before = getattr(_numba, "wanted", None)
    _numba.wanted = n
    return before


def _use_numba_threads(n: int) -> None:
    n = max(1, min(n, config.NUMBA_NUM_THREADS))
    if getattr(_numba, "now", None) != n:
        numba.set_num_threads(n)
        _numba.now = n


@contextlib.contextmanager
def numba_threads(n: int):
    """The parallel kernels this thread launches inside run on n threads where large (a
    test of a kernel's bits against the thread count)."""
    before = want_numba_threads(n)
    try:
        yield
    finally:
        want_numba_threads(before)


@contextlib.contextmanager
def threads_for(nbytes: int):
    """Run the parallel kernels inside on one thread when the work is small, else on the
    threads their thread wants (want_numba_threads)."""
    wanted = getattr(_numba, "wanted", None) or config.NUMBA_NUM_THREADS
    _use_numba_threads(1 if nbytes < PARALLEL_MIN_BYTES else wanted)
    yield


TUPLE_SIZES = (4, 8, 16)   # compile time grows fast with the size: 64 took minutes


def tensor_group(*lists):
    """The tensor lists of one multi-tensor call in the form the CPU kernels run fastest on:
    tuples of flat views (measured 2x faster in the kernel than typed Lists), padded with
    empty arrays to 4, 8 or 16 entries so numba compiles one specialization per size
    class rather than per tensor count. Longer lists, or typed Lists given by the caller,
    become typed Lists.

    >>> ps, gs = tensor_group([np.zeros(3)], [np.ones(3)]); len(ps), ps[1].size
    (4, 0)
    """
    n = len(lists[0])
    size = next((k for k in TUPLE_SIZES if k >= n), None)
    if size is None or any(isinstance(x, typed.List) for x in lists):
        return tuple(tensor_list(x) for x in lists)
    out = []
    dtype = lists[0][0].dtype
    for arrays in lists:
        if len(arrays) != n:
            raise ValueError("multi-tensor kernel: the tensor lists differ in length")
        flats = [flat(a) for a in arrays]
        for a in flats:
            if a.dtype != dtype:
                raise TypeError(f"kernel: tensors of one call must share a dtype, got {dtype} "
                                f"and {a.dtype}")
        empty = np.empty(0, flats[0].dtype)
        out.append(tuple(flats) + (empty,) * (size - n))
    return tuple(out)


def tuple_groups(*lists) -> list:
    """The tensor lists of one multi-tensor call cut into groups of at most 16 tensors,
    each of which tensor_group turns into tuples: a parallel call per 16 tensors beats one
    over typed Lists (built anew each call, 0.5 ms for 50 tensors x 3 lists, and boxed on
    every access). Typed Lists given by the caller stay whole.

    >>> [len(g[0]) for g in tuple_groups(list(range(40)), list(range(40)))]
    [16, 16, 8]
    """
    n, step = len(lists[0]), TUPLE_SIZES[-1]
    if n <= step or any(isinstance(x, typed.List) for x in lists):
        return [lists]
    return [tuple(x[start:start + step] for x in lists) for start in range(0, n, step)]


def device_view(x):
    """A 1-D numba view of a device buffer (numba, CuPy or any CUDA-array-interface array).

    Foreign arrays are wrapped with sync=False: the caller owns the stream, so the kernels never
    wait on the exporter's stream. Under the CUDA simulator numpy arrays pass through.
    """
    if not getattr(x, "__cuda_ndarray__", False) and hasattr(x, "__cuda_array_interface__"):
        x = cuda.as_cuda_array(x, sync=False)
    return x if x.ndim == 1 else x.reshape(x.size)


def device_hyper(hyper, sizes: tuple):
    """An update's float64 hyper-parameter vector as a 1-D device view: a device array (as a
    compiled step makes it) where it lies, host numbers copied over (one small transfer).
    Under the simulator numpy arrays are device arrays, and pass through."""
    if isinstance(hyper, (list, tuple, np.generic)) or (
            isinstance(hyper, np.ndarray) and not config.ENABLE_CUDASIM):
        hyper = cuda.to_device(np.asarray(hyper, np.float64).reshape(-1))
    view = device_view(hyper)
    if view.dtype != np.float64 or view.ndim != 1 or view.shape[0] not in sizes:
        raise ValueError(f"kernel: expected {' or '.join(map(str, sizes))} float64 "
                         f"hyper-parameters, got {view.dtype} {view.shape}")
    return view


# blocks per tensor of a stride-loop kernel: enough to fill an H100 with one tensor; the
# simulator runs every CUDA thread as a Python thread, so there a few blocks do all the work
MAX_BLOCKS_PER_TENSOR = 2 if config.ENABLE_CUDASIM else 2048

# ---------------------------------------------------------------- multi-tensor CUDA launches
# A numba-cuda launch costs about 6 us of CPU per array argument (7 kernel parameters each,
# marshalled in Python): measured on an H200, 4 launches of 16-tensor tuples took 1.26 ms of
# CPU per Adam update of 50 tensors, longer than the GPU's 0.96 ms for all 100M parameters,
# against 45 us for one launch over 5 arrays. So a multi-tensor launch passes 4 arrays
# whatever the tensor count: a device table of the tensors' addresses, a table of
# (tensor, start, stop) chunks (one block each, as apex's multi_tensor_apply), a zero-size
# array of the dtype, and the hyper vector; each block turns addresses back into pointers.
# Elements per block: on an H200, Adam over 100M parameters in 50 tensors took 0.86 ms at
# 4K (16 per thread, each thread's loads in flight together) against 0.99 ms at 32K and
# 0.77 for the flat kernel (tools/gpu_profile.py).
GPU_CHUNK = 1 << 8 if config.ENABLE_CUDASIM else 1 << 12
GROUPS_KEPT = 32   # prepared calls remembered (a compiled step passes the same buffers)
_tables: collections.OrderedDict = collections.OrderedDict()


class TensorTable(collections.namedtuple("TensorTable", "addresses chunks like blocks")):
    """The device tables of one multi-tensor CUDA call (see gpu_tables)."""


def gpu_tables(*lists) -> TensorTable:
    """The device tables of a multi-tensor CUDA call over parallel tensor lists (p, m, v,
    g, ...): `addresses` (tensors, lists) uint64, `chunks` (blocks, 3) int64 rows of
    (tensor, start, stop), `like` a zero-size device array of their dtype, `blocks` the
    grid. A kernel reads tensor t of list k as at_address(addresses[t, k], like).

    The tables are a function of the buffers' addresses, shapes, strides and dtype alone,
    so they are remembered by those: a compiled step's gradients are new arrays each step
    but CuPy's pool hands them the same memory, and building the tables again (a numba
    view of every tensor, two uploads) cost 0.1 ms per tensor on the host, more than the
    launch it prepares (the MLP on one GPU: 25 views a step).
    """
    n = len(lists[0])
    for lst in lists:
        if len(lst) != n:
            raise ValueError("multi-tensor kernel: the tensor lists differ in length")
    key = tuple(_buffer_key(a) for lst in lists for a in lst)
    return _kept(_tables, key, lambda: _make_tables(lists))


def _buffer_key(a) -> tuple:
    """What a tensor table holds of a buffer: its address, shape, strides and dtype."""
    face = getattr(a, "__cuda_array_interface__", None) or a.__array_interface__
    return face["data"][0], face["shape"], face.get("strides"), face["typestr"]


def _make_tables(lists) -> TensorTable:
    views = [[device_view(a) for a in lst] for lst in lists]
    for t, column in enumerate(zip(*views)):
        if any(v.shape != column[0].shape for v in column):
            raise ValueError(f"multi-tensor kernel: tensor {t}'s buffers differ in size: "
                             f"{[v.shape for v in column]}")
    sizes = [v.shape[0] for v in views[0]]
    addresses = np.array([[_address(lst[t]) for lst in views] for t in range(len(sizes))],
                         np.uint64).reshape(len(sizes), len(views))
    chunks = chunk_table(np.array(sizes, np.int64), GPU_CHUNK)
    like = _empty_device(views[0][0].dtype) if views[0] else None
    return TensorTable(_to_device(addresses), _to_device(chunks), like, len(chunks))


def _address(view) -> int:
    """A device buffer's address; under the simulator, a key for at_address to look up."""
    if not config.ENABLE_CUDASIM:
        return view.__cuda_array_interface__["data"][0]
    key = len(_SIMULATED) + 1     # not the address: a slice at a buffer's start shares it
    _SIMULATED[key] = view
    return key


def _to_device(host: np.ndarray):
    return host if config.ENABLE_CUDASIM else cuda.to_device(host)


_SIMULATED: dict = {}     # simulator only: key -> the 1-D view it stands for


def _simulated_at_address(address, like):
    return _SIMULATED[int(address)]


@intrinsic
def _at_address(typingctx, address, like):
    """A pointer of `like`'s dtype to device address `address` (a uint64)."""
    if not (isinstance(address, types.Integer) and isinstance(like, types.Array)):
        return None
    pointer = types.CPointer(like.dtype)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(pointer))
    return pointer(address, like), codegen


# what a multi-tensor kernel calls: a pointer on the GPU, the registered view in the simulator
at_address = _simulated_at_address if config.ENABLE_CUDASIM else _at_address


def remembered(cache: collections.OrderedDict, lists, make):
    """make(), or what it gave for the same arrays (the same objects, in order) lately.

    The cache keeps those arrays alive, so no other array can take their identities (or
    their memory) while it remembers them; it keeps the last GROUPS_KEPT calls.
    """
    key = tuple(id(a) for lst in lists for a in lst)
    return _kept(cache, key, lambda: (make(), lists))[0]


def _kept(cache: collections.OrderedDict, key, make):
    """cache[key], made by make() when missing; the cache keeps its last GROUPS_KEPT keys."""
    hit = cache.get(key)
    if hit is None:
        hit = cache[key] = make()
        if len(cache) > GROUPS_KEPT:
            cache.popitem(last=False)
    else:
        cache.move_to_end(key)
    return hit


def _empty_device(dtype):
    key = np.dtype(dtype).str
    if key not in _EMPTIES:
        _EMPTIES[key] = cuda.device_array(0, dtype) if not config.ENABLE_CUDASIM \
            else np.empty(0, dtype)
    return _EMPTIES[key]


_EMPTIES: dict = {}


def multi_grid(largest: int, tensors: int) -> tuple[tuple[int, int], int]:
    """((blocks per tensor, tensors), threads) for a multi-tensor launch: blockIdx.y picks
    the tensor and the x blocks stride over it."""
    blocks = max(1, min((largest + THREADS - 1) // THREADS, MAX_BLOCKS_PER_TENSOR))
    return (blocks, tensors), THREADS


def grid(n: int) -> tuple[int, int]:
    """(blocks, threads) covering n elements with one thread each.

    >>> grid(1000) == ((1000 + THREADS - 1) // THREADS, THREADS)
    True
    """
    return (n + THREADS - 1) // THREADS, THREADS


@njit(cache=True)
def sizes_of(tensors):  # -> (tensors,) int64: each tensor's element count
    sizes = np.empty(len(tensors), np.int64)
    for t in range(len(tensors)):
        sizes[t] = tensors[t].size
    return sizes


@njit(cache=True)
def chunk_table(sizes, chunk):  # -> (rows, 3) int64: tensor, start, stop
    rows = 0
    for n in sizes:
        rows += (n + chunk - 1) // chunk
    table = np.empty((rows, 3), np.int64)
    r = 0
    for t in range(len(sizes)):
        n = sizes[t]
        for start in range(0, n, chunk):
            table[r, 0] = t
            table[r, 1] = start
            table[r, 2] = min(start + chunk, n)
            r += 1
    return table


@njit(cache=True)
def check_sizes(a, b):
    if len(a) != len(b):
        raise ValueError("multi-tensor kernel: the tensor lists differ in length")
    for t in range(len(a)):
        if a[t].size != b[t].size:
            raise ValueError("multi-tensor kernel: a tensor's buffers differ in size")
