"""GELU's tanh form (approximate=True, as GPT-2 and BERT use it): kernels/gelu.py's float32
kernels (Eigen's rational tanh, vectorized) and float64 kernels (the C library's tanh), and
their numpy twins in kernels/gelu_numpy.py, which must give the kernels' bits.

The reference is the formula in float64 numpy, its derivative derived by hand:
gelu(x) = x (1 + tanh u) / 2 with u = c (x + k x^3), c = sqrt(2 / pi), k = 0.044715, and
gelu'(x) = (1 + tanh u) / 2 + x sech^2(u) u' / 2 with u' = c (1 + 3 k x^2)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import graphdist as gd
from graphdist.kernels import gelu as kernel
from graphdist.kernels import gelu_numpy as twin

C, K = math.sqrt(2.0 / math.pi), 0.044715
FORMS = {"kernel": kernel, "twin": twin}


def tanh_gelu(x):
    x = np.asarray(x, np.float64)
    return 0.5 * x * (1.0 + np.tanh(C * (x + K * x ** 3)))


def tanh_gelu_slope(x):
    x = np.asarray(x, np.float64)
    u = C * (x + K * x ** 3)
    du = C * (1.0 + 3.0 * K * x * x)
    with np.errstate(over="ignore"):        # cosh overflows far out: sech^2 is 0 there
        sech2 = 1.0 / np.cosh(u) ** 2
    return 0.5 * (1.0 + np.tanh(u)) + 0.5 * x * sech2 * du


def _inputs(dtype, n=70_001):
    """Normal values, a wide sweep (both tails, where tanh saturates) and edge values; an
    odd size, so the twins' last chunk is short."""
    rng = np.random.default_rng(29)
    x = np.concatenate([rng.standard_normal(n // 2) * 2.0,
                        np.linspace(-12.0, 12.0, n - n // 2 - 14),
                        [0.0, -0.0, 1e-30, -1e-30, 1e-4, -1e-4, 4.84, -4.84, 30.0, -30.0,
                         1e4, -1e4, 1e30, -1e30]])
    return x.astype(dtype)


def _gelu(form, x, out=None, approximate=True):
    out = np.empty_like(x) if out is None else out
    assert form.gelu_cpu(x, out, approximate)
    return out


def _gelu_grad(form, ct, x, out=None, approximate=True):
    out = np.empty_like(x) if out is None else out
    assert form.gelu_grad_cpu(ct, x, out, approximate)
    return out


@pytest.mark.parametrize("form", sorted(FORMS))
def test_float32_matches_the_float64_formula(form):
    """Absolute error <= 1.1e-6 in gelu; <= 4.3e-6 in gelu' where the rational tanh reaches
    -1 in float32 (|u| >= 7.9, x near -4.84: the true 1 + tanh u is 2.7e-7 there), as in
    TF and XLA, which use the same tanh."""
    x = _inputs(np.float32)
    ct = np.random.default_rng(1).uniform(0.5, 2.0, x.shape).astype(np.float32)
    y = _gelu(FORMS[form], x)
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, tanh_gelu(x), rtol=1e-6, atol=1.5e-6)
    dx = _gelu_grad(FORMS[form], ct, x)
    np.testing.assert_allclose(dx, ct * tanh_gelu_slope(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_float64_matches_the_float64_formula(form):
    x = _inputs(np.float64, 5_001)
    ct = np.random.default_rng(2).standard_normal(x.shape)
    np.testing.assert_allclose(_gelu(FORMS[form], x), tanh_gelu(x), rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(_gelu_grad(FORMS[form], ct, x), ct * tanh_gelu_slope(x),
                               rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("approximate", [True, False])
def test_the_twins_give_the_kernels_bits(dtype, approximate):
    x = _inputs(dtype, 70_001 if dtype == np.float32 else 20_001)
    ct = np.random.default_rng(3).standard_normal(x.shape).astype(dtype)
    same = (lambda a, b: np.array_equal(a.view(np.uint8), b.view(np.uint8)))
    assert same(_gelu(kernel, x, approximate=approximate),
                _gelu(twin, x, approximate=approximate))
    assert same(_gelu_grad(kernel, ct, x, approximate=approximate),
                _gelu_grad(twin, ct, x, approximate=approximate))
    # out may be x (forward), ct or x (gradient): the same bits written over the input
    want = _gelu(kernel, x, approximate=approximate)
    for form in (kernel, twin):
        y = x.copy()
        _gelu(form, y, out=y, approximate=approximate)
        assert same(y, want)
        d = ct.copy()
        _gelu_grad(form, d, x, out=d, approximate=approximate)
        assert same(d, _gelu_grad(kernel, ct, x, approximate=approximate))


def test_float32_slope_matches_finite_differences_of_the_formula():
    """The float32 gradient against central differences of the float64 forward formula,
    so the hand-derived derivative above is not the only judge."""
    x = np.linspace(-6.0, 6.0, 4_001)
    h = 1e-5
    numeric = (tanh_gelu(x + h) - tanh_gelu(x - h)) / (2 * h)
    x32 = x.astype(np.float32)
    slope = _gelu_grad(kernel, np.ones_like(x32), x32)
    np.testing.assert_allclose(slope, numeric, rtol=1e-5, atol=5e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_ops_gradient_matches_finite_differences(dtype):
    """Through a compiled step: d/dx sum(w * gelu(x, approximate=True)) against central
    differences of the op's float64 forward."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((64, 300)) * 2.0).astype(dtype)
    w = rng.standard_normal((64, 300)).astype(dtype)
    step = gd.function(gd.value_and_grad(
        lambda x: gd.reduce_sum(w * gd.nn.gelu(x, approximate=True))))
    _, grad = step(x)
    assert grad.dtype == dtype
    x64 = x.astype(np.float64)
    h = 1e-6
    numeric = w * (tanh_gelu(x64 + h) - tanh_gelu(x64 - h)) / (2 * h)
    atol = 1e-5 if dtype == np.float32 else 1e-8
    np.testing.assert_allclose(grad, numeric, rtol=1e-5, atol=atol * np.abs(w).max())


def test_the_op_runs_the_float32_kernel():
    """gd.nn.gelu(approximate=True) and its gradient give the kernel's bits in a step (the
    float64 reference rounded to float32 differs in the last bit for many inputs)."""
    x = _inputs(np.float32)
    ct = np.random.default_rng(6).standard_normal(x.shape).astype(np.float32)
    fwd = gd.function(lambda x: gd.nn.gelu(x, approximate=True) * 1.0)
    np.testing.assert_array_equal(fwd(x), _gelu(kernel, x))
    assert not np.array_equal(fwd(x), tanh_gelu(x).astype(np.float32))
    vjp = gd.function(gd.value_and_grad(
        lambda x, ct: gd.reduce_sum(ct * gd.nn.gelu(x, approximate=True))))
    _, grad = vjp(x, ct)
    np.testing.assert_array_equal(grad, _gelu_grad(kernel, ct, x))


@pytest.mark.parametrize("form", sorted(FORMS))
def test_the_exact_forms_slope_stays_right_far_out(form):
    """The exact form's float32 gradient, x Phi'(x) + Phi(x): its Gaussian density is 0
    below exp(-18), not exp(-18) (times x = 1e30 that gave 6e21 where gelu' is 1)."""
    x = np.array([1e30, -1e30, 1e6, -1e6, 100.0, -100.0, 6.0, -6.0], np.float32)
    slope = _gelu_grad(FORMS[form], np.ones_like(x), x, approximate=False)
    x64 = x.astype(np.float64)
    phi = np.exp(-0.5 * np.minimum(x64 * x64, 1e4)) / math.sqrt(2 * math.pi)
    cdf = 0.5 * np.vectorize(math.erfc)(-x64 / math.sqrt(2))
    np.testing.assert_allclose(slope, cdf + x64 * phi, rtol=1e-6, atol=1.5e-6)
