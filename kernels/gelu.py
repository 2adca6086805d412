"""gelu and its gradient (ct * gelu'(x)) in one parallel pass each: numpy has no erf, so the
op's reference (graphdist/ops/special.py) builds erfc from about forty array passes.

float64: the C library's erfc and exp, element by element. float32: the C library is a
scalar call per element (11.5 ms for gelu and its gradient at 32x64x512 here), so the
exact form uses Eigen's float32 rational erf (what TF and XLA use; |error| <= 4e-7) and an
exp for the Gaussian density built from multiplies and adds (relative error <= 1e-5 on the
range that matters), both of which LLVM vectorizes: 0.2 ms forward, 0.3 ms gradient. The
cost: 0.5 x (1 + erf) loses the far negative tail (absolute error <= 1.2e-6 in gelu, as in
TF), which the float64 reference keeps. The tanh form (approximate=True, GPT-2's and BERT's)
in float32 likewise uses Eigen's rational tanh (what TF and XLA run): 0.18 ms forward, 0.24
ms gradient on 2048x512 (the float64 reference: 9 and 15 ms); absolute error <= 1.1e-6 in
gelu and <= 4.3e-6 in gelu', where the rational tanh reaches +-1 (x near -4.84).
gelu_numpy.py holds their numpy twins (same bits)."""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .common import threads_for
from .gelu_numpy import (C3K_32, C_32, CK_32, ERF_P, ERF_Q, EXP_TAYLOR, HALF, ONE, RSQRT2_32,
                         RSQRT2PI_32, SLOPE_X2_MAX, TANH_CLAMP, TANH_P, TANH_Q, runs)

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


# Eigen's rational erf and the exp polynomial's constants: shared with the numpy twins
_ERF_P, _ERF_Q, _EXP_TAYLOR = ERF_P, ERF_Q, EXP_TAYLOR
_HALF, _ONE, _RSQRT2_32, _RSQRT2PI_32 = HALF, ONE, RSQRT2_32, RSQRT2PI_32


@njit(cache=True, inline="always")
def _erf32(x):
    x = min(max(x, np.float32(-4.0)), np.float32(4.0))
    x2 = x * x
    p = _ERF_P[0]
    for c in _ERF_P[1:]:
        p = p * x2 + c
    q = _ERF_Q[0]
    for c in _ERF_Q[1:]:
        q = q * x2 + c
    return x * p / q


@njit(cache=True, inline="always")
def _exp_nonpositive32(t):
    """exp(t) for t <= 0: a Taylor polynomial of exp(t / 16), squared four times; 0 below
    -18, where the density is under 1e-8 of its peak (its value there, times a large x,
    made gelu' of x = 1e30 come out as 6e21)."""
    u = max(t, np.float32(-18.0)) * np.float32(0.0625)
    p = _EXP_TAYLOR[0]
    for c in _EXP_TAYLOR[1:]:
        p = p * u + c
    p = p * p
    p = p * p
    p = p * p
    return p * p if t >= np.float32(-18.0) else np.float32(0.0)


@njit(parallel=True, cache=True, error_model="numpy")
def _gelu32(x, out):  # float32 (n,); out may be x
    for i in prange(out.size):
        v = x[i]
        out[i] = v * _HALF * (_ONE + _erf32(v * _RSQRT2_32))


@njit(parallel=True, cache=True, error_model="numpy")
def _gelu_grad32(ct, x, out):  # float32 (n,); out may be ct or x
    for i in prange(out.size):
        v = x[i]
        cdf = _HALF * (_ONE + _erf32(v * _RSQRT2_32))
        out[i] = ct[i] * (cdf + v * _exp_nonpositive32(-_HALF * v * v) * _RSQRT2PI_32)


# the tanh form in float32: Eigen's rational tanh, as TF and XLA compute it
_TANH_P, _TANH_Q, _TANH_CLAMP = TANH_P, TANH_Q, TANH_CLAMP
_C_32, _CK_32, _C3K_32, _SLOPE_X2_MAX = C_32, CK_32, C3K_32, SLOPE_X2_MAX


@njit(cache=True, inline="always")
def _tanh32(u):
    """tanh(u) for float32 u: Eigen's generic_fast_tanh_float without its |u| < 4e-4 branch
    (there it gives u to within an ulp; gelu adds 1 to it)."""
    x = min(max(u, -_TANH_CLAMP), _TANH_CLAMP)
    x2 = x * x
    p = _TANH_P[0]
    for c in _TANH_P[1:]:
        p = p * x2 + c
    q = _TANH_Q[0]
    for c in _TANH_Q[1:]:
        q = q * x2 + c
    return p * x / q


@njit(parallel=True, cache=True, error_model="numpy")
def _gelu_tanh32(x, out):  # float32 (n,); out may be x
    for i in prange(out.size):
        v = x[i]
        t = _tanh32((v * v * _CK_32 + _C_32) * v)
        out[i] = v * _HALF * (t + _ONE)


@njit(parallel=True, cache=True, error_model="numpy")
def _gelu_tanh_grad32(ct, x, out):  # float32 (n,); out may be ct or x
    for i in prange(out.size):
        v = x[i]
        v2 = v * v
        t = _tanh32((v2 * _CK_32 + _C_32) * v)
        slope = (_ONE - t * t) * (v * _HALF) * (min(v2, _SLOPE_X2_MAX) * _C3K_32 + _C_32)
        out[i] = ct[i] * ((t + _ONE) * _HALF + slope)


_runs = runs
_FLOAT32_KERNELS = {False: (_gelu32, _gelu_grad32), True: (_gelu_tanh32, _gelu_tanh_grad32)}


def gelu_cpu(x, out, approximate=False) -> bool:
    """out = gelu_ref(x) for same-shape float32/float64 C-contiguous arrays (out may be x);
    returns False (doing nothing) otherwise."""
    if not _runs(x, out):
        return False
    if x.dtype == np.float32:
        with threads_for(2 * out.nbytes):
            _FLOAT32_KERNELS[bool(approximate)][0](x.reshape(-1), out.reshape(-1))
        return True
    with threads_for(8 * out.nbytes):          # erfc costs a few memory passes' worth
        _gelu(x.reshape(-1), out.reshape(-1), bool(approximate))
    return True


def gelu_grad_cpu(ct, x, out, approximate=False) -> bool:
    """out = gelu_grad_ref(ct, x), as gelu_cpu (out may be ct or x)."""
    if not _runs(ct, x, out):
        return False
    if x.dtype == np.float32:
        with threads_for(3 * out.nbytes):
            _FLOAT32_KERNELS[bool(approximate)][1](ct.reshape(-1), x.reshape(-1),
                                                   out.reshape(-1))
        return True
    with threads_for(8 * out.nbytes):
        _gelu_grad(ct.reshape(-1), x.reshape(-1), out.reshape(-1), bool(approximate))
    return True
