"""The fused epilogues' CPU kernels (runtime/adapters/epilogue.py: kernels/conv.py
bias_act_cpu, kernels/gelu.py, kernels/epilogue.py relu_grad_sum_cpu) against their numpy
twins, bit for bit (the twins run a program's first calls while Numba loads), and against
numpy formulas written from the definitions (float64)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from graphdist.kernels.epilogue import relu_grad_sum_cpu, relu_grad_sum_ref
from graphdist.ops.epilogue import (SUM_ROWS, conv2d_bias_act_p, matmul_bias_act_p,
                                    relu_grad_bias_sum_p, relu_grad_sum_numpy)
from graphdist.runtime import kernel_table


def _entry(op):
    return kernel_table.entry("cpu", op.name)


def _conv_ref(x, f):
    win = np.lib.stride_tricks.sliding_window_view(x.astype(np.float64), f.shape[:2],
                                                   axis=(1, 2))
    return np.einsum("nhwcpq,pqco->nhwo", win, f.astype(np.float64))


def _act_ref(v, act):
    if act == "relu":
        return np.maximum(v, 0)
    if act == "gelu":
        return v * 0.5 * np.vectorize(math.erfc)(-v / math.sqrt(2))
    if act == "gelu_tanh":
        return 0.5 * v * (1 + np.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3)))
    return v


def _run(entry_fn, op, ins, params):
    types = op.out_types(*(_ty(a) for a in ins), **params)
    types = types if isinstance(types, tuple) else (types,)
    outs = tuple(np.full(t.shape, np.nan, t.dtype) for t in types)
    entry_fn(outs if len(outs) > 1 else outs[0], *ins, **params)
    return outs


def _ty(a):
    from graphdist.ir.types import ArrayType

    return ArrayType(a.shape, a.dtype)


ACTS = ("none", "relu", "gelu", "gelu_tanh")
P = {"strides": (1, 1), "padding": "VALID", "dilations": (1, 1)}


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [((6, 28, 28, 1), 32), ((5, 13, 13, 32), 64),
                                   ((3, 9, 9, 3), 5)])
def test_conv2d_bias_act_kernel_twin_and_definition(act, bias, shape):
    (xs, o), rng = shape, np.random.default_rng(0)
    x = rng.standard_normal(xs).astype(np.float32)
    f = (rng.standard_normal((3, 3, xs[3], o)) / 3).astype(np.float32)
    b = rng.standard_normal(o).astype(np.float32)
    ins = (x, f, b) if bias else (x, f)
    for keep in ((False, True) if act.startswith("gelu") else (False,)):
        params = dict(P, act=act, has_bias=bias, keep=keep,
                      members=("conv2d", "add", act))
        entry = _entry(conv2d_bias_act_p)
        got = _run(entry.out, conv2d_bias_act_p, ins, params)
        twin = _run(entry.numpy_out, conv2d_bias_act_p, ins, params)
        for a, t in zip(got, twin):
            np.testing.assert_array_equal(a, t)
        pre = _conv_ref(x, f) + (b if bias else 0)
        np.testing.assert_allclose(got[-1], _act_ref(pre, act), rtol=2e-5, atol=2e-5)
        if keep:
            np.testing.assert_allclose(got[0], pre, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("act", ["none", "relu"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [((6, 28, 28, 1), 32), ((5, 13, 13, 32), 64),
                                   ((3, 10, 9, 3), 5)])
def test_conv2d_bias_act_pool_gives_the_bits_of_the_conv_then_the_pool(act, bias, shape):
    """conv2d_bias_act_pool (the 2x2 max pool of stride 2 with its argmax run on each block
    of the convolution's output while in cache) against conv2d_bias_act then
    max_pool2d_argmax, kernels and twins, bit for bit: odd sizes (a last row and column no
    window reads), integer-valued inputs (ties)."""
    from graphdist.ops import OPS
    from graphdist.ops.epilogue import POOL, conv2d_bias_act_pool_p

    (xs, o), rng = shape, np.random.default_rng(4)
    x = rng.integers(-2, 3, xs).astype(np.float32)
    f = rng.integers(-1, 2, (3, 3, xs[3], o)).astype(np.float32)
    b = rng.integers(-1, 2, o).astype(np.float32)
    ins = (x, f, b) if bias else (x, f)
    members = ("conv2d", "add", act)[:3 if bias else 1] + ("max_pool2d_argmax",)
    params = dict(P, act=act, has_bias=bias, members=members)
    a = _run(_entry(conv2d_bias_act_p).out, conv2d_bias_act_p, ins,
             dict(P, act=act, has_bias=bias, keep=False, members=members[:-1]))[0]
    y, idx = OPS["max_pool2d_argmax"].impl(np, a, **POOL)
    entry = _entry(conv2d_bias_act_pool_p)
    for form in (entry.out, entry.numpy_out):
        got_y, got_idx = np.full_like(y, np.nan), np.full_like(idx, 9)
        form((got_y, got_idx), *ins, **params)
        np.testing.assert_array_equal(got_y, y)
        np.testing.assert_array_equal(got_idx, idx)
    np.testing.assert_array_equal(conv2d_bias_act_pool_p.impl(np, *ins, **params)[1], idx)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("x_shape", [(64, 40), (4, 33, 40)])
def test_matmul_bias_act_kernel_twin_and_definition(act, x_shape):
    rng = np.random.default_rng(1)
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = (rng.standard_normal((40, 24)) / 6).astype(np.float32)
    b = rng.standard_normal(24).astype(np.float32)
    for keep in ((False, True) if act.startswith("gelu") else (False,)):
        params = dict(act=act, has_bias=True, keep=keep, members=("matmul", "add", act))
        entry = _entry(matmul_bias_act_p)
        got = _run(entry.out, matmul_bias_act_p, (x, w, b), params)
        twin = _run(entry.numpy_out, matmul_bias_act_p, (x, w, b), params)
        for a, t in zip(got, twin):
            np.testing.assert_array_equal(a, t)
        pre = x.astype(np.float64) @ w + b
        np.testing.assert_allclose(got[-1], _act_ref(pre, act), rtol=2e-5, atol=2e-5)
        # the op's own generic impl (evaluate, GPUs) agrees as well
        generic = matmul_bias_act_p.impl(np, x, w, b, **params)
        np.testing.assert_allclose(generic[-1], got[-1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(256, 26, 26, 32), (7, 11, 11, 64), (3 * SUM_ROWS, 5),
                                   (SUM_ROWS + 1, 1), (4, 3)])
def test_relu_grad_sum_kernel_twin_and_definition(shape):
    rng = np.random.default_rng(2)
    ct = rng.standard_normal(shape).astype(np.float32)
    y = rng.standard_normal(shape).astype(np.float32)
    y.reshape(-1)[:7] = [0.0, -0.0, np.nan, np.inf, -np.inf, 1e-45, -1e-45]
    ct.reshape(-1)[7:10] = [np.nan, np.inf, -0.0]
    dz, db = np.empty_like(ct), np.empty(shape[-1], np.float32)
    assert relu_grad_sum_cpu(dz, db, ct, y, SUM_ROWS)
    tz, tb = np.empty_like(ct), np.empty(shape[-1], np.float32)
    relu_grad_sum_numpy(np, tz, tb, ct, y)
    np.testing.assert_array_equal(dz.view(np.int32), tz.view(np.int32))
    np.testing.assert_array_equal(db.view(np.int32), tb.view(np.int32))
    rz, rb = relu_grad_sum_ref(ct.astype(np.float64), y)
    np.testing.assert_array_equal(dz, rz.astype(np.float32))
    np.testing.assert_allclose(db, rb, rtol=1e-4, atol=1e-3 * math.sqrt(dz.size / shape[-1]))


def test_relu_grad_sum_registered_forms_agree():
    rng = np.random.default_rng(3)
    ct = rng.standard_normal((9, 5, 5, 16)).astype(np.float32)
    y = rng.standard_normal((9, 5, 5, 16)).astype(np.float32)
    entry = _entry(relu_grad_bias_sum_p)
    assert entry.exact
    params = {"members": ("relu_grad", "reduce_sum")}
    got = _run(entry.out, relu_grad_bias_sum_p, (ct, y), params)
    twin = _run(entry.numpy_out, relu_grad_bias_sum_p, (ct, y), params)
    generic = relu_grad_bias_sum_p.impl(np, ct, y, **params)
    for a, t, g in zip(got, twin, generic):
        np.testing.assert_array_equal(a, t)
        np.testing.assert_array_equal(a, g)


def test_relu_grad_sum_refuses_mismatched_operands():
    ct = np.ones((4, 3), np.float32)
    assert not relu_grad_sum_cpu(np.empty((4, 3), np.float64), np.empty(3), ct, ct, 8)
    assert not relu_grad_sum_cpu(np.empty((4, 3), np.float32), np.empty(4, np.float32), ct,
                                 ct, 8)
    assert not relu_grad_sum_cpu(np.empty((3, 4), np.float32).T, np.empty(3, np.float32), ct,
                                 ct, 8)


# ---------------------------------------------------------------- max pool's gradient


@pytest.mark.parametrize("shape,padding", [
    ((3, 26, 26, 32), "VALID"), ((2, 11, 11, 64), "VALID"), ((2, 11, 11, 3), "SAME"),
    ((1, 4, 6, 1), "VALID")])
def test_max_pool_grad_2x2_kernel_bits(shape, padding):
    """The tiling 2x2/2 kernel (kernels/pool.py _max_pool_grad_2x2; SAME on odd sizes takes
    the general loop) against the spec and the op's numpy form, bit for bit: ties go to
    the first max in row-major window order, NaN windows route nothing, dy's -0.0 lands
    as +0.0 (0 + dy), and rows and columns no window reads are zero."""
    from graphdist.kernels.pool import max_pool_grad_cpu, max_pool_grad_ref
    from graphdist.ops.pool import max_pool2d_grad_p, max_pool2d_p
    from graphdist.ops.window import window_geometry

    rng = np.random.default_rng(6)
    x = np.round(rng.standard_normal(shape), 1).astype(np.float32)   # ties within windows
    x.reshape(-1)[::97] = np.nan
    x[0, :2, :2, 0] = 0.5                                         # a window of equal values
    p = {"ksize": (2, 2), "strides": (2, 2), "padding": padding}
    y = max_pool2d_p.impl(np, x, **p)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    dy.reshape(-1)[::5] = -0.0
    _, pads = window_geometry("", shape[1:3], (2, 2), (2, 2), (1, 1), padding, "")
    got = np.full_like(x, 7.0)
    max_pool_grad_cpu(x, y, dy, got, (2, 2), (2, 2), (pads[0][0], pads[1][0]))
    want = max_pool2d_grad_p.impl(np, x, y, dy, **p)
    np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))
    ref = max_pool_grad_ref(x, y, dy, (2, 2), (2, 2), (pads[0][0], pads[1][0]))
    np.testing.assert_array_equal(got, ref)
    assert got[0, 0, 0, 0] == dy[0, 0, 0, 0] and got[0, 0, 1, 0] == 0 == got[0, 1, 0, 0]



def test_fused_ops_reject_bad_operands_naming_them():
    from graphdist.errors import ShapeError
    from graphdist.ir.types import ArrayType

    F32 = np.dtype(np.float32)
    x, w = ArrayType((6, 20), F32), ArrayType((20, 8), F32)
    base = dict(act="relu", has_bias=True, keep=False, members=("matmul", "add", "relu"))
    with pytest.raises(ShapeError,
                       match=r"matmul_bias_act: the bias must be f32\[8\].*got bias:f32\[6\]"):
        matmul_bias_act_p.out_types(x, w, ArrayType((6,), F32), **base)
    with pytest.raises(ShapeError, match="matmul_bias_act: expected 3 inputs"):
        matmul_bias_act_p.out_types(x, w, **base)
    with pytest.raises(ValueError, match="act must be one of"):
        matmul_bias_act_p.out_types(x, w, ArrayType((8,), F32), **dict(base, act="elu"))
    with pytest.raises(ValueError, match="keep=True .* is for gelu"):
        conv2d_bias_act_p.out_types(ArrayType((2, 5, 5, 1), F32),
                                    ArrayType((3, 3, 1, 4), F32),
                                    **dict(P, act="relu", has_bias=False, keep=True,
                                           members=("conv2d", "relu")))
    with pytest.raises(ShapeError, match="relu_grad"):
        relu_grad_bias_sum_p.out_types(ArrayType((4, 3), F32),
                                       ArrayType((4, 2), F32), members=())
