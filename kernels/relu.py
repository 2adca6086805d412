"""relu's gradient (ct where y > 0, else 0) into a preallocated buffer in one parallel pass:
numpy needs a comparison into a bool array and a select over it (two passes)."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .common import threads_for


def relu_grad_ref(ct, y):
    """The spec: ct where y > 0, else 0 (NaN in y counts as not > 0).

    >>> relu_grad_ref(np.array([1., 2., 3.]), np.array([-1., 0., 5.]))
    array([0., 0., 3.])
    """
    return np.where(y > 0, ct, ct.dtype.type(0))


@njit(parallel=True, cache=True, error_model="numpy")
def _relu_grad(ct, y, out):  # all (n,); out may be ct or y
    zero = out.dtype.type(0)
    for i in prange(out.size):
        out[i] = ct[i] if y[i] > 0 else zero


def relu_grad_cpu(ct, y, out) -> bool:
    """out = relu_grad_ref(ct, y) when all three are same-shape, same-dtype C-contiguous
    arrays (out may be ct or y); returns False (doing nothing) otherwise."""
    if not (ct.shape == y.shape == out.shape and ct.dtype == y.dtype == out.dtype
            and ct.flags.c_contiguous and y.flags.c_contiguous and out.flags.c_contiguous):
        return False
    with threads_for(3 * out.nbytes):
        _relu_grad(ct.reshape(-1), y.reshape(-1), out.reshape(-1))
    return True
