"""Layer normalization of the rows of a (rows, D) array, forward and backward, each in one
parallel pass over the rows (numpy: about ten array passes each way).

Per row, one read of the row takes the statistics in float64 (sums of v = x - x[i, 0] and
v^2: the shift keeps the variance from cancelling when |mean| >> std), and with them the
backward's sums of ct gamma and ct gamma v; a second read writes the output in x's dtype
(float32: twice float64's SIMD lanes), as the op's numpy reference (graphdist/ops/
layer_norm.py) and PyTorch compute it, so they agree to float32 rounding.

The sums are what cost: without fastmath's `reassoc` LLVM must add one element at a time in
source order (a 4-cycle dependency chain per element, 5-20x slower); with it they vectorize
into several lanes (`contract` lets multiply-adds fuse; NaN and infinity keep their
meaning). Every sum's order is fixed by the code and the shape, never the thread count: the
backward's dgamma/dbeta are summed per row block (BLOCKS of them, however many threads
run), then over the blocks in order, so any number of threads gives the same bits.
bench/layer_norm.py times the kernels against numpy, PyTorch and a copy of the bytes."""


from __future__ import annotations

import numpy as np
from numba import njit, prange

from .common import threads_for

FASTMATH = {"reassoc", "contract"}
BLOCKS = 64    # row blocks of the backward's dgamma/dbeta partial sums


def layer_norm_ref(x, gamma, beta, epsilon):
    """The spec on (R, D) rows; gamma and beta (D,) or None.

    >>> layer_norm_ref(np.array([[1.0, 3.0]]), None, None, 0.0)
    array([[-1.,  1.]])
    """
    xa = x.astype(np.float64)
    d = xa - xa.mean(axis=1, keepdims=True)
    y = d / np.sqrt((d * d).mean(axis=1, keepdims=True) + epsilon)
    if gamma is not None:
        y = y * gamma
    if beta is not None:
        y = y + beta
    return y.astype(x.dtype)


def layer_norm_grad_ref(ct, x, gamma, epsilon):
    """(dx, dgamma, dbeta) of layer_norm_ref on (R, D) rows."""
    xa, cta = x.astype(np.float64), ct.astype(np.float64)
    d = xa - xa.mean(axis=1, keepdims=True)
    rstd = 1.0 / np.sqrt((d * d).mean(axis=1, keepdims=True) + epsilon)
    xhat = d * rstd
    g = cta * gamma if gamma is not None else cta
    dx = rstd * (g - g.mean(axis=1, keepdims=True)
                 - xhat * (g * xhat).mean(axis=1, keepdims=True))
    return (dx.astype(x.dtype), (cta * xhat).sum(axis=0).astype(x.dtype),
            cta.sum(axis=0).astype(x.dtype))


@njit(cache=True, inline="always", fastmath=FASTMATH)
def _row_stats(x, i, epsilon):
    # mean and 1/sqrt(var + eps) of row i in one pass: float64 sums of v = x - x[i, 0] and
    # v^2 (the shift keeps mean(v^2) - mean(v)^2 from cancelling when |mean| >> std)
    n = x.shape[1]
    shift = x[i, 0]
    total, squares = 0.0, 0.0
    for j in range(n):
        v = np.float64(x[i, j] - shift)
        total += v
        squares += v * v
    mean_v = total / n
    return mean_v + shift, 1.0 / np.sqrt(max(squares / n - mean_v * mean_v, 0.0) + epsilon)


@njit(parallel=True, cache=True, fastmath=FASTMATH)
def _forward(x, gamma, beta, epsilon, out):  # x, out (R, D); gamma, beta (D,)
    for i in prange(x.shape[0]):
        mean, rstd = _row_stats(x, i, epsilon)
        m, r = x.dtype.type(mean), x.dtype.type(rstd)
        for j in range(x.shape[1]):
            out[i, j] = (x[i, j] - m) * r * gamma[j] + beta[j]


@njit(parallel=True, cache=True, fastmath=FASTMATH)
def _backward(ct, x, gamma, epsilon, dx, partial_g, partial_b):
    # dx (R, D); partial_g, partial_b (blocks, D): each row block's sums of ct xhat and ct.
    # Per row, one pass takes the statistics and the sums of g = ct gamma and g v (v = x -
    # x[i, 0], as _row_stats), the second writes dx and adds to the block's sums
    rows, n = x.shape
    blocks = partial_g.shape[0]
    per_block = (rows + blocks - 1) // blocks
    for b in prange(blocks):
        acc_g, acc_b = partial_g[b], partial_b[b]
        acc_g[:] = 0
        acc_b[:] = 0
        for i in range(b * per_block, min(rows, (b + 1) * per_block)):
            shift = x[i, 0]
            total, squares, sum_g, sum_gv = 0.0, 0.0, 0.0, 0.0
            for j in range(n):
                v = np.float64(x[i, j] - shift)
                g = np.float64(ct[i, j] * gamma[j])
                total += v
                squares += v * v
                sum_g += g
                sum_gv += g * v
            mean_v, mean_g = total / n, sum_g / n
            rstd = 1.0 / np.sqrt(max(squares / n - mean_v * mean_v, 0.0) + epsilon)
            mean_gx = (sum_gv / n - mean_v * mean_g) * rstd     # mean(g xhat)
            m, r = x.dtype.type(mean_v + shift), x.dtype.type(rstd)
            mg, mgx = x.dtype.type(mean_g), x.dtype.type(mean_gx)
            for j in range(n):
                xhat = (x[i, j] - m) * r
                dx[i, j] = r * (ct[i, j] * gamma[j] - mg - xhat * mgx)
                acc_g[j] += ct[i, j] * xhat
                acc_b[j] += ct[i, j]


@njit(cache=True)
def _sum_blocks(partial, out):   # out = partial.sum(axis=0), in float64, blocks in order
    acc = np.zeros(partial.shape[1])
    for b in range(partial.shape[0]):
        for j in range(partial.shape[1]):
            acc[j] += partial[b, j]
    for j in range(partial.shape[1]):
        out[j] = acc[j]


def _rows(a, d):
    return a.reshape(-1, d)


def _runs(*arrays) -> bool:
    return all(a.dtype == arrays[0].dtype and a.dtype in (np.float32, np.float64)
               and a.flags.c_contiguous for a in arrays if a is not None)


def layer_norm_cpu(x, gamma, beta, epsilon, naxes, out) -> bool:
    """out = layer norm of x over its last `naxes` axes, for same-dtype float32/float64
    C-contiguous arrays (gamma, beta: the normalized shape, or None); returns False (doing
    nothing) otherwise."""
    if not _runs(x, gamma, beta, out) or x.size == 0:
        return False
    d = int(np.prod(x.shape[x.ndim - naxes:]))
    ones = np.ones(d, x.dtype) if gamma is None else gamma.reshape(-1)
    zeros = np.zeros(d, x.dtype) if beta is None else beta.reshape(-1)
    with threads_for(2 * x.nbytes):
        _forward(_rows(x, d), ones, zeros, epsilon, _rows(out, d))
    return True


def layer_norm_grad_cpu(ct, x, gamma, epsilon, naxes, dx, dgamma=None, dbeta=None) -> bool:
    """dx (and dgamma, dbeta where given) of layer_norm_cpu, as layer_norm_grad_ref; False
    (doing nothing) where layer_norm_cpu would refuse."""
    if not _runs(ct, x, gamma, dx, dgamma, dbeta) or x.size == 0:
        return False
    d = int(np.prod(x.shape[x.ndim - naxes:]))
    blocks = min(BLOCKS, x.size // d)
    partial_g, partial_b = np.empty((blocks, d), x.dtype), np.empty((blocks, d), x.dtype)
    with threads_for(3 * x.nbytes):
        _backward(_rows(ct, d), _rows(x, d),
                  np.ones(d, x.dtype) if gamma is None else gamma.reshape(-1), epsilon,
                  _rows(dx, d), partial_g, partial_b)
    for partial, out in ((partial_g, dgamma), (partial_b, dbeta)):
        if out is not None:
            _sum_blocks(partial, out.reshape(-1))
    return True
