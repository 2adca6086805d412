"""relu's one-pass gradient (relu_grad) and max_pool2d's forward kernel: each kernel against
its numpy reference and an independent formula, float32 and float64, through the compiled
path (the registered out= kernel runs), under merged replicas, and relu's second-order gradient."""

from __future__ import annotations

import numpy as np
import pytest

import graphdist as gd
from graphdist.ops import OPS, bind
from graphdist.ops.window import window_geometry

DTYPES = [np.float32, np.float64]


def _grad(fn):
    return lambda x: gd.value_and_grad(fn)(x)[1]


def _relu_grad_formula(ct, y):
    out = ct.copy()
    out[~(y > 0)] = 0          # NaN in y: not > 0
    return out


# ---------------------------------------------------------------- relu_grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (7,), (25, 40), (300, 1001), (3, 1, 5)])
def test_relu_grad_kernel_matches_reference(dtype, shape):
    from graphdist.kernels.relu import relu_grad_cpu, relu_grad_ref

    rng = np.random.default_rng(0)
    ct = np.asarray(rng.standard_normal(shape), dtype)
    y = np.asarray(rng.standard_normal(shape), dtype)
    if y.size:
        y.reshape(-1)[::5] = 0
        y.reshape(-1)[1::7] = np.nan
    want = _relu_grad_formula(ct, y)
    np.testing.assert_array_equal(relu_grad_ref(ct, y), want)
    out = np.full_like(ct, 7)
    assert relu_grad_cpu(ct, y, out)
    np.testing.assert_array_equal(out, want)
    for alias in ("ct", "y"):                # out may be either input
        c, yy = ct.copy(), y.copy()
        assert relu_grad_cpu(c, yy, c if alias == "ct" else yy)
        np.testing.assert_array_equal(c if alias == "ct" else yy, want)
    np.testing.assert_array_equal(bind(OPS["relu_grad"], ct, y), want)
    got = np.full_like(ct, 7)
    OPS["relu_grad"].out_impl(np, got, ct, y)            # the generic out= form
    np.testing.assert_array_equal(got, want)


def test_relu_grad_kernel_refuses_what_it_cannot_run():
    from graphdist.kernels.relu import relu_grad_cpu

    ct, y = np.ones((4, 6)), np.ones((4, 6))
    assert not relu_grad_cpu(ct[:, ::2], y[:, ::2], np.empty((4, 3)))
    assert not relu_grad_cpu(ct, y.astype(np.float32), np.empty((4, 6)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_compiled_relu_gradient_runs_the_kernel_once(dtype, monkeypatch):
    """relu_grad standing alone runs its kernel (with the fuse_elementwise stage on, it and
    the `* 2.0` become one fused loop, tested in tests/passes/test_fuse_elementwise.py)."""
    from graphdist import pipeline
    from graphdist.runtime import kernel_table

    monkeypatch.setattr(pipeline, "elementwise_fusion", lambda: [])
    key, calls = ("cpu", "relu_grad"), []
    kernel = kernel_table.ENTRIES[key].out
    monkeypatch.setitem(kernel_table.ENTRIES, key, kernel_table.ENTRIES[key].replace(
        out=lambda *a, **kw: calls.append(kernel(*a, **kw))))
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 100)).astype(dtype)
    ct = rng.standard_normal((64, 100)).astype(dtype)
    f = gd.function(lambda x: _grad(lambda x: gd.reduce_sum(gd.relu(x) * ct))(x) * 2.0)
    got = f(x)
    assert len(calls) == 1
    assert got.dtype == dtype
    np.testing.assert_allclose(got, 2 * _relu_grad_formula(ct, x), rtol=1e-6)


def test_relu_second_order_gradient():
    """d/dx of <relu'(x) * x, 1> = relu'(x) (relu_grad's vjp w.r.t. ct; none w.r.t. y)."""
    rng = np.random.default_rng(2)
    x = rng.uniform(0.2, 2.0, (30,)) * rng.choice([-1.0, 1.0], (30,))

    def inner(x):
        return _grad(lambda x: gd.reduce_sum(gd.relu(x) * x))(x)    # 2 x (x > 0)

    np.testing.assert_allclose(gd.function(inner)(x), 2 * x * (x > 0))
    g2 = gd.function(_grad(lambda x: gd.reduce_sum(inner(x) ** 2)))(x)
    np.testing.assert_allclose(g2, 8 * x * (x > 0), rtol=1e-12)
    # relu_grad's own vjp: w.r.t. ct the same mask, nothing w.r.t. y
    ct = rng.standard_normal(30)
    g = _grad(lambda ct: gd.reduce_sum(bind(OPS["relu_grad"], ct, x) * 3.0))(ct)
    np.testing.assert_allclose(g, 3.0 * (x > 0))


def test_relu_gradient_under_merged_replicas():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((16, 40)).astype(np.float32)
    w = rng.standard_normal((40, 40)).astype(np.float32)
    strategy = gd.MirroredStrategy([f"cpu:{i}" for i in range(4)])
    gd.config.set_device_concurrency("merged")
    try:
        @gd.function
        def step(xs, w):
            def replica_fn(x, w):
                return _grad(lambda x: gd.reduce_sum(gd.relu(gd.matmul(x, w)) ** 2))(x)
            return strategy.run(replica_fn, args=(xs, w))

        got = step(gd.PerReplica(tuple(np.array_split(x, 4))), w)
        assert step.replicated_graph.merged
    finally:
        gd.config.set_device_concurrency("auto")
    for k, xs in enumerate(np.array_split(x, 4)):
        h = xs @ w
        np.testing.assert_allclose(got.values[k], (2 * h * (h > 0)) @ w.T, rtol=1e-4,
                                   atol=1e-4)


# ---------------------------------------------------------------- max_pool2d forward


def _max_pool_formula(x, ksize, strides, padding):
    """Pad with -inf as TF's geometry says, then take each window's max by explicit loops."""
    out_hw, pads = window_geometry("", x.shape[1:3], ksize, strides, (1, 1), padding, "")
    xp = np.pad(x, ((0, 0), pads[0], pads[1], (0, 0)), constant_values=-np.inf)
    y = np.empty((x.shape[0], *out_hw, x.shape[3]), x.dtype)
    for i in range(out_hw[0]):
        for j in range(out_hw[1]):
            win = xp[:, i * strides[0]:i * strides[0] + ksize[0],
                     j * strides[1]:j * strides[1] + ksize[1]]
            y[:, i, j] = win.reshape(x.shape[0], -1, x.shape[3]).max(axis=1)
    return y


GEOMETRIES = [("VALID", (2, 2), (2, 2)), ("SAME", (2, 2), (2, 2)), ("SAME", (3, 3), (1, 1)),
              ("VALID", (3, 2), (2, 3)), ("SAME", (2, 3), (3, 1)), ("VALID", (1, 1), (1, 1))]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("padding,ksize,strides", GEOMETRIES)
def test_max_pool_kernel_matches_reference(dtype, padding, ksize, strides):
    from graphdist.kernels.pool import max_pool_cpu, max_pool_ref

    rng = np.random.default_rng(4)
    x = rng.integers(-3, 3, (3, 7, 9, 5)).astype(dtype)     # ties and negatives
    x[0, 1, 2, 3] = np.nan
    p = {"ksize": ksize, "strides": strides, "padding": padding}
    want = _max_pool_formula(x, **p)
    out_hw, pads = window_geometry("", x.shape[1:3], ksize, strides, (1, 1), padding, "")
    top_left = (pads[0][0], pads[1][0])
    np.testing.assert_array_equal(max_pool_ref(x, ksize, strides, top_left, out_hw), want)
    y = np.full(want.shape, 7, dtype)
    max_pool_cpu(x, y, ksize, strides, top_left)
    np.testing.assert_array_equal(y, want)
    np.testing.assert_array_equal(OPS["max_pool2d"].impl(np, x, **p), want)   # the op's impl


@pytest.mark.parametrize("dtype", DTYPES)
def test_max_pool_kernel_at_the_tutorial_size(dtype):
    from graphdist.kernels.pool import max_pool_cpu

    x = np.random.default_rng(5).standard_normal((64, 26, 26, 32)).astype(dtype)
    y = np.empty((64, 13, 13, 32), dtype)
    max_pool_cpu(x, y, (2, 2), (2, 2), (0, 0))
    np.testing.assert_array_equal(y, x.reshape(64, 13, 2, 13, 2, 32).max(axis=(2, 4)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_compiled_max_pool_runs_the_kernel(dtype, monkeypatch):
    from graphdist.runtime import kernel_table

    key, calls = ("cpu", "max_pool2d"), []
    kernel = kernel_table.ENTRIES[key].out
    monkeypatch.setitem(kernel_table.ENTRIES, key, kernel_table.ENTRIES[key].replace(
        out=lambda *a, **kw: calls.append(kernel(*a, **kw))))
    x = np.random.default_rng(6).standard_normal((8, 16, 16, 8)).astype(dtype)
    f = gd.function(lambda x: gd.nn.max_pool2d(x, 3, 2, "SAME") * 2.0)
    got = f(x)
    assert len(calls) == 1 and got.dtype == dtype
    np.testing.assert_array_equal(got, 2 * _max_pool_formula(x, (3, 3), (2, 2), "SAME"))
