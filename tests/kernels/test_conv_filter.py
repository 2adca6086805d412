"""conv2d's filter gradient for few input channels (kernels/conv_filter.py, through the
CPU kernel entry of runtime/adapters/nn.py): the Numba kernel against its numpy twin bit
for bit (the twin runs a program's first calls while Numba loads), against the gradient
written from its definition in float64, and the same bits whatever the thread count."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from graphdist.ir.types import ArrayType
from graphdist.kernels.common import numba_threads
from graphdist.kernels.conv_filter import filter_grad_groups_cpu
from graphdist.ops.conv import (FILTER_GROUP_ACCUMULATORS, conv2d_backprop_filter_p, conv2d_p,
                                filter_grad_groups_fit, filter_grad_groups_numpy)
from graphdist.runtime import kernel_table

P = {"strides": (1, 1), "padding": "VALID", "dilations": (1, 1)}


def _ref(x, dy, k_hw, pads=((0, 0), (0, 0))):
    """dw[p, q, c, o] = sum over n, i, j of x[n, i + p, j + q, c] dy[n, i, j, o] (float64),
    x padded with zeros."""
    xp = np.pad(x.astype(np.float64), ((0, 0), *pads, (0, 0)))
    win = np.lib.stride_tricks.sliding_window_view(xp, k_hw, axis=(1, 2))[:, :dy.shape[1],
                                                                            :dy.shape[2]]
    return np.einsum("nijcpq,nijo->pqco", win, dy.astype(np.float64))


def _operands(rng, n, hw, c, o, k_hw, dtype=np.float32):
    x = rng.standard_normal((n, *hw, c)).astype(dtype)
    dy = rng.standard_normal((n, hw[0] - k_hw[0] + 1, hw[1] - k_hw[1] + 1, o)).astype(dtype)
    return x, dy


# output widths 5..8 cover every remainder of the groups of four; one output channel too
SHAPES = [(3, (7, 7), 1, 32, (3, 3)), (2, (8, 9), 1, 5, (3, 3)), (2, (9, 10), 3, 8, (3, 3)),
          (4, (6, 11), 2, 1, (2, 4)), (1, (5, 5), 1, 3, (5, 5))]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_kernel_gives_its_twin_s_bits_and_the_definition_s_values(shape, dtype):
    x, dy = _operands(np.random.default_rng(0), *shape, dtype=dtype)
    k_hw = shape[4]
    got = np.full((*k_hw, x.shape[3], dy.shape[3]), np.nan, dtype)
    twin = np.full_like(got, np.nan)
    assert filter_grad_groups_cpu(x, dy, got)
    filter_grad_groups_numpy(np, x, dy, twin)
    np.testing.assert_array_equal(got, twin)
    tol = 2e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(got, _ref(x, dy, k_hw), rtol=tol, atol=tol * 10)


def test_the_bits_do_not_depend_on_the_thread_count():
    x, dy = _operands(np.random.default_rng(1), 64, (28, 28), 1, 32, (3, 3))
    outs = []
    for threads in sorted({1, numba.config.NUMBA_NUM_THREADS}):
        with numba_threads(threads):
            out = np.empty((3, 3, 1, 32), np.float32)
            assert filter_grad_groups_cpu(x, dy, out)
            outs.append(out)
    for out in outs[1:]:
        np.testing.assert_array_equal(outs[0], out)


def test_operands_it_does_not_take_are_refused_untouched():
    x, dy = _operands(np.random.default_rng(2), 2, (6, 6), 1, 4, (3, 3))
    dw = np.full((3, 3, 1, 4), 7.0, np.float32)
    assert not filter_grad_groups_cpu(x[:, ::-1], dy, dw)              # not contiguous
    assert not filter_grad_groups_cpu(x.astype(np.float64), dy, dw)    # dtypes differ
    assert not filter_grad_groups_cpu(x, dy[:, :-1], dw)               # not stride 1 VALID
    assert (dw == 7.0).all()


def _entry_forms():
    entry = kernel_table.entry("cpu", "conv2d_backprop_filter")
    return entry.out, entry.numpy_out


@pytest.mark.parametrize("padding", ["VALID", "SAME"])
def test_the_kernel_entry_and_its_twin_agree_with_padding(padding):
    """SAME pads x with zeros first (both forms); the values are the definition's."""
    kernel, twin = _entry_forms()
    x, _ = _operands(np.random.default_rng(3), 3, (9, 8), 1, 16, (3, 3))
    dy = np.random.default_rng(4).standard_normal(
        (3, 9, 8, 16) if padding == "SAME" else (3, 7, 6, 16)).astype(np.float32)
    params = {**P, "padding": padding, "filter_size": (3, 3)}
    outs = [np.full((3, 3, 1, 16), np.nan, np.float32) for _ in range(2)]
    kernel(outs[0], x, dy, **params)
    twin(outs[1], x, dy, **params)
    np.testing.assert_array_equal(outs[0], outs[1])
    pads = ((1, 1), (1, 1)) if padding == "SAME" else ((0, 0), (0, 0))
    np.testing.assert_allclose(outs[0], _ref(x, dy, (3, 3), pads), rtol=2e-5, atol=2e-4)


@pytest.mark.parametrize("case", ["channels", "stride", "dilation", "accumulators"])
def test_convolutions_outside_its_fit_run_the_gemms(case):
    """Four input channels, strides, dilations, or more accumulators than
    FILTER_GROUP_ACCUMULATORS: the GEMM form, in both forms of the entry."""
    c, o, k, params = 1, 8, 3, dict(P)
    if case == "channels":
        c = 4
    elif case == "stride":
        params["strides"] = (2, 2)
    elif case == "dilation":
        params["dilations"] = (2, 2)
    else:
        o = FILTER_GROUP_ACCUMULATORS // 9 + 1
    params["filter_size"] = (k, k)
    x = np.random.default_rng(5).standard_normal((2, 12, 12, c)).astype(np.float32)
    assert filter_grad_groups_fit(x.shape, o, dtype=x.dtype, **params) is None
    (y,) = conv2d_p.out_types(ArrayType(x.shape, x.dtype), ArrayType((k, k, c, o), x.dtype),
                              strides=params["strides"], padding="VALID",
                              dilations=params["dilations"])
    dy = np.random.default_rng(6).standard_normal(y.shape).astype(np.float32)
    outs = [np.empty((k, k, c, o), np.float32) for _ in range(2)]
    for out, form in zip(outs, _entry_forms()):
        form(out, x, dy, **params)
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_allclose(outs[0], conv2d_backprop_filter_p.impl(np, x, dy, **params),
                               rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("shape", [(3, (10, 12), 1, 16, (3, 3)), (2, (9, 11), 3, 5, (3, 3)),
                                   (2, (8, 7), 2, 3, (2, 3))], ids=str)
def test_the_pooled_form_gives_the_bits_of_the_pool_gradient_then_the_filter_gradient(shape):
    """conv2d_backprop_filter_pooled (a 2x2 max pool's gradient, routed by its argmax, into
    the filter gradient) against the pool's gradient kernel then the groups kernel, and
    against both twins, bit for bit: odd output sizes (rows and columns no window reaches),
    ties."""
    from graphdist.kernels.conv_filter import pooled_filter_grad_cpu
    from graphdist.ops import OPS

    n, hw, c, o, k_hw = shape
    rng = np.random.default_rng(9)
    x = rng.standard_normal((n, *hw, c)).astype(np.float32)
    out_hw = (hw[0] - k_hw[0] + 1, hw[1] - k_hw[1] + 1)
    a = rng.integers(0, 3, (n, *out_hw, o)).astype(np.float32)          # ties
    pool = {"ksize": (2, 2), "strides": (2, 2), "padding": "VALID"}
    _, idx = OPS["max_pool2d_argmax"].impl(np, a, **pool)
    g = rng.standard_normal(idx.shape).astype(np.float32)
    g.reshape(-1)[::5] = -0.0
    dy = np.empty_like(a)
    kernel_table.entry("cpu", "max_pool2d_grad_argmax").out(dy, idx, g, input_size=out_hw,
                                                            **pool)
    want = np.empty((*k_hw, c, o), np.float32)
    assert filter_grad_groups_cpu(x, dy, want)
    got = np.full_like(want, np.nan)
    assert pooled_filter_grad_cpu(x, idx, g, got, out_hw)
    np.testing.assert_array_equal(got, want)
    entry = kernel_table.entry("cpu", "conv2d_backprop_filter_pooled")
    params = {**P, "filter_size": k_hw, "input_size": out_hw,
              "members": ("max_pool2d_grad_argmax", "conv2d_backprop_filter")}
    for form in (entry.out, entry.numpy_out):
        out = np.full_like(want, np.nan)
        form(out, x, idx, g, **params)
        np.testing.assert_array_equal(out, want)
    np.testing.assert_allclose(want, _ref(x, dy, k_hw), rtol=2e-5, atol=2e-4)
