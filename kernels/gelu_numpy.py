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

# Eigen's generic_fast_tanh_float (what TF and XLA run for tanh on the CPU): odd numerator,
# even denominator, on [-TANH_CLAMP, TANH_CLAMP], where it reaches +-1 in float32
TANH_P = tuple(np.float32(c) for c in (
    -2.76076847742355e-16, 2.00018790482477e-13, -8.60467152213735e-11,
    5.12229709037114e-08, 1.48572235717979e-05, 6.37261928875436e-04,
    4.89352455891786e-03))
TANH_Q = tuple(np.float32(c) for c in (
    1.19825839466702e-06, 1.18534705686654e-04, 2.26843463243900e-03,
    4.89352518554385e-03))
TANH_CLAMP = np.float32(7.90531110763549805)
# the tanh form: u = x (C + CK x^2), u' = C + C3K x^2 (C = sqrt(2/pi), K = 0.044715)
_C_TANH, _K_TANH = math.sqrt(2.0 / math.pi), 0.044715
C_32, CK_32 = np.float32(_C_TANH), np.float32(_C_TANH * _K_TANH)
C3K_32 = np.float32(3.0 * _C_TANH * _K_TANH)
# x^2 in u' is capped here: from |x| = 4.84 the rational tanh is exactly +-1, so 1 - t^2 is 0,
# and the cap keeps u' finite (x^2 overflows from |x| = 1.8e19: 0 * inf would be NaN)
SLOPE_X2_MAX = np.float32(64.0)
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
    p[~(t >= np.float32(-18.0))] = 0     # NaN too, as the kernel's comparison
    return p


def tanh32(u):
    """gelu._tanh32 on a float32 array (a new array)."""
    x = np.minimum(np.maximum(u, -TANH_CLAMP), TANH_CLAMP)
    x2 = x * x
    p = _horner(x2, TANH_P)
    q = _horner(x2, TANH_Q)
    p *= x
    p /= q
    return p


def _tanh_form32(x):
    """(tanh(u), x^2) with u = x (C + CK x^2): the kernels' order of operations."""
    x2 = x * x
    u = x2 * CK_32
    u += C_32
    u *= x
    return tanh32(u), x2


def gelu_tanh32(x, out):
    """out = gelu._gelu_tanh32(x) (out may be x)."""
    t, _ = _tanh_form32(x)
    t += ONE
    np.multiply(x, HALF, out=out)
    out *= t


def gelu_tanh_grad32(ct, x, out):
    """out = gelu._gelu_tanh_grad32(ct, x) (out may be ct or x)."""
    t, x2 = _tanh_form32(x)
    du = np.minimum(x2, SLOPE_X2_MAX)
    du *= C3K_32
    du += C_32
    slope = t * t                      # 0.5 x (1 - t^2) u'
    np.subtract(ONE, slope, out=slope)
    slope *= x * HALF
    slope *= du
    t += ONE
    t *= HALF                          # 0.5 (1 + t)
    t += slope
    np.multiply(ct, t, out=out)


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


_C_TANH64, _K_TANH64 = _C_TANH, _K_TANH


def _tanh64(x):
    """tanh(C x (1 + K x^2)) by the C library's tanh, as gelu._gelu1 computes it."""
    u = (_C_TANH64 * x) * (1.0 + (_K_TANH64 * x) * x)
    return _math(math.tanh)(u).astype(np.float64)


def gelu_tanh64(x, out):
    """out = gelu._gelu(x, approximate=True) on float64 (out may be x)."""
    t = _tanh64(x)
    t += 1.0
    np.multiply(0.5 * x, t, out=out)


def gelu_tanh_grad64(ct, x, out):
    """out = gelu._gelu_grad(ct, x, approximate=True) on float64 (out may be ct or x)."""
    t = _tanh64(x)
    du = 1.0 + ((3.0 * _K_TANH64) * x) * x
    slope = ((0.5 * x) * (1.0 - t * t)) * _C_TANH64
    slope *= du
    t += 1.0
    t *= 0.5
    t += slope
    np.multiply(ct, t, out=out)


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


_FORMS = {(np.dtype(np.float32), False): (gelu32, gelu_grad32),
          (np.dtype(np.float32), True): (gelu_tanh32, gelu_tanh_grad32),
          (np.dtype(np.float64), False): (gelu64, gelu_grad64),
          (np.dtype(np.float64), True): (gelu_tanh64, gelu_tanh_grad64)}


def gelu_cpu(x, out, approximate=False) -> bool:
    """out = gelu.gelu_cpu(x, out, approximate), bit for bit; False (doing nothing) where
    that kernel would refuse."""
    if not runs(x, out):
        return False
    _by_chunks(_FORMS[x.dtype, bool(approximate)][0], x, out)
    return True


def gelu_grad_cpu(ct, x, out, approximate=False) -> bool:
    """out = gelu.gelu_grad_cpu(ct, x, out, approximate), bit for bit, as gelu_cpu."""
    if not runs(ct, x, out):
        return False
    _by_chunks(_FORMS[x.dtype, bool(approximate)][1], ct, x, out)
    return True
