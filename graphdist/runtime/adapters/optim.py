"""Kernel adapters of the optimizer updates: the Numba CPU and CUDA kernels of
kernels/sgd.py and kernels/adam.py, in place on the donated buffers, and their numpy twins
(runtime/numpy_updates.py, which give their bits).

`hyper` is the update's float64 hyper-parameter vector (kernels/formulas.py's SGDHyper,
MomentumHyper, AdamHyper): the kernels read it themselves, rounded to the parameters'
dtype. The kernels take the ops' argument order (p, m, v, g); the multi-tensor forms take
their inputs grouped per variable (p0 m0 v0 g0 p1 ...), then the hyper vector.
"""

from __future__ import annotations

import numpy as np

from graphdist.device.gpu import CUDA_KERNELS
from graphdist.runtime import numpy_updates
from graphdist.runtime.adapters.registry import OP_IMPL, register_kernel

# ---------------------------------------------------------------- CPU


@register_kernel("sgd_update", kind="cpu", numpy=numpy_updates.sgd, exact=True)
def sgd_cpu(p, g, hyper):
    from graphdist.kernels.sgd import sgd_cpu

    sgd_cpu(p, None, g, hyper=hyper)


@register_kernel("sparse_sgd_update", kind="cpu", numpy=OP_IMPL, exact=True)
def sparse_sgd_cpu(p, indices, rows, hyper):
    """p[indices] -= lr * rows in place, whole rows at a time; with weight decay (every row
    decays) the op's dense reference."""
    from graphdist.kernels.formulas import SGDHyper
    from graphdist.kernels.sparse import add_scaled_rows_cpu
    from graphdist.ops.optim import _sparse_sgd_impl
    from graphdist.ops.sparse import check_slices

    named = SGDHyper.decode(hyper)
    if named.weight_decay or p.dtype.kind != "f" or not p.flags.c_contiguous:
        p[...] = _sparse_sgd_impl(np, p, indices, rows, hyper)
        return
    check_slices(np, indices, p.shape[0])
    add_scaled_rows_cpu(p, indices, rows, -p.dtype.type(named.lr))


@register_kernel("sgd_momentum_update", kind="cpu", numpy=numpy_updates.momentum, exact=True)
def momentum_cpu(p, m, g, hyper, *, nesterov):
    from graphdist.kernels.sgd import sgd_cpu

    sgd_cpu(p, m, g, nesterov=nesterov, hyper=hyper)


@register_kernel("adam_update", kind="cpu", numpy=numpy_updates.adam, exact=True)
def adam_cpu(p, m, v, g, hyper):
    from graphdist.kernels.adam import adam_cpu

    adam_cpu(p, m, v, g, hyper=hyper)


@register_kernel("sgd_multi_update", kind="cpu", numpy=numpy_updates.sgd_multi, exact=True)
def sgd_multi_cpu(*arrays, n):
    from graphdist.kernels.sgd import sgd_multi_cpu

    sgd_multi_cpu(arrays[0:2 * n:2], None, arrays[1:2 * n:2], hyper=arrays[2 * n])


@register_kernel("sgd_momentum_multi_update", kind="cpu", numpy=numpy_updates.momentum_multi,
                 exact=True)
def momentum_multi_cpu(*arrays, n, nesterov):
    from graphdist.kernels.sgd import sgd_multi_cpu

    sgd_multi_cpu(*_per_kind(arrays, n, 3), nesterov=nesterov, hyper=arrays[3 * n])


@register_kernel("adam_multi_update", kind="cpu", numpy=numpy_updates.adam_multi, exact=True)
def adam_multi_cpu(*arrays, n):
    from graphdist.kernels.adam import adam_multi_cpu

    adam_multi_cpu(*_per_kind(arrays, n, 4), hyper=arrays[4 * n])


def _per_kind(arrays, n: int, k: int) -> list:
    """The multi-tensor op's inputs (k per variable, then the hyper vector) as k lists: every
    variable's p, every m, ..., every g (the kernels' lists, in the op's order)."""
    return [arrays[i:k * n:k] for i in range(k)]


# ---------------------------------------------------------------- GPU
# launched on the stream of the device running the node, in place on the donated buffers;
# the kernels read the hyper vector on the device (no host sync). No numpy twin: with fused
# kernels off, or in a deferred first program, the op's CuPy impl runs.

def _stream():
    from graphdist.device.gpu import current_numba_stream

    return current_numba_stream()


@register_kernel("sgd_multi_update", kind=CUDA_KERNELS)
def sgd_multi_gpu(*arrays, n):
    from graphdist.kernels.sgd import sgd_multi_gpu

    sgd_multi_gpu(arrays[0:2 * n:2], None, arrays[1:2 * n:2], stream=_stream(),
                  hyper=arrays[2 * n])


@register_kernel("sgd_momentum_multi_update", kind=CUDA_KERNELS)
def momentum_multi_gpu(*arrays, n, nesterov):
    from graphdist.kernels.sgd import sgd_multi_gpu

    sgd_multi_gpu(*_per_kind(arrays, n, 3), nesterov=nesterov, stream=_stream(),
                  hyper=arrays[3 * n])


@register_kernel("adam_multi_update", kind=CUDA_KERNELS)
def adam_multi_gpu(*arrays, n):
    from graphdist.kernels.adam import adam_multi_gpu

    adam_multi_gpu(*_per_kind(arrays, n, 4), stream=_stream(), hyper=arrays[4 * n])


@register_kernel("sgd_update", kind=CUDA_KERNELS)
def sgd_gpu(p, g, hyper):
    sgd_multi_gpu(p, g, hyper, n=1)


@register_kernel("sgd_momentum_update", kind=CUDA_KERNELS)
def momentum_gpu(p, m, g, hyper, *, nesterov):
    momentum_multi_gpu(p, m, g, hyper, n=1, nesterov=nesterov)


@register_kernel("adam_update", kind=CUDA_KERNELS)
def adam_gpu(p, m, v, g, hyper):
    adam_multi_gpu(p, m, v, g, hyper, n=1)
