"""select (numpy's `where(c, x, y)`) into a preallocated buffer, in one parallel pass: numpy's
masked copyto needs two passes and a mask inversion and is ~10x slower on CPU."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .common import threads_for


def select_ref(c, x, y):
    """The spec: np.where.

    >>> select_ref(np.array([True, False]), np.ones(2), 0.0)
    array([1., 0.])
    """
    return np.where(c, x, y)


@njit(parallel=True, cache=True, error_model="numpy")
def _select_scalar(c, x, y, out):  # c, x, out: (n,); y: scalar
    for i in prange(out.size):
        out[i] = x[i] if c[i] else y


@njit(parallel=True, cache=True, error_model="numpy")
def _select_arrays(c, x, y, out):  # all (n,)
    for i in prange(out.size):
        out[i] = x[i] if c[i] else y[i]


def select_cpu(c, x, y, out) -> bool:
    """out = where(c, x, y) when c, x, out (and y, unless 0-d) are same-shape contiguous
    arrays; returns False (doing nothing) for anything else, so the caller can fall back."""
    if not (c.shape == x.shape == out.shape and c.flags.c_contiguous and x.flags.c_contiguous
            and out.flags.c_contiguous and x.dtype == out.dtype):
        return False
    if y.ndim == 0:
        with threads_for(2 * out.nbytes):
            _select_scalar(c.reshape(-1), x.reshape(-1), out.dtype.type(y), out.reshape(-1))
        return True
    if y.shape == out.shape and y.flags.c_contiguous and y.dtype == out.dtype:
        with threads_for(3 * out.nbytes):
            _select_arrays(c.reshape(-1), x.reshape(-1), y.reshape(-1), out.reshape(-1))
        return True
    return False
