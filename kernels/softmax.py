"""Softmax over the last axis of (rows, n) arrays under an optional bool mask, and its
gradient, in parallel passes over the rows.

Per row the forward takes the max over kept entries and writes x - max (-inf where
masked); numpy's vectorized exp follows (Numba calls the C library's exp one element at a
time: 5x slower here), then each row is divided by its float64 sum. A row with no kept
entry comes out all zeros, as the op's numpy reference (graphdist/ops/softmax.py)
defines. So three passes, not numpy's seven. The gradient is
y (g - sum(g y)) per row. Every sum runs in source order (no fastmath), so the bits depend
on the shape alone, never on the thread count; they differ from numpy's (its exp and its
pairwise float32 sums) by float32 rounding."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .common import threads_for


@njit(parallel=True, cache=True)
def _shift_all(x, out):          # x, out (R, n): _shift with every entry kept
    # the max as a select, not a branch, and the subtraction hoisted out of the -inf test:
    # both loops vectorize (0.15 against 0.28 ms on 8192 x 64), the same max and the same
    # bits (a NaN never compares greater, so it is skipped either way)
    rows, n = x.shape
    for i in prange(rows):
        top = -np.inf
        for j in range(n):
            v = x[i, j]
            top = v if v > top else top
        if top > -np.inf:
            for j in range(n):
                out[i, j] = x[i, j] - top
        else:
            for j in range(n):
                out[i, j] = -np.inf


@njit(parallel=True, cache=True)
def _shift(x, mask, out):        # x, out (R, n); mask (M, n) bool, row i uses mask[i % M]
    # out = x - max over the row's kept entries, -inf where masked or nothing is kept
    rows, n = x.shape
    for i in prange(rows):
        keep = mask[i % mask.shape[0]]
        top = -np.inf
        for j in range(n):
            if keep[j] and x[i, j] > top:
                top = x[i, j]
        for j in range(n):
            out[i, j] = x[i, j] - top if keep[j] and top > -np.inf else -np.inf


@njit(cache=True, inline="always")
def _dot(a, b):
    # sum of a[j] b[j] in float64 over four fixed lanes (j mod 4), added in a fixed
    # order: four dependency chains rather than one, the same bits on any thread count
    n = a.shape[0]
    s0, s1, s2, s3 = 0.0, 0.0, 0.0, 0.0
    for j in range(0, n - 3, 4):
        s0 += np.float64(a[j] * b[j])
        s1 += np.float64(a[j + 1] * b[j + 1])
        s2 += np.float64(a[j + 2] * b[j + 2])
        s3 += np.float64(a[j + 3] * b[j + 3])
    for j in range(n - n % 4, n):
        s0 += np.float64(a[j] * b[j])
    return (s0 + s1) + (s2 + s3)


@njit(cache=True, inline="always")
def _sum(a):
    # _dot(a, ones): the same lanes and order, without the multiplies by one (exact)
    n = a.shape[0]
    s0, s1, s2, s3 = 0.0, 0.0, 0.0, 0.0
    for j in range(0, n - 3, 4):
        s0 += np.float64(a[j])
        s1 += np.float64(a[j + 1])
        s2 += np.float64(a[j + 2])
        s3 += np.float64(a[j + 3])
    for j in range(n - n % 4, n):
        s0 += np.float64(a[j])
    return (s0 + s1) + (s2 + s3)


@njit(parallel=True, cache=True)
def _normalize(e):                     # e (R, n) = exp(shifted): divide each row by its sum
    rows, n = e.shape
    for i in prange(rows):
        total = _sum(e[i])
        t = e.dtype.type(total if total > 0.0 else 1.0)
        for j in range(n):
            e[i, j] = e[i, j] / t


@njit(parallel=True, cache=True)
def _backward(g, y, out):        # out = y (g - sum(g y)) per row; all (R, n)
    rows, n = y.shape
    for i in prange(rows):
        s = y.dtype.type(_dot(g[i], y[i]))
        for j in range(n):
            out[i, j] = y[i, j] * (g[i, j] - s)


def _runs(*arrays) -> bool:
    return all(a.dtype == arrays[0].dtype and a.dtype in (np.float32, np.float64)
               and a.flags.c_contiguous for a in arrays) and arrays[0].size > 0


def _mask_rows(mask, shape):
    """mask as (M, n) rows that row i of the (R, n) logits reads as row i % M: a mask that
    broadcasts over leading axes only is reshaped, any other broadcast materialized."""
    n = shape[-1]
    if mask is None:
        return np.ones((1, n), np.bool_)
    if mask.ndim and tuple(mask.shape) == tuple(shape[len(shape) - mask.ndim:]):
        return np.ascontiguousarray(mask, np.bool_).reshape(-1, n)
    return np.ascontiguousarray(np.broadcast_to(mask, shape), np.bool_).reshape(-1, n)


def softmax_cpu(x, mask, out) -> bool:
    """out = softmax of x over its last axis, entries where the bool `mask` (broadcasting to
    x, or None) is False getting 0; for same-dtype float32/float64 C-contiguous x and out.
    Returns False (doing nothing) otherwise."""
    if not _runs(x, out):
        return False
    n = x.shape[-1]
    rows = out.reshape(-1, n)
    with threads_for(2 * x.nbytes):
        if mask is None:
            _shift_all(x.reshape(-1, n), rows)
        else:
            _shift(x.reshape(-1, n), _mask_rows(mask, x.shape), rows)
        np.exp(rows, out=rows)                   # numpy's SIMD exp: Numba's is scalar
        _normalize(rows)
    return True


def softmax_grad_cpu(g, y, out) -> bool:
    """out = y (g - sum(g y)) over the last axis (softmax's gradient, y its output); False
    (doing nothing) where softmax_cpu would refuse."""
    if not _runs(g, y, out) or g.shape != y.shape:
        return False
    n = y.shape[-1]
    with threads_for(3 * y.nbytes):
        _backward(g.reshape(-1, n), y.reshape(-1, n), out.reshape(-1, n))
    return True
