"""Adam and AdamW (TF epsilon placement, formulas.adam) as fused kernels, taking the
adam_update op's argument order (p, m, v, g). Callers pass the bias-corrected
lr_t = lr * sqrt(1 - b2^t) / (1 - b1^t), and AdamW's decoupled decay as weight_decay_lr = lr * wd,
or the float64 AdamHyper vector a compiled step makes (`hyper`: on the device for the GPU).

Multi-tensor form. CPU: one njit(parallel) call takes typed Lists of flat views and pranges over
a (tensor, start, stop) table of 64K-element chunks, so tiny and huge tensors share the threads.
GPU: one launch per call, on the caller's stream, over a device table of the tensors'
addresses and a table of (tensor, start, stop) chunks, one block per chunk (common.gpu_tables:
passing the tensors themselves costs numba ~6 us of CPU per array per launch).

Measured: 16M float32 params in 50 tensors (3.6K..2.2M), shared 2-core AMD EPYC VM, 30
interleaved rounds, GB/s at 7*4 B/param, best (median under load): adam_multi_cpu 86 (28..53);
numpy out= unfused 16 (10..13.5), 3.5-5x slower; probe a += s*b at 12 B/param 78..90 (30..49),
so the fused update runs at the bandwidth limit. Rebuilding 4 typed Lists costs ~0.4-0.8 ms.
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
from .formulas import AdamHyper, adam, adam_scalars, scalar_form

# the one Adam formula (formulas.adam), compiled for the loops below; arguments in the
# adam_update op's order (p, m, v, g), as every function here takes them
_adam_cpu_math = njit(error_model="numpy", cache=True)(scalar_form(adam))
_adam_gpu_math = cuda.jit(device=True)(scalar_form(adam))
_adam_gpu_hyper = cuda.jit(device=True)(adam_scalars)


def adam_ref(p, m, v, g, lr_t, beta_1, beta_2, epsilon, weight_decay_lr=0.0):
    """The spec: returns new (p, m, v), formulas.adam over whole arrays, with the scalars
    rounded to the arrays' dtype (as numpy rounds Python floats, NEP 50). weight_decay_lr
    != 0 makes it AdamW.

    >>> adam_ref(np.ones(1), np.zeros(1), np.zeros(1), np.ones(1), 0.1, 0.0, 0.0, 0.0)[0]
    array([0.9])
    """
    return adam(p, m, v, g, *_host_scalars(p, lr_t, beta_1, beta_2, epsilon, weight_decay_lr))


def adamw_ref(p, m, v, g, lr_t, beta_1, beta_2, epsilon, weight_decay_lr):
    """AdamW's spec: p -= weight_decay_lr * p (weight_decay_lr = lr * wd), then the Adam step.

    >>> adamw_ref(np.ones(1), np.zeros(1), np.zeros(1), np.zeros(1), 0.1, 0.9, 0.9, 1.0, 0.5)[0]
    array([0.5])
    """
    return adam_ref(p, m, v, g, lr_t, beta_1, beta_2, epsilon, weight_decay_lr)


def _host_scalars(like, lr_t, beta_1, beta_2, epsilon, weight_decay_lr, hyper=None) -> tuple:
    """The formula's scalars in `like`'s dtype, from numbers or a host hyper vector."""
    if hyper is not None:
        return adam_scalars(AdamHyper.decode(hyper).encode(), like)
    if lr_t is None:
        raise TypeError("adam: pass lr_t (a number) or hyper (a hyper-parameter vector)")
    values = (float(x) for x in (lr_t, beta_1, beta_2, epsilon, weight_decay_lr))
    return adam_scalars(AdamHyper(*values).encode(), like)


@njit(parallel=True, fastmath=False, error_model="numpy", cache=True)
def _adam_flat(p, m, v, g, lr_t, b1, c1, b2, c2, eps, wd):  # p, m, v, g: (n,)
    if g.size != p.size or m.size != p.size or v.size != p.size:
        raise ValueError("adam: p, m, v and g differ in size")
    for i in prange(p.size):
        p[i], m[i], v[i] = _adam_cpu_math(p[i], m[i], v[i], g[i], lr_t, b1, c1, b2, c2, eps, wd)


def adam_cpu(p, m, v, g, lr_t=None, beta_1=0.9, beta_2=0.999, epsilon=1e-7, weight_decay_lr=0.0,
             hyper=None) -> None:
    """Update p, m, v in place on the host; matches adam_ref bit for bit. `hyper`, a host
    AdamHyper vector (as the adam_update op takes it), replaces the numbers.

    >>> p, m, v, g = (np.full(3, x, np.float32) for x in (1, 0, 0, 1))
    >>> adam_cpu(p, m, v, g, 0.1, 0.0, 0.0, 0.0); p
    array([0.9, 0.9, 0.9], dtype=float32)
    """
    g = readable(g)
    same_dtype("adam_cpu", p, m, v, g)
    scalars = _host_scalars(p, lr_t, beta_1, beta_2, epsilon, weight_decay_lr, hyper)
    with threads_for(4 * p.nbytes):
        _adam_flat(flat(p), flat(m), flat(v), flat(g), *scalars)


def adamw_cpu(p, m, v, g, lr_t, beta_1, beta_2, epsilon, weight_decay_lr) -> None:
    """adam_cpu with AdamW's decoupled decay (weight_decay_lr = lr * wd, applied first).

    >>> p, m, v, g = (np.full(2, x) for x in (1.0, 0.0, 0.0, 0.0))
    >>> adamw_cpu(p, m, v, g, 0.1, 0.9, 0.999, 1.0, 0.5); p
    array([0.5, 0.5])
    """
    adam_cpu(p, m, v, g, lr_t, beta_1, beta_2, epsilon, weight_decay_lr)


@njit(parallel=True, fastmath=False, error_model="numpy", cache=True)
def _adam_multi(ps, ms, vs, gs, lr_t, b1, c1, b2, c2, eps, wd):  # lists of (n_t,)
    check_sizes(ps, ms)
    check_sizes(ps, vs)
    check_sizes(ps, gs)
    table = chunk_table(sizes_of(ps), CHUNK)
    for r in prange(table.shape[0]):
        t, start, stop = table[r, 0], table[r, 1], table[r, 2]
        # chunk views indexed from 0: numba then drops the wraparound checks and LLVM vectorizes
        p, m = ps[t][start:stop], ms[t][start:stop]
        v, g = vs[t][start:stop], gs[t][start:stop]
        for i in range(stop - start):
            p[i], m[i], v[i] = _adam_cpu_math(p[i], m[i], v[i], g[i], lr_t, b1, c1, b2, c2, eps, wd)


def adam_multi_cpu(
    params: Sequence,
    ms: Sequence,
    vs: Sequence,
    grads: Sequence,
    lr_t=None,
    beta_1=0.9,
    beta_2=0.999,
    epsilon=1e-7,
    weight_decay_lr=0.0,
    hyper=None,
) -> None:
    """adam_cpu over every tensor of a device in one parallel call (AdamW when weight_decay_lr);
    `hyper` as for adam_cpu.

    Lists may be Python sequences of arrays or typed Lists from common.tensor_list.

    >>> ps, zs = [np.ones(2), np.ones(5)], [np.zeros(2), np.zeros(5)]
    >>> adam_multi_cpu(ps, zs, [z.copy() for z in zs], ps, 0.1, 0.0, 0.0, 0.0); ps[1][0]
    np.float64(0.9)
    """
    if len(params) == 0:
        return
    scalars = _host_scalars(params[0], lr_t, beta_1, beta_2, epsilon, weight_decay_lr, hyper)
    for group in tuple_groups(params, ms, vs, readables(grads)):
        ps, ms_, vs_, gs = tensor_group(*group)
        same_dtype("adam_multi_cpu", ps, ms_, vs_, gs)
        with threads_for(4 * sum(a.nbytes for a in group[0])):   # the caller's list: no boxing
            _adam_multi(ps, ms_, vs_, gs, *scalars)


def adamw_multi_cpu(params, ms, vs, grads, lr_t, beta_1, beta_2, epsilon, weight_decay_lr):
    """adam_multi_cpu with AdamW's decoupled decay (weight_decay_lr = lr * wd).

    >>> adamw_multi_cpu([np.ones(2)], [np.zeros(2)], [np.zeros(2)], [np.zeros(2)],
    ...                 0.1, 0.9, 0.999, 1.0, 0.5)
    """
    adam_multi_cpu(params, ms, vs, grads, lr_t, beta_1, beta_2, epsilon, weight_decay_lr)


# The CUDA kernels read the hyper-parameters from the AdamHyper float64 device vector: a
# compiled step computes it on the device from the iteration count and the optimizer's
# variables, and reading it on the host would stall the stream. Each thread rounds them to
# the parameters' dtype with formulas.adam_scalars, as the host does.
def _device_hyper(hyper, lr_t, beta_1, beta_2, epsilon, weight_decay_lr):
    if hyper is None:          # host numbers: one small copy to the device per call
        if lr_t is None:
            raise TypeError("adam_gpu: pass lr_t (a number) or hyper (a device vector)")
        hyper = AdamHyper(lr_t, beta_1, beta_2, epsilon, weight_decay_lr).encode()
    return device_hyper(hyper, (4, 5))


@cuda.jit(cache=True)
def _adam_kernel(p, m, v, g, hyper):  # p, m, v, g: (n,); hyper: (4,) or (5,) float64
    i = cuda.grid(1)
    if i < p.shape[0]:
        lr_t, b1, c1, b2, c2, eps, wd = _adam_gpu_hyper(hyper, p)
        p[i], m[i], v[i] = _adam_gpu_math(p[i], m[i], v[i], g[i], lr_t, b1, c1, b2, c2, eps, wd)


def adam_gpu(p, m, v, g, lr_t=None, beta_1=0.9, beta_2=0.999, epsilon=1e-7, weight_decay_lr=0.0,
             stream=0, hyper=None) -> None:
    """Launch the update of one device buffer on `stream` (a numba stream or 0); no sync.
    `hyper`, the float64 device vector a compiled step makes (an AdamHyper: [lr_t, beta_1,
    beta_2, epsilon] or [..., weight_decay_lr]), replaces the numbers.

    >>> adam_gpu(p, m, v, g, lr_t, 0.9, 0.999, 1e-7)  # device arrays  # doctest: +SKIP
    """
    hyper = _device_hyper(hyper, lr_t, beta_1, beta_2, epsilon, weight_decay_lr)
    same_dtype("adam_gpu", p, m, v, g)
    p, m, v, g = (device_view(x) for x in (p, m, v, g))
    if not (p.shape == m.shape == v.shape == g.shape):
        raise ValueError(
            f"adam: p, m, v and g differ in size: {p.shape}, {m.shape}, {v.shape}, {g.shape}"
        )
    if p.shape[0]:
        _adam_kernel[grid(p.shape[0]) + (stream,)](p, m, v, g, hyper)


def adamw_gpu(p, m, v, g, lr_t, beta_1, beta_2, epsilon, weight_decay_lr, stream=0) -> None:
    """adam_gpu with AdamW's decoupled decay (weight_decay_lr = lr * wd).

    >>> adamw_gpu(p, m, v, g, lr_t, 0.9, 0.999, 1e-7, lr * 0.004)  # doctest: +SKIP
    """
    adam_gpu(p, m, v, g, lr_t, beta_1, beta_2, epsilon, weight_decay_lr, stream)


@cuda.jit(cache=True)
def _adam_multi_kernel(addresses, chunks, like, hyper):  # see common.gpu_tables
    row = cuda.blockIdx.x
    t, start, stop = chunks[row, 0], chunks[row, 1], chunks[row, 2]
    p, m = at_address(addresses[t, 0], like), at_address(addresses[t, 1], like)
    v, g = at_address(addresses[t, 2], like), at_address(addresses[t, 3], like)
    lr_t, b1, c1, b2, c2, eps, wd = _adam_gpu_hyper(hyper, like)
    for i in range(start + cuda.threadIdx.x, stop, cuda.blockDim.x):
        p[i], m[i], v[i] = _adam_gpu_math(p[i], m[i], v[i], g[i], lr_t, b1, c1, b2, c2, eps, wd)


def adam_multi_gpu(
    params: Sequence,
    ms: Sequence,
    vs: Sequence,
    grads: Sequence,
    lr_t=None,
    beta_1=0.9,
    beta_2=0.999,
    epsilon=1e-7,
    weight_decay_lr=0.0,
    stream=0,
    hyper=None,
) -> None:
    """adam_gpu over every tensor of a device in one launch on `stream`, whatever their
    number (each block updates one chunk of one tensor); `hyper` as for adam_gpu.

    >>> adam_multi_gpu(ps, ms, vs, gs, lr_t, 0.9, 0.999, 1e-7)  # doctest: +SKIP
    """
    if len(params) == 0:
        return
    same_dtype("adam_multi_gpu", *params, *ms, *vs, *grads)
    hyper = _device_hyper(hyper, lr_t, beta_1, beta_2, epsilon, weight_decay_lr)
    table = gpu_tables(params, ms, vs, grads)
    if table.blocks:
        _adam_multi_kernel[table.blocks, THREADS, stream](table.addresses, table.chunks,
                                                          table.like, hyper)


def adamw_multi_gpu(
    params, ms, vs, grads, lr_t, beta_1, beta_2, epsilon, weight_decay_lr, stream=0
) -> None:
    """adam_multi_gpu with AdamW's decoupled decay (weight_decay_lr = lr * wd).

    >>> adamw_multi_gpu(ps, ms, vs, gs, lr_t, 0.9, 0.999, 1e-7, lr * 0.004)  # doctest: +SKIP
    """
    adam_multi_gpu(params, ms, vs, grads, lr_t, beta_1, beta_2, epsilon, weight_decay_lr, stream)
