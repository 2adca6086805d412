"""All-reduce (sum or mean) over N same-shaped buffers, and scale (out = a * x, with a cast).

The sum runs in buffer order, ((b0 + b1) + b2) + ..., so results are deterministic; the mean
divides that sum by N in the buffers' dtype. all_reduce_ref/scale_ref are the specs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numba import cuda, njit, prange

from .common import (
    CHUNK,
    THREADS,
    at_address,
    device_view,
    flat,
    gpu_tables,
    grid,
    same_dtype,
    threads_for,
)

_OPS = ("sum", "mean")


def all_reduce_ref(bufs: Sequence[np.ndarray], op: str = "sum") -> np.ndarray:
    """The spec: a new array holding the sum (or mean) of `bufs`, added in list order.

    >>> all_reduce_ref([np.ones(2), np.full(2, 3.0)], op="mean")
    array([2., 2.])
    """
    _check_op(op)
    acc = bufs[0].copy()
    for b in bufs[1:]:
        acc = acc + b
    return acc / len(bufs) if op == "mean" else acc


def _check_op(op):
    if op not in _OPS:
        raise ValueError(f"all_reduce: expected op in {_OPS}, got {op!r}")


@njit(error_model="numpy", cache=True)
def reduce_chunk(bufs, start, stop, count, mean, acc):
    """acc[:] = bufs[0][start:stop] + bufs[1][start:stop] + ... (then / count), in buffer
    order: the one definition of the sum every host all-reduce kernel computes."""
    first = bufs[0][start:stop]
    for i in range(stop - start):
        acc[i] = first[i]
    for k in range(1, len(bufs)):
        b = bufs[k][start:stop]
        for i in range(stop - start):
            acc[i] += b[i]
    if mean:
        for i in range(stop - start):
            acc[i] /= count


@njit(parallel=True, fastmath=False, error_model="numpy", cache=True)
def _all_reduce(bufs, outs, count, mean):  # bufs, outs: tuples of (n,)
    n = outs[0].size
    for b in bufs:
        if b.size != n:
            raise ValueError("all_reduce: buffers differ in size")
    for c in prange((n + CHUNK - 1) // CHUNK):
        start, stop = c * CHUNK, min(c * CHUNK + CHUNK, n)
        # chunk by chunk, so the running sum stays in cache while each buffer streams by once
        acc = outs[0][start:stop]
        reduce_chunk(bufs, start, stop, count, mean, acc)
        for k in range(1, len(outs)):   # the chunk is still in cache: copy it out
            o = outs[k][start:stop]
            for i in range(stop - start):
                o[i] = acc[i]


def all_reduce_cpu(bufs: Sequence[np.ndarray], op: str = "sum", out: np.ndarray | None = None,
                   outs: Sequence[np.ndarray] | None = None):
    """Reduce host buffers in one parallel pass. The result goes into every buffer, or into
    `out` (which may be bufs[0] but must not overlap the others), or into each of `outs`
    (one result per replica, none overlapping the buffers). Returns the (first) result.

    >>> a, b = np.ones(3, np.float32), np.full(3, 2, np.float32); _ = all_reduce_cpu([a, b]); b
    array([3., 3., 3.], dtype=float32)
    """
    _check_op(op)
    ts = tuple(flat(b) for b in bufs)    # tuples: faster in the kernel than typed Lists
    same_dtype("all_reduce_cpu", *ts)
    if outs is not None:
        dsts = tuple(flat(o) for o in outs)
        same_dtype("all_reduce_cpu", ts[0], *dsts)
    elif out is None:
        dsts = ts
    else:
        same_dtype("all_reduce_cpu", ts[0], out)
        dsts = (flat(out),)
        if any(np.may_share_memory(dsts[0], b) for b in ts[1:]):
            raise ValueError("all_reduce_cpu: out overlaps a buffer other than bufs[0]")
    with threads_for(2 * sum(t.nbytes for t in ts)):
        _all_reduce(ts, dsts, dsts[0].dtype.type(len(ts)), op == "mean")
    return bufs[0] if out is None else out


@cuda.jit(cache=True)
def _all_reduce_kernel(addresses, chunks, like, n_in, count, mean):  # see common.gpu_tables
    # tensor 0's lists: the n_in buffers to reduce, then the buffers the result goes to
    start, stop = chunks[cuda.blockIdx.x, 1], chunks[cuda.blockIdx.x, 2]
    first = at_address(addresses[0, 0], like)
    for i in range(start + cuda.threadIdx.x, stop, cuda.blockDim.x):
        acc = first[i]
        for k in range(1, n_in):
            acc += at_address(addresses[0, k], like)[i]
        if mean:
            acc /= count
        for k in range(n_in, addresses.shape[1]):
            at_address(addresses[0, k], like)[i] = acc


def all_reduce_gpu(bufs: Sequence, op: str = "sum", out=None, stream=0,
                   outs: Sequence | None = None) -> None:
    """Launch one kernel reducing device buffers (each on this device, or peer-accessible);
    the result goes into every buffer, or into `out` (which may alias any of them), or into
    each of `outs` (outs[k] may be bufs[k]: element i is read before it is written). No sync.

    The buffers reach the kernel as a table of addresses (common.gpu_tables, remembered by
    address): numba prepared a tuple of arrays for each launch at 0.4 ms of host time for 4
    replicas, 50 times a CuPy kernel's launch.

    >>> all_reduce_gpu([d0, d1], op="mean", stream=s)  # device arrays  # doctest: +SKIP
    """
    _check_op(op)
    same_dtype("all_reduce_gpu", *bufs, out, *(outs or ()))
    dsts = list(outs) if outs is not None else list(bufs) if out is None else [out]
    sizes = [b.size for b in (*bufs, *dsts)]
    if any(n != sizes[0] for n in sizes):
        raise ValueError(f"all_reduce_gpu: buffers differ in size: {sizes}")
    table = gpu_tables(*([b] for b in (*bufs, *dsts)))
    if table.blocks:
        count = np.dtype(table.like.dtype).type(len(bufs))
        _all_reduce_kernel[table.blocks, THREADS, stream](table.addresses, table.chunks,
                                                          table.like, len(bufs), count,
                                                          op == "mean")


def scale_ref(x: np.ndarray, a: float, dtype=None) -> np.ndarray:
    """The spec: a * x computed in the wider of x's dtype and `dtype`, returned as `dtype`.

    >>> scale_ref(np.ones(2, np.float32), 0.5, np.float64)
    array([0.5, 0.5])
    """
    dtype = x.dtype if dtype is None else np.dtype(dtype)
    wide = np.promote_types(x.dtype, dtype)
    return (float(a) * x.astype(wide)).astype(dtype)


def _scale_factor(x, out, a):
    return np.promote_types(x.dtype, out.dtype).type(a)


@njit(parallel=True, fastmath=False, error_model="numpy", cache=True)
def _scale(x, a, out):  # x, out: (n,); a in the wider dtype, so the product is rounded once
    if x.size != out.size:
        raise ValueError("scale: x and out differ in size")
    for i in prange(x.size):
        out[i] = a * x[i]


def scale_cpu(x: np.ndarray, a: float, out: np.ndarray) -> np.ndarray:
    """out = a * x on the host, casting to out's dtype; out may be x. Returns out.

    >>> scale_cpu(np.ones(2, np.float32), 0.25, np.empty(2))
    array([0.25, 0.25])
    """
    with threads_for(x.nbytes + out.nbytes):
        _scale(flat(x), _scale_factor(x, out, a), flat(out))
    return out


@cuda.jit(cache=True)
def _scale_kernel(x, a, out):  # x, out: (n,)
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = a * x[i]


def scale_gpu(x, a: float, out, stream=0) -> None:
    """Launch out = a * x on a device, casting to out's dtype; out may be x. No sync.

    >>> scale_gpu(g, 1 / 4, g, stream=s)  # device array  # doctest: +SKIP
    """
    factor = _scale_factor(x, out, a)
    x, out = device_view(x), device_view(out)
    if x.shape != out.shape:
        raise ValueError(f"scale_gpu: x and out differ in size: {x.shape}, {out.shape}")
    if out.shape[0]:
        _scale_kernel[grid(out.shape[0]) + (stream,)](x, factor, out)
