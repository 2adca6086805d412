"""The numpy twins of gelu.py's kernels: the same float operations in the same order, so the
same bits, with no Numba to load (a program's first calls run them while the kernels compile,
graphdist/runtime/warmup.py). The constants live here and gelu.py takes them from here.

float32: numpy's float32 ufuncs round each operation as IEEE says, and Numba without
fastmath neither contracts a multiply-add into an FMA nor reassociates, so the same chain
of float32 ufuncs gives the kernel's bits: 3.2 ms for gelu of 32x64x512 (the kernel on 2
threads: 0.16 ms; the op's float64 reference: 60 ms), by chunks that stay in cache.
float64: the kernel calls the C library's erfc and exp per element; numpy's own exp (SIMD)
differs from the C library's in the last bit for ~5% of inputs here, so the twin calls the
same C functions through Python's math module, one element at a time: 55 ms for gelu of
1M elements (kernel: 4.8 ms), about the reference's time, but exact.

Imports numpy only."""

from __future__ import annotations

import math

import numpy as np

_RSQRT2 = math.sqrt(0.5)
_RSQRT2PI = 1.0 / math.sqrt(2.0 * math.pi)

# Eigen's generic_fast_erf_float: odd numerator, even denominator, on [-4, 4]
ERF_P = tuple(np.float32(c) for c in (
    -2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06,
    -5.69250639462346e-05, -7.34990630326855e-04, -2.95459980854025e-03,
    -1.60960333262415e-02))
ERF_Q = tuple(np.float32(c) for c in (
    -1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03,
    -7.37332916720468e-03, -1.42647390514189e-02))
EXP_TAYLOR = tuple(np.float32(1 / math.factorial(k)) for k in range(10, -1, -1))
HALF, ONE = np.float32(0.5), np.float32(1.0)
RSQRT2_32, RSQRT2PI_32 = np.float32(_RSQRT2), np.float32(_RSQRT2PI)
CHUNK = 1 << 14     # elements per pass of the twins


def _horner(x, coefficients):
    p = np.full_like(x, coefficients[0])
    for c in coefficients[1:]:
        p *= x
        p += c
    return p


def erf32(x):
    """gelu._erf32 on a float32 array (a new array)."""
    x = np.minimum(np.maximum(x, np.float32(-4.0)), np.float32(4.0))
    x2 = x * x
    p = _horner(x2, ERF_P)
    q = _horner(x2, ERF_Q)
    p *= x
    p /= q
    return p


def exp_nonpositive32(t):
    """gelu._exp_nonpositive32 on a float32 array (a new array)."""
    u = np.maximum(t, np.float32(-18.0))
    u *= np.float32(0.0625)
    p = _horner(u, EXP_TAYLOR)
    for _ in range(4):
        p *= p
    return p


def _one_plus_erf32(x):
    y = erf32(x * RSQRT2_32)
    y += ONE
    return y


def gelu32(x, out):
    """out = gelu._gelu32(x) (out may be x)."""
    y = _one_plus_erf32(x)
    np.multiply(x, HALF, out=out)
    out *= y


def gelu_grad32(ct, x, out):
    """out = gelu._gelu_grad32(ct, x) (out may be ct or x)."""
    cdf = _one_plus_erf32(x)
    cdf *= HALF
    e = exp_nonpositive32((-HALF * x) * x)
    e *= x
    e *= RSQRT2PI_32
    e += cdf
    np.multiply(ct, e, out=out)


def _math(fn):
    return np.frompyfunc(fn, 1, 1)


def gelu64(x, out):
    """out = gelu._gelu(x, approximate=False) on float64 (out may be x)."""
    cdf = _math(math.erfc)(-x * _RSQRT2).astype(np.float64)
    cdf *= 0.5
    np.multiply(x, cdf, out=out)


def gelu_grad64(ct, x, out):
    """out = gelu._gelu_grad(ct, x, approximate=False) on float64 (out may be ct or x)."""
    cdf = _math(math.erfc)(-x * _RSQRT2).astype(np.float64)
    cdf *= 0.5
    e = _math(math.exp)((-0.5 * x) * x).astype(np.float64)
    e *= x
    e *= _RSQRT2PI
    e += cdf
    np.multiply(ct, e, out=out)


def runs(*arrays) -> bool:
    """Whether gelu.py's kernels take these arrays (else the op's reference runs)."""
    first = arrays[0]
    return all(a.shape == first.shape and a.dtype == first.dtype and a.flags.c_contiguous
               and a.dtype in (np.float32, np.float64) for a in arrays)


def _by_chunks(fn, *arrays):
    """fn on flat chunks of CHUNK elements: a dozen passes over a chunk in cache, not over
    whole arrays (3x faster at 1M elements)."""
    flat = [a.reshape(-1) for a in arrays]
    with np.errstate(all="ignore"):          # the kernels' error_model="numpy": no warnings
        for start in range(0, flat[0].size, CHUNK):
            fn(*(a[start:start + CHUNK] for a in flat))


def gelu_cpu(x, out) -> bool:
    """out = gelu.gelu_cpu(x, out, False), bit for bit; False (doing nothing) where that
    kernel would refuse."""
    if not runs(x, out):
        return False
    _by_chunks(gelu32 if x.dtype == np.float32 else gelu64, x, out)
    return True


def gelu_grad_cpu(ct, x, out) -> bool:
    """out = gelu.gelu_grad_cpu(ct, x, out, False), bit for bit, as gelu_cpu."""
    if not runs(ct, x, out):
        return False
    _by_chunks(gelu_grad32 if x.dtype == np.float32 else gelu_grad64, ct, x, out)
    return True
