"""gelu and its gradient (ct * gelu'(x)) in one parallel pass each, with the C library's
erfc: numpy has no erf, so the op's reference (graphdist/ops/special.py) builds erfc from
about forty array passes."""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .common import threads_for

_C = math.sqrt(2.0 / math.pi)
_K = 0.044715
_RSQRT2 = math.sqrt(0.5)
_RSQRT2PI = 1.0 / math.sqrt(2.0 * math.pi)


def gelu_ref(x, approximate):
    """The spec, with math.erfc: x Phi(x), or the tanh form.

    >>> gelu_ref(np.array([0.0, 1.0]), False)
    array([0.        , 0.84134475])
    """
    x64 = x.astype(np.float64)
    if approximate:
        y = 0.5 * x64 * (1 + np.tanh(_C * (x64 + _K * x64 ** 3)))
    else:
        y = x64 * 0.5 * np.vectorize(math.erfc, otypes=[np.float64])(-x64 * _RSQRT2)
    return y.astype(x.dtype)


def gelu_grad_ref(ct, x, approximate):
    """ct * gelu'(x): Phi(x) + x phi(x), or the tanh form's derivative."""
    x64 = x.astype(np.float64)
    if approximate:
        t = np.tanh(_C * (x64 + _K * x64 ** 3))
        d = 0.5 * (1 + t) + 0.5 * x64 * (1 - t * t) * _C * (1 + 3 * _K * x64 ** 2)
    else:
        cdf = 0.5 * np.vectorize(math.erfc, otypes=[np.float64])(-x64 * _RSQRT2)
        d = cdf + x64 * np.exp(-0.5 * x64 * x64) * _RSQRT2PI
    return (ct * d).astype(x.dtype)


@njit(cache=True, inline="always")
def _gelu1(v, approximate):            # float64 in, (gelu(v), gelu'(v)) out
    if approximate:
        t = math.tanh(_C * v * (1.0 + _K * v * v))
        return 0.5 * v * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * _C * (
            1.0 + 3.0 * _K * v * v)
    cdf = 0.5 * math.erfc(-v * _RSQRT2)
    return v * cdf, cdf + v * math.exp(-0.5 * v * v) * _RSQRT2PI


@njit(parallel=True, cache=True, error_model="numpy")
def _gelu(x, out, approximate):  # (n,); out may be x
    for i in prange(out.size):
        out[i] = _gelu1(np.float64(x[i]), approximate)[0]


@njit(parallel=True, cache=True, error_model="numpy")
def _gelu_grad(ct, x, out, approximate):  # (n,); out may be ct or x
    for i in prange(out.size):
        out[i] = ct[i] * _gelu1(np.float64(x[i]), approximate)[1]


def _runs(*arrays) -> bool:
    first = arrays[0]
    return all(a.shape == first.shape and a.dtype == first.dtype and a.flags.c_contiguous
               and a.dtype in (np.float32, np.float64) for a in arrays)


def gelu_cpu(x, out, approximate) -> bool:
    """out = gelu_ref(x) for same-shape float32/float64 C-contiguous arrays (out may be x);
    returns False (doing nothing) otherwise."""
    if not _runs(x, out):
        return False
    with threads_for(8 * out.nbytes):          # erfc costs a few memory passes' worth
        _gelu(x.reshape(-1), out.reshape(-1), bool(approximate))
    return True


def gelu_grad_cpu(ct, x, out, approximate) -> bool:
    """out = gelu_grad_ref(ct, x), as gelu_cpu (out may be ct or x)."""
    if not _runs(ct, x, out):
        return False
    with threads_for(8 * out.nbytes):
        _gelu_grad(ct.reshape(-1), x.reshape(-1), out.reshape(-1), bool(approximate))
    return True
