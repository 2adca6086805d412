"""SGD with momentum, Nesterov and coupled weight decay (torch.optim.SGD), as fused kernels.

sgd_ref is the spec. sgd_cpu/sgd_gpu update one buffer in place; sgd_multi_cpu/_gpu update every
parameter of a device in one call (see adam.py for the multi-tensor layout and its numbers).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numba import cuda, njit, prange

from .common import (
    CHUNK,
    check_sizes,
    chunk_table,
    device_hyper,
    device_view,
    flat,
    gpu_groups,
    grid,
    multi_grid,
    readable,
    readables,
    same_dtype,
    tensor_group,
    tuple_groups,
    threads_for,
)


def _sgd_math(p, g, m, lr, momentum, weight_decay, nesterov):
    if weight_decay != 0:
        g = g + weight_decay * p
    if momentum != 0:
        m = momentum * m + g
        step = g + momentum * m if nesterov else m
    else:
        step = g
    return p - lr * step, m


_sgd_cpu_math = njit(error_model="numpy", cache=True)(_sgd_math)
_sgd_gpu_math = cuda.jit(device=True)(_sgd_math)


def sgd_ref(p, g, m, lr, momentum=0.0, nesterov=False, weight_decay=0.0):
    """The spec: returns new (p, m); m may be None when momentum is 0.

    Scalars are Python floats, so numpy computes in the arrays' dtype (NEP 50).

    >>> sgd_ref(np.ones(2), np.ones(2), np.zeros(2), lr=0.5, momentum=0.9)[0]
    array([0.5, 0.5])
    """
    lr, momentum, weight_decay = float(lr), float(momentum), float(weight_decay)
    if weight_decay:
        g = g + weight_decay * p
    if momentum:
        m = momentum * m + g
        step = g + momentum * m if nesterov else m
    else:
        step = g
    return p - lr * step, m


def _scalars(dtype, lr, momentum, weight_decay, m):
    if momentum and m is None:
        raise ValueError("sgd: momentum != 0 needs a momentum buffer m, got None")
    dt = np.dtype(dtype).type
    return dt(lr), dt(momentum), dt(weight_decay)


@njit(parallel=True, fastmath=False, error_model="numpy", cache=True)
def _sgd_flat(p, g, m, lr, momentum, weight_decay, nesterov):  # p, g, m: (n,)
    if g.size != p.size or m.size != p.size:
        raise ValueError("sgd: p, g and m differ in size")
    for i in prange(p.size):
        pi, mi = _sgd_cpu_math(p[i], g[i], m[i], lr, momentum, weight_decay, nesterov)
        p[i] = pi
        if momentum != 0:
            m[i] = mi


def sgd_cpu(p, g, m, lr, momentum=0.0, nesterov=False, weight_decay=0.0) -> None:
    """Update p (and m) in place on the host; m may be None when momentum is 0.

    >>> p = np.ones(3, np.float32); sgd_cpu(p, np.ones(3, np.float32), None, lr=0.5); p
    array([0.5, 0.5, 0.5], dtype=float32)
    """
    g = readable(g)
    same_dtype("sgd_cpu", p, g, m)
    scalars = _scalars(p.dtype, lr, momentum, weight_decay, m)
    p = flat(p)
    with threads_for(3 * p.nbytes):
        _sgd_flat(p, flat(g), p if m is None else flat(m), *scalars, bool(nesterov))


@njit(parallel=True, fastmath=False, error_model="numpy", cache=True)
def _sgd_multi(ps, gs, ms, lr, momentum, weight_decay, nesterov):  # lists of (n_t,)
    check_sizes(ps, gs)
    check_sizes(ps, ms)
    table = chunk_table(ps, CHUNK)
    for r in prange(table.shape[0]):
        t, start, stop = table[r, 0], table[r, 1], table[r, 2]
        # chunk views indexed from 0: numba then drops the wraparound checks and LLVM vectorizes
        p, g, m = ps[t][start:stop], gs[t][start:stop], ms[t][start:stop]
        for i in range(stop - start):
            pi, mi = _sgd_cpu_math(p[i], g[i], m[i], lr, momentum, weight_decay, nesterov)
            p[i] = pi
            if momentum != 0:
                m[i] = mi


def sgd_multi_cpu(
    params: Sequence,
    grads: Sequence,
    ms: Sequence | None,
    lr,
    momentum=0.0,
    nesterov=False,
    weight_decay=0.0,
) -> None:
    """sgd_cpu over every tensor of a device in one parallel call; ms may be None.

    Lists may be Python sequences of arrays or typed Lists from common.tensor_list.

    >>> ps = [np.ones(2), np.ones(5)]; sgd_multi_cpu(ps, ps, None, lr=0.5); ps[1][0]
    np.float64(0.5)
    """
    if len(params) == 0:
        return
    scalars = _scalars(params[0].dtype, lr, momentum, weight_decay, ms)
    for group in tuple_groups(params, readables(grads), params if ms is None else ms):
        ps, gs, ms_ = tensor_group(*group)
        same_dtype("sgd_multi_cpu", ps, gs, ms_)
        # sized from the caller's list: a typed List's items are boxed on access (~1 us each)
        with threads_for(3 * sum(a.nbytes for a in group[0])):
            _sgd_multi(ps, gs, ms_, *scalars, bool(nesterov))


# The CUDA kernels read the hyper-parameters from a float64 device vector, [lr, weight_decay]
# or [lr, momentum, weight_decay] with a momentum buffer: a compiled step computes it on the
# device, and reading it on the host would stall the stream. Each thread rounds them to the
# parameters' dtype as _scalars does on the host (cvt.rn), so both give the same numbers.
def _gpu_hyper(p, hyper, has_m):
    dt = p.dtype.type
    if has_m:
        return dt(hyper[0]), dt(hyper[1]), dt(hyper[2])
    return dt(hyper[0]), dt(0.0), dt(hyper[1])


_sgd_gpu_hyper = cuda.jit(device=True)(_gpu_hyper)


def _host_hyper(lr, momentum, weight_decay, m) -> list:
    if lr is None:
        raise TypeError("sgd_gpu: pass lr (a number) or hyper (a device vector)")
    if momentum and m is None:
        raise ValueError("sgd: momentum != 0 needs a momentum buffer m, got None")
    return [lr, weight_decay] if m is None else [lr, momentum, weight_decay]


@cuda.jit(cache=True)
def _sgd_kernel(p, g, m, hyper, has_m, nesterov):  # p, g, m: (n,); hyper: (2,) or (3,) f64
    i = cuda.grid(1)
    if i < p.shape[0]:
        lr, momentum, weight_decay = _sgd_gpu_hyper(p, hyper, has_m)
        pi, mi = _sgd_gpu_math(p[i], g[i], m[i], lr, momentum, weight_decay, nesterov)
        p[i] = pi
        if momentum != 0:
            m[i] = mi


def sgd_gpu(p, g, m, lr=None, momentum=0.0, nesterov=False, weight_decay=0.0, stream=0,
            hyper=None) -> None:
    """Launch the update of one device buffer on `stream` (a numba stream or 0); no sync.
    `hyper`, the float64 device vector a compiled step makes ([lr, weight_decay], or
    [lr, momentum, weight_decay] when m is given), replaces the numbers.

    >>> sgd_gpu(p, g, None, lr=0.1)  # p, g: device arrays  # doctest: +SKIP
    """
    has_m = m is not None
    values = None if hyper is not None else _host_hyper(lr, momentum, weight_decay, m)
    hyper = device_hyper(values if hyper is None else hyper, (3,) if has_m else (2,))
    same_dtype("sgd_gpu", p, g, m)
    p, g = device_view(p), device_view(g)
    m = device_view(m) if has_m else p
    if not (p.shape == g.shape == m.shape):
        raise ValueError(f"sgd: p, g and m differ in size: {p.shape}, {g.shape}, {m.shape}")
    if p.shape[0]:
        _sgd_kernel[grid(p.shape[0]) + (stream,)](p, g, m, hyper, has_m, bool(nesterov))


def sgd_multi_gpu(
    params: Sequence,
    grads: Sequence,
    ms: Sequence | None,
    lr=None,
    momentum=0.0,
    nesterov=False,
    weight_decay=0.0,
    stream=0,
    hyper=None,
) -> None:
    """sgd_gpu over every tensor of a device: one launch per 16 tensors, all on `stream`
    (each block row of the grid updates one tensor); `hyper` as for sgd_gpu.

    >>> sgd_multi_gpu([p], [g], [m], lr=0.1, momentum=0.9)  # doctest: +SKIP
    """
    if len(params) == 0:
        return
    if len(grads) != len(params) or (ms is not None and len(ms) != len(params)):
        raise ValueError("sgd_multi_gpu: the tensor lists differ in length")
    same_dtype("sgd_multi_gpu", *params, *grads, *(ms or ()))
    has_m = ms is not None
    values = None if hyper is not None else _host_hyper(lr, momentum, weight_decay, ms)
    hyper = device_hyper(values if hyper is None else hyper, (3,) if has_m else (2,))
    for (p, g, m), largest in gpu_groups(params, grads, ms if has_m else params):
        if largest:
            blocks, threads = multi_grid(largest, len(p))
            _sgd_multi_kernel[blocks, threads, stream](p, g, m, hyper, has_m, bool(nesterov))


@cuda.jit(cache=True)
def _sgd_multi_kernel(ps, gs, ms, hyper, has_m, nesterov):  # tuples of (n_t,); hyper: f64
    t = cuda.blockIdx.y                      # this block row's tensor
    p, g, m = ps[t], gs[t], ms[t]
    lr, momentum, weight_decay = _sgd_gpu_hyper(p, hyper, has_m)
    for i in range(cuda.grid(1), p.shape[0], cuda.gridDim.x * cuda.blockDim.x):
        pi, mi = _sgd_gpu_math(p[i], g[i], m[i], lr, momentum, weight_decay, nesterov)
        p[i] = pi
        if momentum != 0:
            m[i] = mi
