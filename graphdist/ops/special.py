"""Elementwise transcendental ops math.py lacks: sin, cos (positional encodings) and gelu
with its gradient. numpy has no erf, so the exact gelu's reference computes erfc with W. J.
Cody's rational approximations (Math. Comp. 23, 1969; the Netlib CALERF coefficients),
vectorized in float64: within a few ulps of math.erfc. On CPU devices gelu and its gradient
run as Numba kernels instead (runtime/kernel_table.py)."""

from __future__ import annotations

import math

import numpy as np

from graphdist.errors import ShapeError
from graphdist.ir.types import ArrayType
from graphdist.ops.core import Op, bind, require_float, same_dtype
from graphdist.ops.math import _unary, add, exp, multiply, negative, square, subtract, tanh

sin_p = _unary("sin", "sin")
sin_p.def_vjp(lambda ct, x: (multiply(ct, cos(x)),))

cos_p = _unary("cos", "cos")
cos_p.def_vjp(lambda ct, x: (negative(multiply(ct, sin(x))),))

# ---------------------------------------------------------------- erfc (float64)

_A = (3.16112374387056560e00, 1.13864154151050156e02, 3.77485237685302021e02,
      3.20937758913846947e03, 1.85777706184603153e-1)
_B = (2.36012909523441209e01, 2.44024637934444173e02, 1.28261652607737228e03,
      2.84423683343917062e03)
_C = (5.64188496988670089e-1, 8.88314979438837594e00, 6.61191906371416295e01,
      2.98635138197400131e02, 8.81952221241769090e02, 1.71204761263407058e03,
      2.05107837782607147e03, 1.23033935479799725e03, 2.15311535474403846e-8)
_D = (1.57449261107098347e01, 1.17693950891312499e02, 5.37181101862009858e02,
      1.62138957456669019e03, 3.29079923573345963e03, 4.36261909014324716e03,
      3.43936767414372164e03, 1.23033935480374942e03)
_P = (3.05326634961232344e-1, 3.60344899949804439e-1, 1.25781726111229246e-1,
      1.60837851487422766e-2, 6.58749161529837803e-4, 1.63153871373020978e-2)
_Q = (2.56852019228982242e00, 1.87295284992346047e00, 5.27905102951428412e-1,
      6.05183413124413191e-2, 2.33520497626869185e-3)
_RSQRTPI = 0.56418958354775628695


def _ratio(z, num, den, n):
    """CALERF's rational function: (...((num[-1] z + num[0]) z + ...) / (...(z + den[0]) z...),
    n steps, leaving the last num/den terms to the caller."""
    top, bottom = num[-1] * z, z
    for i in range(n):
        top, bottom = (top + num[i]) * z, (bottom + den[i]) * z
    return top, bottom


def erfc(xp, t):
    """erfc(t) elementwise, in float64, for any float array `t`."""
    t = t.astype(np.float64)
    y = xp.abs(t)
    z = xp.minimum(y, 0.5) ** 2
    top, bottom = _ratio(z, _A, _B, 3)                    # |t| <= 0.46875: 1 - erf
    near = 1.0 - t * (top + _A[3]) / (bottom + _B[3])
    mid = xp.clip(y, 0.46875, 4.0)                        # 0.46875 < |t| <= 4
    top, bottom = _ratio(mid, _C, _D, 7)
    r = (top + _C[7]) / (bottom + _D[7])
    far = xp.clip(y, 4.0, 28.0)                           # |t| > 4 (erfc(27) underflows)
    w = 1.0 / (far * far)
    top, bottom = _ratio(w, _P, _Q, 4)
    r = xp.where(y <= 4.0, r, (_RSQRTPI - w * (top + _P[4]) / (bottom + _Q[4])) / far)
    # exp(-y^2) as exp(-s^2) exp(-(y - s)(y + s)), s = y rounded down to 1/16: no error
    # from squaring y
    y = xp.minimum(y, 28.0)
    s = xp.trunc(y * 16.0) / 16.0
    tail = xp.exp(-s * s) * xp.exp(-(y - s) * (y + s)) * r
    return xp.where(y <= 0.46875, near, xp.where(t < 0, 2.0 - tail, tail))


# ---------------------------------------------------------------- gelu

_C_TANH = math.sqrt(2.0 / math.pi)     # tanh form: 0.5 x (1 + tanh(c (x + k x^3)))
_K_TANH = 0.044715


def gelu_ref(xp, x, approximate: bool, grad: bool = False):
    """gelu(x), or with grad=True gelu'(x), in float64. The exact form is x Phi(x) with
    Phi(x) = erfc(-x / sqrt 2) / 2 (erfc, not 1 + erf: the far negative tail stays exact)."""
    x = x.astype(np.float64)
    if approximate:
        t = xp.tanh(_C_TANH * x * (1.0 + _K_TANH * x * x))
        if not grad:
            return 0.5 * x * (1.0 + t)
        du = _C_TANH * (1.0 + 3.0 * _K_TANH * x * x)
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du
    cdf = 0.5 * erfc(xp, x * -math.sqrt(0.5))
    if not grad:
        return x * cdf
    return cdf + x * xp.exp(-0.5 * x * x) * (1.0 / math.sqrt(2.0 * math.pi))


gelu_p = Op("gelu", elementwise=True)


@gelu_p.def_shape
def _gelu_shape(x, *, approximate):
    require_float("gelu", x)
    return x


gelu_p.def_impl(lambda xp, x, *, approximate: gelu_ref(xp, x, approximate).astype(x.dtype))
# never given a dying input's buffer as `out`: the CPU kernel's loop vectorizes only on
# distinct buffers (aliased, LLVM's overlap check sends it down the scalar path, 13x slower)
gelu_p.def_out(lambda xp, out, x, *, approximate: xp.copyto(
    out, gelu_ref(xp, x, approximate), casting="unsafe"))
gelu_p.def_vjp(lambda ct, x, *, approximate: (
    bind(gelu_grad_p, ct, x, approximate=approximate),))
gelu_p.def_cost(lambda ins, outs, **_: (20 * outs[0].size, ins[0].nbytes + outs[0].nbytes))

# ct * gelu'(x) in one pass
gelu_grad_p = Op("gelu_grad", elementwise=True)


@gelu_grad_p.def_shape
def _gelu_grad_shape(ct, x, *, approximate):
    dtype = same_dtype("gelu_grad", ct, x, names=("ct", "x"))
    require_float("gelu_grad", x)
    if ct.shape != x.shape:
        raise ShapeError(f"gelu_grad: ct and x must have one shape, got ct:{ct}, x:{x}")
    return ArrayType(x.shape, dtype)


gelu_grad_p.def_impl(lambda xp, ct, x, *, approximate: (
    ct * gelu_ref(xp, x, approximate, grad=True)).astype(x.dtype))
gelu_grad_p.def_out(lambda xp, out, ct, x, *, approximate: xp.copyto(   # not aliased: above
    out, ct * gelu_ref(xp, x, approximate, grad=True), casting="unsafe"))
gelu_grad_p.def_cost(lambda ins, outs, **_: (24 * outs[0].size,
                                              sum(t.nbytes for t in (*ins, *outs))))


@gelu_grad_p.def_vjp
def _gelu_grad_vjp(ct2, ct, x, *, approximate):
    # linear in ct; through x, gelu''(x)
    x2 = square(x)
    if approximate:      # (1 - t^2) (u' - x t u'^2 + x u''/2), u = c (x + k x^3)
        t = tanh(multiply(multiply(x, add(multiply(x2, _K_TANH), 1.0)), _C_TANH))
        du = add(multiply(x2, 3.0 * _C_TANH * _K_TANH), _C_TANH)
        inner = subtract(add(du, multiply(x2, 3.0 * _C_TANH * _K_TANH)),
                         multiply(multiply(x, t), square(du)))
        second = multiply(subtract(1.0, square(t)), inner)
    else:                # phi(x) (2 - x^2)
        second = multiply(exp(multiply(x2, -0.5)),
                          multiply(subtract(2.0, x2), 1.0 / math.sqrt(2.0 * math.pi)))
    return (bind(gelu_grad_p, ct2, x, approximate=approximate),
            multiply(multiply(ct2, ct), second))


def sin(x):
    """Elementwise sine.

    >>> gd.sin(np.array([0.0, np.pi / 2]))
    array([0., 1.])
    """
    return bind(sin_p, x)


def cos(x):
    """Elementwise cosine.

    >>> gd.cos(np.array([0.0]))
    array([1.])
    """
    return bind(cos_p, x)


def gelu(x, approximate: bool = False):
    """Gaussian error linear unit: x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2)), or with
    approximate=True the tanh form 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).

    >>> gd.nn.gelu(np.array([0.0, 1.0]))
    array([0.        , 0.84134475])
    """
    return bind(gelu_p, x, approximate=bool(approximate))
