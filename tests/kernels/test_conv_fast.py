"""The direct few-channel conv2d kernel with its fused bias + relu epilogue (kernels/conv.py
conv_direct_cpu): against a float64 numpy convolution written from the definition, against
the op's im2col + GEMM path, and bit for bit against its numpy twin (ops/conv.py
conv_direct_numpy, the cold start's form)."""

from __future__ import annotations

import numpy as np
import pytest

from graphdist.kernels.conv import conv_direct_cpu
from graphdist.ops import OPS
from graphdist.ops.conv import conv_direct_numpy
from graphdist.ops.window import window_geometry

# (x shape, filter shape, strides, dilations, padding): the tutorial's first layer, and
# padding, strides and dilations on few channels
CASES = [((4, 28, 28, 1), (3, 3, 1, 32), (1, 1), (1, 1), "VALID"),
         ((3, 9, 11, 3), (3, 2, 3, 5), (2, 1), (1, 1), "SAME"),
         ((2, 10, 7, 2), (3, 3, 2, 16), (1, 2), (2, 1), "SAME"),
         ((2, 6, 6, 1), (5, 5, 1, 4), (1, 1), (1, 1), "SAME")]


def conv_float64(x, f, strides, dilations, padding):
    """conv2d from its definition in float64: y[b, i, j, o] = sum over p, q, c of
    x[b, i*sh + p*dh - top, j*sw + q*dw - left, c] * f[p, q, c, o], zero outside x."""
    out_hw, pads = window_geometry("conv2d", x.shape[1:3], f.shape[:2], strides, dilations,
                                   padding, "")
    xp = np.pad(x.astype(np.float64), ((0, 0), pads[0], pads[1], (0, 0)))
    y = np.zeros((x.shape[0], *out_hw, f.shape[3]))
    for p in range(f.shape[0]):
        for q in range(f.shape[1]):
            r0, s0 = p * dilations[0], q * dilations[1]
            win = xp[:, r0:r0 + (out_hw[0] - 1) * strides[0] + 1:strides[0],
                     s0:s0 + (out_hw[1] - 1) * strides[1] + 1:strides[1]]
            y += win @ f[p, q].astype(np.float64)
    return y, pads


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("epilogue", ["none", "bias", "bias+relu"])
@pytest.mark.parametrize("case", CASES)
def test_direct_conv_matches_definition_op_and_twin(case, epilogue, dtype):
    xs, fs, strides, dilations, padding = case
    rng = np.random.default_rng(sum(xs) + sum(fs))
    x = rng.standard_normal(xs).astype(dtype)
    f = rng.standard_normal(fs).astype(dtype)
    bias = rng.standard_normal(fs[3]).astype(dtype) if epilogue != "none" else None
    relu = epilogue == "bias+relu"
    want, pads = conv_float64(x, f, strides, dilations, padding)
    if bias is not None:
        want = want + bias
    if relu:
        want = np.maximum(want, 0)
    top_left = (pads[0][0], pads[1][0])
    got = np.full(want.shape, np.nan, dtype)          # every element must be written
    conv_direct_cpu(x, f, got, strides, dilations, top_left, bias, relu)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    op = OPS["conv2d"].impl(np, x, f, strides=strides, padding=padding, dilations=dilations)
    op = np.maximum(op + bias, 0) if relu else op if bias is None else op + bias
    np.testing.assert_allclose(got, op, rtol=tol, atol=tol)
    twin = np.full(want.shape, np.nan, dtype)
    conv_direct_numpy(np, x, f, twin, strides, dilations, top_left, bias, relu)
    assert np.array_equal(got, twin)


def test_direct_conv_relu_treats_nan_as_numpy():
    """relu in the epilogue is np.maximum(., 0): a NaN stays NaN (not 0) and -0.0 becomes
    0.0, as in the unfused relu op, and the twin gives the same bits."""
    x = np.zeros((1, 4, 4, 1), np.float32)
    x[0, 1, 1, 0] = np.nan
    f = np.ones((3, 3, 1, 2), np.float32)
    bias = np.array([-1.0, 0.0], np.float32)
    got = np.empty((1, 2, 2, 2), np.float32)
    twin = np.empty_like(got)
    conv_direct_cpu(x, f, got, (1, 1), (1, 1), (0, 0), bias, True)
    conv_direct_numpy(np, x, f, twin, (1, 1), (1, 1), (0, 0), bias, True)
    assert np.isnan(got[0, 0, 0]).all()                    # every window holds the NaN
    assert np.array_equal(got, twin, equal_nan=True)
    unfused = np.maximum(OPS["conv2d"].impl(np, x, f, strides=(1, 1), padding="VALID",
                                            dilations=(1, 1)) + bias, 0)
    assert np.array_equal(np.isnan(got), np.isnan(unfused))


@pytest.mark.parametrize("epilogue", ["none", "bias", "bias+relu"])
@pytest.mark.parametrize("case", CASES + [((40, 13, 13, 32), (3, 3, 32, 64), (1, 1), (1, 1),
                                           "VALID")])
def test_blocked_im2col_with_fused_epilogue(case, epilogue, monkeypatch):
    """ops/conv.py conv2d_bias_act_out: blocks of images (several, forced small here) each
    made by im2col + GEMM with the bias and relu applied to the block, against the float64
    definition and the three unfused ops."""
    from graphdist.ops import conv

    monkeypatch.setattr(conv, "EPILOGUE_BYTES", 64 << 10)     # several blocks per call
    xs, fs, strides, dilations, padding = case
    rng = np.random.default_rng(sum(xs) + 7)
    x = rng.standard_normal(xs).astype(np.float32)
    f = rng.standard_normal(fs).astype(np.float32)
    bias = rng.standard_normal(fs[3]).astype(np.float32) if epilogue != "none" else None
    relu = epilogue == "bias+relu"
    want, _ = conv_float64(x, f, strides, dilations, padding)
    unfused = OPS["conv2d"].impl(np, x, f, strides=strides, padding=padding,
                                 dilations=dilations)
    if bias is not None:
        want, unfused = want + bias, OPS["add"].impl(np, unfused, bias)
    if relu:
        want, unfused = np.maximum(want, 0), OPS["relu"].impl(np, unfused)
    got = np.full(want.shape, np.nan, np.float32)
    conv.conv2d_bias_act_out(np, got, x, f, bias, relu, strides=strides, padding=padding,
                             dilations=dilations)
    tol = 1e-5 * np.sqrt(f[..., 0].size)           # float32 sums of KH*KW*C products
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    np.testing.assert_allclose(got, unfused, rtol=tol, atol=tol)


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bias_act_kernel_gives_numpys_bits(with_bias, relu):
    """kernels/conv.py bias_act_cpu against ops/conv.py bias_act_numpy (its twin) and the
    unfused add and relu ops, NaN, infinities and -0.0 included."""
    from graphdist.kernels.conv import bias_act_cpu
    from graphdist.ops.conv import bias_act_numpy

    rng = np.random.default_rng(3)
    y = rng.standard_normal((3 * 26 * 26, 32)).astype(np.float32)
    y[0, :4] = [np.nan, -0.0, np.inf, -np.inf]
    bias = rng.standard_normal(32).astype(np.float32) if with_bias else None
    if with_bias:
        bias[1] = 0.0
    want = OPS["add"].impl(np, y, bias) if with_bias else y.copy()
    want = OPS["relu"].impl(np, want) if relu else want
    got, twin = y.copy(), y.copy()
    bias_act_cpu(got, bias, relu)
    bias_act_numpy(np, twin, bias, relu)
    assert np.array_equal(got.view(np.int32), want.view(np.int32))
    assert np.array_equal(twin.view(np.int32), want.view(np.int32))


def test_blocked_conv_with_the_kernel_epilogue_gives_the_numpy_forms_bits(monkeypatch):
    from graphdist.kernels.conv import bias_act_cpu
    from graphdist.ops import conv

    monkeypatch.setattr(conv, "EPILOGUE_BYTES", 64 << 10)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((12, 28, 28, 1)).astype(np.float32)
    f = rng.standard_normal((3, 3, 1, 32)).astype(np.float32)
    bias = rng.standard_normal(32).astype(np.float32)
    got, twin = (np.empty((12, 26, 26, 32), np.float32) for _ in range(2))
    p = {"strides": (1, 1), "padding": "VALID", "dilations": (1, 1)}
    conv.conv2d_bias_act_out(np, got, x, f, bias, True, **p, epilogue=bias_act_cpu)
    conv.conv2d_bias_act_out(np, twin, x, f, bias, True, **p)
    assert np.array_equal(got, twin)
    want, _ = conv_float64(x, f, (1, 1), (1, 1), "VALID")
    np.testing.assert_allclose(got, np.maximum(want + bias, 0), rtol=1e-5, atol=1e-5)
