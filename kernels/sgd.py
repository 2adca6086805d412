"""SGD with momentum, Nesterov and coupled weight decay (torch.optim.SGD, formulas.sgd), as
fused kernels taking the update ops' argument order (p, m, g; m None for plain SGD).

sgd_ref is the spec. sgd_cpu/sgd_gpu update one buffer in place; sgd_multi_cpu/_gpu update every
parameter of a device in one call (see adam.py for the multi-tensor layout and its numbers).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np  # noqa: F401 (the examples)
from numba import cuda, njit, prange

from .common import (
    CHUNK,
    check_sizes,
    chunk_table,
    device_hyper,
    device_view,
    flat,
    THREADS,
    at_address,
    gpu_tables,
    grid,
    readable,
    readables,
    same_dtype,
    sizes_of,
    tensor_group,
    tuple_groups,
    threads_for,
)
from .formulas import MomentumHyper, SGDHyper, scalar_form, sgd, sgd_scalars

# the one SGD formula (formulas.sgd), compiled for the loops below; arguments in the update
# ops' order (p, m, g), as every function here takes them (m None: plain SGD)
_sgd_cpu_math = njit(error_model="numpy", cache=True)(scalar_form(sgd))
_sgd_gpu_math = cuda.jit(device=True)(scalar_form(sgd))
_sgd_gpu_hyper = cuda.jit(device=True)(sgd_scalars)


def sgd_ref(p, m, g, lr, momentum=0.0, nesterov=False, weight_decay=0.0):
    """The spec: returns new (p, m), formulas.sgd over whole arrays with the scalars rounded
    to the arrays' dtype (as numpy rounds Python floats, NEP 50); m may be None when
    momentum is 0.

    >>> sgd_ref(np.ones(2), np.zeros(2), np.ones(2), lr=0.5, momentum=0.9)[0]
    array([0.5, 0.5])
    """
    scalars = _host_scalars(p, lr, momentum, weight_decay, m)
    return sgd(p, m, g, *scalars, bool(nesterov))


def _host_vector(lr, momentum, weight_decay, m) -> tuple:
    """The hyper vector of these numbers: a MomentumHyper with a buffer m, else SGDHyper."""
    if lr is None:
        raise TypeError("sgd: pass lr (a number) or hyper (a hyper-parameter vector)")
    if momentum and m is None:
        raise ValueError("sgd: momentum != 0 needs a momentum buffer m, got None")
    if m is None:
        return SGDHyper(float(lr), float(weight_decay)).encode()
    return MomentumHyper(float(lr), float(momentum), float(weight_decay)).encode()


def _host_scalars(like, lr, momentum, weight_decay, m, hyper=None) -> tuple:
    """The formula's scalars in `like`'s dtype, from numbers or a host hyper vector."""
    if hyper is None:
        return sgd_scalars(_host_vector(lr, momentum, weight_decay, m), like)
    kind = SGDHyper if m is None else MomentumHyper
    return sgd_scalars(kind.decode(hyper).encode(), like)


@njit(parallel=True, fastmath=False, error_model="numpy", cache=True)
def _sgd_flat(p, m, g, lr, momentum, weight_decay, nesterov):  # p, m, g: (n,)
    if m.size != p.size or g.size != p.size:
        raise ValueError("sgd: p, m and g differ in size")
    for i in prange(p.size):
        pi, mi = _sgd_cpu_math(p[i], m[i], g[i], lr, momentum, weight_decay, nesterov)
        p[i] = pi
        if momentum != 0:
            m[i] = mi


def sgd_cpu(p, m, g, lr=None, momentum=0.0, nesterov=False, weight_decay=0.0,
            hyper=None) -> None:
    """Update p (and m) in place on the host; m may be None when momentum is 0. `hyper`, a
    host SGDHyper vector (MomentumHyper with m), as the update ops take it, replaces the
    numbers.

    >>> p = np.ones(3, np.float32); sgd_cpu(p, None, np.ones(3, np.float32), lr=0.5); p
    array([0.5, 0.5, 0.5], dtype=float32)
    """
    g = readable(g)
    same_dtype("sgd_cpu", p, m, g)
    scalars = _host_scalars(p, lr, momentum, weight_decay, m, hyper)
    p = flat(p)
    with threads_for(3 * p.nbytes):
        _sgd_flat(p, p if m is None else flat(m), flat(g), *scalars, bool(nesterov))


@njit(parallel=True, fastmath=False, error_model="numpy", cache=True)
def _sgd_multi(ps, ms, gs, lr, momentum, weight_decay, nesterov):  # lists of (n_t,)
    check_sizes(ps, ms)
    check_sizes(ps, gs)
    table = chunk_table(sizes_of(ps), CHUNK)
    for r in prange(table.shape[0]):
        t, start, stop = table[r, 0], table[r, 1], table[r, 2]
        # chunk views indexed from 0: numba then drops the wraparound checks and LLVM vectorizes
        p, m, g = ps[t][start:stop], ms[t][start:stop], gs[t][start:stop]
        for i in range(stop - start):
            pi, mi = _sgd_cpu_math(p[i], m[i], g[i], lr, momentum, weight_decay, nesterov)
            p[i] = pi
            if momentum != 0:
                m[i] = mi


def sgd_multi_cpu(
    params: Sequence,
    ms: Sequence | None,
    grads: Sequence,
    lr=None,
    momentum=0.0,
    nesterov=False,
    weight_decay=0.0,
    hyper=None,
) -> None:
    """sgd_cpu over every tensor of a device in one parallel call; ms may be None; `hyper`
    as for sgd_cpu.

    Lists may be Python sequences of arrays or typed Lists from common.tensor_list.

    >>> ps = [np.ones(2), np.ones(5)]; sgd_multi_cpu(ps, None, ps, lr=0.5); ps[1][0]
    np.float64(0.5)
    """
    if len(params) == 0:
        return
    scalars = _host_scalars(params[0], lr, momentum, weight_decay, ms, hyper)
    for group in tuple_groups(params, params if ms is None else ms, readables(grads)):
        ps, ms_, gs = tensor_group(*group)
        same_dtype("sgd_multi_cpu", ps, ms_, gs)
        # sized from the caller's list: a typed List's items are boxed on access (~1 us each)
        with threads_for(3 * sum(a.nbytes for a in group[0])):
            _sgd_multi(ps, ms_, gs, *scalars, bool(nesterov))


# The CUDA kernels read the hyper-parameters from the float64 device vector, an SGDHyper or,
# with a momentum buffer, a MomentumHyper: a compiled step computes it on the device, and
# reading it on the host would stall the stream. Each thread rounds them to the parameters'
# dtype with formulas.sgd_scalars, as the host does (cvt.rn), so both give the same numbers.
def _device_vector(hyper, lr, momentum, weight_decay, m):
    values = _host_vector(lr, momentum, weight_decay, m) if hyper is None else hyper
    return device_hyper(values, (2,) if m is None else (3,))


@cuda.jit(cache=True)
def _sgd_kernel(p, m, g, hyper, nesterov):  # p, m, g: (n,); hyper: (2,) or (3,) f64
    i = cuda.grid(1)
    if i < p.shape[0]:
        lr, momentum, weight_decay = _sgd_gpu_hyper(hyper, p)
        pi, mi = _sgd_gpu_math(p[i], m[i], g[i], lr, momentum, weight_decay, nesterov)
        p[i] = pi
        if momentum != 0:
            m[i] = mi


def sgd_gpu(p, m, g, lr=None, momentum=0.0, nesterov=False, weight_decay=0.0, stream=0,
            hyper=None) -> None:
    """Launch the update of one device buffer on `stream` (a numba stream or 0); no sync.
    `hyper`, the float64 device vector a compiled step makes (an SGDHyper, or a
    MomentumHyper when m is given), replaces the numbers.

    >>> sgd_gpu(p, None, g, lr=0.1)  # p, g: device arrays  # doctest: +SKIP
    """
    hyper = _device_vector(hyper, lr, momentum, weight_decay, m)
    same_dtype("sgd_gpu", p, m, g)
    p, g = device_view(p), device_view(g)
    m = p if m is None else device_view(m)
    if not (p.shape == m.shape == g.shape):
        raise ValueError(f"sgd: p, m and g differ in size: {p.shape}, {m.shape}, {g.shape}")
    if p.shape[0]:
        _sgd_kernel[grid(p.shape[0]) + (stream,)](p, m, g, hyper, bool(nesterov))


def sgd_multi_gpu(
    params: Sequence,
    ms: Sequence | None,
    grads: Sequence,
    lr=None,
    momentum=0.0,
    nesterov=False,
    weight_decay=0.0,
    stream=0,
    hyper=None,
) -> None:
    """sgd_gpu over every tensor of a device in one launch on `stream`, whatever their
    number (each block updates one chunk of one tensor); `hyper` as for sgd_gpu.

    >>> sgd_multi_gpu([p], [m], [g], lr=0.1, momentum=0.9)  # doctest: +SKIP
    """
    if len(params) == 0:
        return
    if len(grads) != len(params) or (ms is not None and len(ms) != len(params)):
        raise ValueError("sgd_multi_gpu: the tensor lists differ in length")
    same_dtype("sgd_multi_gpu", *params, *(ms or ()), *grads)
    hyper = _device_vector(hyper, lr, momentum, weight_decay, ms)
    table = gpu_tables(params, params if ms is None else ms, grads)
    if table.blocks:
        _sgd_multi_kernel[table.blocks, THREADS, stream](table.addresses, table.chunks,
                                                         table.like, hyper, bool(nesterov))


@cuda.jit(cache=True)
def _sgd_multi_kernel(addresses, chunks, like, hyper, nesterov):  # see common.gpu_tables
    row = cuda.blockIdx.x
    t, start, stop = chunks[row, 0], chunks[row, 1], chunks[row, 2]
    p, m = at_address(addresses[t, 0], like), at_address(addresses[t, 1], like)
    g = at_address(addresses[t, 2], like)
    lr, momentum, weight_decay = _sgd_gpu_hyper(hyper, like)
    for i in range(start + cuda.threadIdx.x, stop, cuda.blockDim.x):
        pi, mi = _sgd_gpu_math(p[i], m[i], g[i], lr, momentum, weight_decay, nesterov)
        p[i] = pi
        if momentum != 0:
            m[i] = mi
