"""Layer normalization of the rows of a (rows, D) array, forward and backward, each in one
parallel pass over the rows (numpy: about ten array passes each way). Statistics accumulate
in float64 whatever the input dtype; the op's reference (graphdist/ops/layer_norm.py) takes
them in float32 for float32 inputs, so the two agree to float32 rounding."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .common import threads_for

BLOCK = 64     # columns per task of the dgamma/dbeta column sums


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


@njit(cache=True, inline="always")
def _row_stats(x, i, epsilon):     # mean and 1/sqrt(var + eps) of row i, two passes
    n = x.shape[1]
    total = 0.0
    for j in range(n):
        total += x[i, j]
    mean = total / n
    squares = 0.0
    for j in range(n):
        d = x[i, j] - mean
        squares += d * d
    return mean, 1.0 / np.sqrt(squares / n + epsilon)


@njit(parallel=True, cache=True)
def _forward(x, gamma, beta, epsilon, out):  # x, out (R, D); gamma, beta (D,)
    for i in prange(x.shape[0]):
        mean, rstd = _row_stats(x, i, epsilon)
        for j in range(x.shape[1]):
            out[i, j] = (x[i, j] - mean) * rstd * gamma[j] + beta[j]


@njit(parallel=True, cache=True)
def _backward_rows(ct, x, gamma, epsilon, dx, means, rstds):  # dx (R, D); means, rstds (R,)
    n = x.shape[1]
    for i in prange(x.shape[0]):
        mean, rstd = _row_stats(x, i, epsilon)
        sum_g, sum_gx = 0.0, 0.0
        for j in range(n):
            g = ct[i, j] * np.float64(gamma[j])
            sum_g += g
            sum_gx += g * (x[i, j] - mean) * rstd
        mean_g, mean_gx = sum_g / n, sum_gx / n
        for j in range(n):
            xhat = (x[i, j] - mean) * rstd
            dx[i, j] = rstd * (ct[i, j] * np.float64(gamma[j]) - mean_g - xhat * mean_gx)
        means[i], rstds[i] = mean, rstd


@njit(parallel=True, cache=True)
def _backward_columns(ct, x, means, rstds, dgamma, dbeta):  # dgamma, dbeta (D,)
    rows, n = x.shape
    for b in prange((n + BLOCK - 1) // BLOCK):
        lo = b * BLOCK
        hi = min(n, lo + BLOCK)
        acc_g = np.zeros(hi - lo)
        acc_b = np.zeros(hi - lo)
        for i in range(rows):
            for j in range(lo, hi):
                c = np.float64(ct[i, j])
                acc_g[j - lo] += c * (x[i, j] - means[i]) * rstds[i]
                acc_b[j - lo] += c
        for j in range(lo, hi):
            dgamma[j] = acc_g[j - lo]
            dbeta[j] = acc_b[j - lo]


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
    rows = x.size // d
    means, rstds = np.empty(rows), np.empty(rows)
    with threads_for(3 * x.nbytes):
        _backward_rows(_rows(ct, d), _rows(x, d),
                       np.ones(d, x.dtype) if gamma is None else gamma.reshape(-1), epsilon,
                       _rows(dx, d), means, rstds)
        if dgamma is not None or dbeta is not None:
            _backward_columns(_rows(ct, d), _rows(x, d), means, rstds,
                              np.empty(d, x.dtype) if dgamma is None else dgamma.reshape(-1),
                              np.empty(d, x.dtype) if dbeta is None else dbeta.reshape(-1))
    return True
