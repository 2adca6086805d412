"""Max pooling with its argmax and the gradient routed by it (ops/pool.py
max_pool2d_argmax / max_pool2d_grad_argmax, kernels/pool.py): the kernels against the
ops' numpy impls (their twins) and against max_pool2d and max_pool2d_grad, whose results
they replace, bit for bit: ties (first max in scan order, TF's rule), NaN windows (no
gradient), -inf, signed zeros, padding and odd sizes."""

from __future__ import annotations

import numpy as np
import pytest

from graphdist.ops import OPS
from graphdist.ops.pool import argmax_fits
from graphdist.runtime import kernel_table

# (input shape, ksize, strides, padding): non-overlapping windows only (argmax_fits)
CASES = [((3, 8, 8, 5), (2, 2), (2, 2), "VALID"), ((2, 9, 7, 4), (2, 2), (2, 2), "VALID"),
         ((2, 10, 11, 3), (3, 3), (3, 3), "SAME"), ((2, 8, 9, 2), (2, 3), (2, 3), "VALID"),
         ((1, 7, 7, 3), (2, 2), (3, 3), "VALID")]


def _nasty(rng, shape, dtype):
    """Small integers (ties in most windows), with -inf, -0.0 and NaN sprinkled in."""
    x = rng.integers(-2, 3, shape).astype(dtype)
    flat = x.reshape(-1)
    flat[::11] = -np.inf
    flat[3::13] = -0.0
    flat[5::17] = np.nan
    return x


def _forms(name):
    entry = kernel_table.entry("cpu", name)
    return entry.out, OPS[name]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_the_kernels_give_max_pool_s_and_its_gradient_s_bits(case, dtype):
    shape, ksize, strides, padding = case
    assert argmax_fits(ksize, strides)
    p = {"ksize": ksize, "strides": strides, "padding": padding}
    rng = np.random.default_rng(0)
    x = _nasty(rng, shape, dtype)
    kernel, op = _forms("max_pool2d_argmax")
    y_ref = OPS["max_pool2d"].impl(np, x, **p)
    y, idx = np.full_like(y_ref, 7), np.full(y_ref.shape, 9, np.int8)
    kernel((y, idx), x, **p)
    y_impl, idx_impl = op.impl(np, x, **p)
    y_kernel = np.empty_like(y)
    kernel_table.entry("cpu", "max_pool2d").out(y_kernel, x, **p)
    np.testing.assert_array_equal(y, y_kernel)              # max_pool2d's kernel's y
    np.testing.assert_array_equal(y, y_impl)                # (NaN where a window has one)
    np.testing.assert_array_equal(idx, idx_impl)
    assert idx.dtype == np.int8 and (idx >= -1).all() and (idx < ksize[0] * ksize[1]).all()
    assert ((idx == -1) == np.isnan(y)).all()

    dy = rng.standard_normal(y.shape).astype(dtype)
    dy.reshape(-1)[::7] = -0.0
    want = OPS["max_pool2d_grad"].impl(np, x, y_ref, dy, **p)
    grad_kernel, grad_op = _forms("max_pool2d_grad_argmax")
    dx = np.full_like(x, 7)
    grad_kernel(dx, idx, dy, input_size=shape[1:3], **p)
    np.testing.assert_array_equal(dx, want)
    np.testing.assert_array_equal(grad_op.impl(np, idx, dy, input_size=shape[1:3], **p), want)
    assert not np.signbit(dx[dx == 0]).any()                # -0.0 routed as +0.0, as TF


def test_the_index_is_the_first_max_in_scan_order():
    x = np.array([[1, 3], [3, 0],            # tie: the first 3 (tap 1)
                  [-np.inf, -np.inf], [-np.inf, -np.inf],   # all -inf: tap 0
                  [2, np.nan], [5, 1]], np.float32).reshape(1, 6, 2, 1)
    x = np.concatenate([x[:, 0:2], x[:, 2:4], x[:, 4:6]], axis=2)   # three 2x2 windows
    y, idx = OPS["max_pool2d_argmax"].impl(np, x, ksize=(2, 2), strides=(2, 2),
                                           padding="VALID")
    np.testing.assert_array_equal(idx.reshape(-1), [1, 0, -1])
    assert y.reshape(-1)[0] == 3 and y.reshape(-1)[1] == -np.inf and np.isnan(y.reshape(-1)[2])


def test_overlapping_windows_do_not_fit():
    assert not argmax_fits((3, 3), (2, 2)) and not argmax_fits((2, 2), (1, 2))
    assert not argmax_fits((12, 11), (12, 11))              # 132 taps: past an int8
    assert argmax_fits((2, 2), (2, 2)) and argmax_fits((3, 3), (4, 3))

