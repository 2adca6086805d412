"""Convolutions, pooling, pad, reduce_min, argmax and clip_by_value: forward against direct
loop references (Python loops over output pixels and window taps, independent of the
im2col impl), TF's SAME geometry, the backward ops against their own loops and finite
differences, eager vs compiled, the batching rules (2 replicas, per-device and merged, equal
one device), the max-pool gradient kernel, and the errors. SWEEP feeds tests/ops/test_ops.py."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

import graphdist as gd
from graphdist.ops import OPS, bind

F64 = np.float64

# ---------------------------------------------------------------- loop references


def tf_same(n, k, s, d=1):
    """TF's SAME: ceil(n / s) outputs, padding max((out - 1) * s + (k - 1) * d + 1 - n, 0)
    with the smaller half before."""
    out = math.ceil(n / s)
    total = max((out - 1) * s + (k - 1) * d + 1 - n, 0)
    return out, total // 2


def geometry(n, k, s, d, padding):
    if padding == "SAME":
        return tf_same(n, k, s, d)
    return (n - (k - 1) * d - 1) // s + 1, 0


def windows(x_hw, k_hw, strides, dilations, padding):
    """Yield (a, b, taps) per output pixel, taps the (i, j, r, q) inside the input."""
    (oh, top), (ow, left) = (geometry(n, k, s, d, padding)
                             for n, k, s, d in zip(x_hw, k_hw, strides, dilations))
    for a in range(oh):
        for b in range(ow):
            yield a, b, [(i, j, r, q) for i in range(k_hw[0]) for j in range(k_hw[1])
                         for r in [a * strides[0] + i * dilations[0] - top]
                         for q in [b * strides[1] + j * dilations[1] - left]
                         if 0 <= r < x_hw[0] and 0 <= q < x_hw[1]]


def out_hw(x_hw, k_hw, strides, dilations, padding):
    return tuple(geometry(n, k, s, d, padding)[0]
                 for n, k, s, d in zip(x_hw, k_hw, strides, dilations))


def conv_ref(x, f, strides, padding, dilations):
    n, o = x.shape[0], f.shape[3]
    out = np.zeros((n, *out_hw(x.shape[1:3], f.shape[:2], strides, dilations, padding), o),
                   x.dtype)
    for a, b, taps in windows(x.shape[1:3], f.shape[:2], strides, dilations, padding):
        for i, j, r, q in taps:
            out[:, a, b, :] += x[:, r, q, :] @ f[i, j]
    return out


def conv_input_ref(dy, f, input_hw, strides, padding, dilations):
    dx = np.zeros((dy.shape[0], *input_hw, f.shape[2]), dy.dtype)
    for a, b, taps in windows(input_hw, f.shape[:2], strides, dilations, padding):
        for i, j, r, q in taps:
            dx[:, r, q, :] += dy[:, a, b, :] @ f[i, j].T
    return dx


def conv_filter_ref(x, dy, k_hw, strides, padding, dilations):
    dw = np.zeros((*k_hw, x.shape[3], dy.shape[3]), x.dtype)
    for a, b, taps in windows(x.shape[1:3], k_hw, strides, dilations, padding):
        for i, j, r, q in taps:
            dw[i, j] += x[:, r, q, :].T @ dy[:, a, b, :]
    return dw


def pool_ref(x, ksize, strides, padding, kind):
    out = np.zeros((x.shape[0], *out_hw(x.shape[1:3], ksize, strides, (1, 1), padding),
                    x.shape[3]), x.dtype)
    for a, b, taps in windows(x.shape[1:3], ksize, strides, (1, 1), padding):
        vals = np.stack([x[:, r, q, :] for _, _, r, q in taps])
        out[:, a, b, :] = vals.max(axis=0) if kind == "max" else vals.mean(axis=0)
    return out


def max_pool_grad_ref(x, dy, ksize, strides, padding):
    """Each window's gradient to its first max (TF), overlapping windows adding up."""
    dx = np.zeros_like(x)
    for a, b, taps in windows(x.shape[1:3], ksize, strides, (1, 1), padding):
        for n, c in np.ndindex(x.shape[0], x.shape[3]):
            vals = [x[n, r, q, c] for _, _, r, q in taps]
            _, _, r, q = taps[int(np.argmax(vals))]
            dx[n, r, q, c] += dy[n, a, b, c]
    return dx


# ---------------------------------------------------------------- forward vs loops

COMBOS = list(itertools.product(["SAME", "VALID"], [1, 2, (2, 1)], [1, 2]))


def _pair(v):
    return (v, v) if isinstance(v, int) else v


@pytest.mark.parametrize("dtype", [np.float32, F64])
@pytest.mark.parametrize("kernel", [(3, 3), (2, 3)])
@pytest.mark.parametrize("padding,strides,dilations", COMBOS)
def test_conv2d_and_its_backward_ops_match_loops(padding, strides, dilations, kernel, dtype):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 7, 9, 2)).astype(dtype)
    f = rng.standard_normal((*kernel, 2, 3)).astype(dtype)
    s, d = _pair(strides), _pair(dilations)
    y = gd.nn.conv2d(x, f, strides, padding, dilations)
    want = conv_ref(x, f, s, padding, d)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == np.float32 else {"rtol": 1e-12, "atol": 1e-12}
    assert y.shape == want.shape and y.dtype == dtype
    np.testing.assert_allclose(y, want, **tol)
    dy = rng.standard_normal(y.shape).astype(dtype)
    p = {"strides": s, "padding": padding, "dilations": d}
    dx = bind(OPS["conv2d_backprop_input"], dy, f, input_size=(7, 9), **p)
    np.testing.assert_allclose(dx, conv_input_ref(dy, f, (7, 9), s, padding, d), **tol)
    dw = bind(OPS["conv2d_backprop_filter"], x, dy, filter_size=kernel, **p)
    np.testing.assert_allclose(dw, conv_filter_ref(x, dy, kernel, s, padding, d), **tol)
    assert dx.dtype == dw.dtype == dtype


@pytest.mark.parametrize("channels", [1, 3, 4, 8])     # both im2col layouts
def test_conv2d_im2col_layouts_agree(channels):
    rng = np.random.default_rng(channels)
    x = rng.standard_normal((3, 6, 5, channels))
    f = rng.standard_normal((3, 2, channels, 4))
    np.testing.assert_allclose(gd.nn.conv2d(x, f, (1, 2), "SAME", 1),
                               conv_ref(x, f, (1, 2), "SAME", (1, 1)), rtol=1e-12, atol=1e-12)
    dy = rng.standard_normal((3, 6, 3, 4))
    dw = bind(OPS["conv2d_backprop_filter"], x, dy, filter_size=(3, 2), strides=(1, 2),
              padding="SAME", dilations=(1, 1))
    np.testing.assert_allclose(dw, conv_filter_ref(x, dy, (3, 2), (1, 2), "SAME", (1, 1)),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n,k,s,d,out,before", [
    (7, 3, 2, 1, 4, 1), (8, 3, 2, 1, 4, 0), (7, 2, 2, 1, 4, 0), (9, 3, 1, 2, 9, 2),
    (5, 4, 3, 1, 2, 1), (28, 3, 1, 1, 28, 1), (28, 5, 2, 1, 14, 1), (6, 1, 4, 1, 2, 0),
    (13, 3, 2, 2, 7, 2)])
def test_same_geometry_is_tfs(n, k, s, d, out, before):
    assert tf_same(n, k, s, d) == (out, before)          # the reference itself, by hand
    x = np.zeros((1, n, 3, 1))
    assert gd.nn.conv2d(x, np.zeros((k, 1, 1, 1)), (s, 1), "SAME", (d, 1)).shape[1] == out
    # the padding sits where TF puts it: a one-hot input shows which output row sees it
    x[0, 0, 0, 0] = 1.0
    y = gd.nn.conv2d(x, np.ones((k, 1, 1, 1)), (s, 1), "SAME", (d, 1))
    seen = [a for a in range(out) if y[0, a, 0, 0]]
    assert seen == [a for a in range(out) if any(a * s + i * d - before == 0 for i in range(k))]


def test_strides_and_dilations_accept_tf_forms():
    rng = np.random.default_rng(0)
    x, f = rng.standard_normal((1, 9, 9, 2)), rng.standard_normal((3, 3, 2, 2))
    want = gd.nn.conv2d(x, f, (2, 2), "VALID", (1, 1))
    for s in (2, [2], [1, 2, 2, 1]):
        np.testing.assert_array_equal(gd.nn.conv2d(x, f, s, "valid", [1, 1, 1, 1]), want)


@pytest.mark.parametrize("dtype", [np.float32, F64])
@pytest.mark.parametrize("kind", ["max", "avg"])
@pytest.mark.parametrize("padding", ["SAME", "VALID"])
@pytest.mark.parametrize("ksize,strides", [(2, 2), ((3, 2), 1), ((3, 3), (2, 1)),
                                           ((2, 3), [1, 2, 1, 1])])
def test_pools_match_loops(ksize, strides, padding, kind, dtype):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 7, 9, 3)).astype(dtype)
    fn = gd.nn.max_pool2d if kind == "max" else gd.nn.avg_pool2d
    k = _pair(ksize)
    s = _pair(strides) if not isinstance(strides, list) else (strides[1], strides[2])
    y = fn(x, ksize, strides, padding)
    want = pool_ref(x, k, s, padding, kind)
    assert y.shape == want.shape and y.dtype == dtype
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)
    dy = rng.standard_normal(y.shape).astype(dtype)
    p = {"ksize": k, "strides": s, "padding": padding}
    if kind == "max":
        got = bind(OPS["max_pool2d_grad"], x, y, dy, **p)
        np.testing.assert_allclose(got, max_pool_grad_ref(x, dy, k, s, padding), rtol=1e-6)
    else:   # each window's share to every element it averaged (SAME: only those inside)
        got = bind(OPS["avg_pool2d_grad"], dy, input_size=(7, 9), **p)
        np.testing.assert_allclose(got, avg_pool_grad_ref(dy, (7, 9), **p), rtol=1e-6,
                                   atol=1e-6)


def test_avg_pool_same_counts_only_the_inside():
    x = np.arange(9.0).reshape(1, 3, 3, 1)
    np.testing.assert_array_equal(gd.nn.avg_pool2d(x, 2, 2, "SAME")[0, ..., 0],
                                  [[2.0, 3.5], [6.5, 8.0]])


# ---------------------------------------------------------------- gradients


def _loss_grads(fn, args, argnums, ct):
    return gd.value_and_grad(lambda *a: gd.reduce_sum(fn(*a) * ct), argnums=argnums)(*args)[1]


def fd_check(fn, args, argnums=(0,), eps=1e-6, rtol=1e-6, seed=0):
    """<t, grad> against central differences along a random direction t, in float64."""
    rng = np.random.default_rng(seed)
    args = [np.asarray(a, F64) for a in args]
    ct = rng.standard_normal(np.shape(fn(*args)))
    grads = _loss_grads(fn, args, tuple(argnums), ct)
    ts = [rng.standard_normal(args[k].shape) for k in argnums]
    lhs = sum(float(np.vdot(t, g)) for t, g in zip(ts, grads))

    def at(sign):
        xs = list(args)
        for k, t in zip(argnums, ts):
            xs[k] = args[k] + sign * eps * t
        return float(np.vdot(fn(*xs), ct))
    rhs = (at(1) - at(-1)) / (2 * eps)
    assert abs(lhs - rhs) <= rtol * max(1.0, abs(lhs), abs(rhs)), (lhs, rhs)


@pytest.mark.parametrize("padding,strides,dilations", COMBOS)
def test_conv2d_gradients_match_finite_differences(padding, strides, dilations):
    rng = np.random.default_rng(2)
    x, f = rng.standard_normal((2, 5, 6, 2)), rng.standard_normal((2, 3, 2, 3))
    fd_check(lambda x, f: gd.nn.conv2d(x, f, strides, padding, dilations), (x, f), (0, 1))


@pytest.mark.parametrize("padding,strides", [("SAME", 2), ("VALID", (2, 1))])
def test_second_order_conv_gradients_match_finite_differences(padding, strides):
    """The backward ops' own vjps: a gradient penalty differentiates through them."""
    rng = np.random.default_rng(3)
    x, f = rng.standard_normal((2, 5, 6, 2)), rng.standard_normal((3, 2, 2, 3))

    def penalty(x, f):
        def inner(x, f):
            return gd.reduce_sum(gd.tanh(gd.nn.conv2d(x, f, strides, padding)))
        gx, gf = gd.value_and_grad(inner, argnums=(0, 1))(x, f)[1]
        return gd.reduce_sum(gx * gx) + gd.reduce_sum(gf * gf)
    fd_check(lambda x, f: penalty(x, f), (x, f), (0, 1), rtol=1e-5)


@pytest.mark.parametrize("kind", ["max", "avg"])
@pytest.mark.parametrize("padding,ksize,strides", [("SAME", 3, 2), ("VALID", (2, 3), 1),
                                                   ("SAME", 2, (1, 2))])
def test_pool_gradients_match_finite_differences(kind, padding, ksize, strides):
    rng = np.random.default_rng(4)
    x = rng.permutation(2 * 5 * 6 * 2).reshape(2, 5, 6, 2) * 0.1   # no ties: FD is exact
    fn = gd.nn.max_pool2d if kind == "max" else gd.nn.avg_pool2d
    fd_check(lambda x: fn(x, ksize, strides, padding), (x,))


def test_max_pool_gradient_goes_to_the_first_max_on_ties():
    x = np.array([[3.0, 1.0, 3.0], [3.0, 3.0, 0.0], [2.0, 3.0, 3.0]]).reshape(1, 3, 3, 1)
    for traced in (False, True):
        def loss(x):
            return gd.reduce_sum(gd.nn.max_pool2d(x, 2, 1, "VALID"))
        grad = gd.value_and_grad(gd.function(loss) if traced else loss)(x)[1]
        # windows' first maxima: (0,0) (0,2) (1,0) (1,1)
        np.testing.assert_array_equal(grad[0, ..., 0], [[1, 0, 1], [1, 1, 0], [0, 0, 0]])


@pytest.mark.parametrize("mode", ["CONSTANT", "REFLECT", "SYMMETRIC"])
def test_pad_matches_numpy_and_its_gradient_finite_differences(mode):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 4, 2))
    paddings = [[1, 2], [3, 0], [0, 1]]
    kw = {"constant_values": 1.5} if mode == "CONSTANT" else {}
    got = gd.pad(x, paddings, mode.lower(), **kw)
    np.testing.assert_array_equal(got, np.pad(x, paddings, mode.lower(), **kw))
    fd_check(lambda x: gd.pad(x, paddings, mode, **kw), (x,))


def test_reduce_min_argmax_and_clip_by_value():
    x = np.array([[3.0, 1.0, 1.0], [2.0, 5.0, -1.0]])
    np.testing.assert_array_equal(gd.reduce_min(x, axis=1), [1.0, -1.0])
    g = gd.value_and_grad(lambda x: gd.reduce_sum(gd.reduce_min(x, axis=1)))(x)[1]
    np.testing.assert_array_equal(g, [[0, 0.5, 0.5], [0, 0, 1]])    # ties share, as max
    assert gd.argmax(x).dtype == np.int64 and list(gd.argmax(x)) == [0, 1]
    assert list(gd.argmax(np.array([[1, 3, 3]]), output_type="int32")) == [1]   # first on ties
    assert gd.argmax(x, axis=0, output_type=np.int32).dtype == np.int32
    # clip: the gradient passes inside [lo, hi] (edges included), the rest to the bound
    t = np.array([-2.0, 0.0, 0.5, 1.0, 3.0])
    np.testing.assert_array_equal(gd.clip_by_value(t, 0.0, 1.0), [0, 0, 0.5, 1, 1])
    grads = gd.value_and_grad(lambda t, lo, hi: gd.reduce_sum(gd.clip_by_value(t, lo, hi)),
                              argnums=(0, 1, 2))(t, F64(0.0), F64(1.0))[1]
    np.testing.assert_array_equal(grads[0], [0, 1, 1, 1, 0])
    assert grads[1] == 1.0 and grads[2] == 1.0
    assert gd.clip_by_value(np.arange(4, dtype=np.int32), 1, 2).dtype == np.int32


def test_eager_and_compiled_agree():
    rng = np.random.default_rng(6)
    x, f = rng.standard_normal((2, 7, 9, 2)), rng.standard_normal((3, 2, 2, 3))

    def net(x, f):
        h = gd.relu(gd.nn.conv2d(x, f, (2, 1), "SAME", 1))
        h = gd.nn.max_pool2d(h, 2, 2, "SAME") + gd.nn.avg_pool2d(h, (3, 2), 1, "SAME")[:, ::2,
                                                                                      ::2]
        h = gd.pad(gd.clip_by_value(h, -0.5, 2.0), [[0, 0], [1, 1], [0, 2], [0, 0]], "REFLECT")
        return h, gd.reduce_min(h, axis=(1, 2)), gd.argmax(gd.reshape(h, (2, -1)))
    eager, compiled = net(x, f), gd.function(net)(x, f)
    for a, b in zip(eager, compiled):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    # and the gradient of the whole thing, eagerly (value_and_grad traces) and compiled
    def loss(x, f):
        return gd.reduce_sum(net(x, f)[0] ** 2)
    g1 = gd.value_and_grad(loss, argnums=(0, 1))(x, f)[1]
    g2 = gd.function(lambda x, f: gd.value_and_grad(loss, argnums=(0, 1))(x, f)[1])(x, f)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- replicas (batching rules)


def _cnn_step(strategy, dtype):
    rng = np.random.default_rng(7)
    with strategy.scope():
        w = gd.Variable(rng.standard_normal((3, 3, 2, 4)).astype(dtype) * 0.3, name="w")
        v = gd.Variable(rng.standard_normal((120, 3)).astype(dtype) * 0.3, name="v")
        opt = gd.optimizers.SGD(learning_rate=0.1)

    @gd.function
    def step(x, y):
        def replica_fn(x, y):
            with gd.GradientTape() as tape:
                h = gd.relu(gd.nn.conv2d(x, w, 1, "SAME"))                  # (b, 7, 9, 4)
                h = gd.nn.max_pool2d(h, 2, 2, "SAME") + gd.nn.avg_pool2d(h, 3, 2, "SAME")
                h = gd.pad(h, [[0, 0], [1, 0], [0, 1], [0, 0]], "REFLECT")   # (b, 5, 6, 4)
                logits = gd.clip_by_value(gd.reshape(h, (-1, 120)) @ v, -2.0, 2.0)
                loss = gd.reduce_mean(gd.nn.sparse_softmax_cross_entropy(y, logits)
                                      - 0.1 * gd.reduce_min(h, axis=(1, 2, 3)))
            opt.apply_gradients(zip(tape.gradient(loss, [w, v]), [w, v]))   # mean over replicas
            right = gd.reduce_sum(gd.cast(gd.equal(gd.argmax(logits), y), dtype))
            return loss, right
        loss, right = strategy.run(replica_fn, args=(x, y))
        return (strategy.reduce(gd.ReduceOp.MEAN, loss, axis=None),
                strategy.reduce(gd.ReduceOp.SUM, right, axis=None))
    return w, v, step


@pytest.mark.parametrize("mode", ["auto", "merged"])
def test_two_replicas_match_one_device(mode):
    rng = np.random.default_rng(8)
    x, y = rng.standard_normal((8, 7, 9, 2)), rng.integers(0, 3, 8)
    w1, v1, step1 = _cnn_step(gd.OneDeviceStrategy("cpu:0"), F64)
    loss1 = step1(x, y)
    strategy = gd.MirroredStrategy(["cpu:0", "cpu:1"])
    gd.config.set_device_concurrency(mode)
    try:
        w2, v2, step2 = _cnn_step(strategy, F64)
        shards = gd.PerReplica((x[:4], x[4:])), gd.PerReplica((y[:4], y[4:]))
        loss2 = step2(*shards)
        rg = step2.replicated_graph
    finally:
        gd.config.set_device_concurrency("auto")
    np.testing.assert_allclose(loss2, loss1, rtol=1e-12)     # (loss, examples right)
    for a, b in ((w2, w1), (v2, v1)):
        for component in a.values:
            np.testing.assert_allclose(component, b.numpy(), rtol=1e-11, atol=1e-13)
    # (with relu folded into it by passes/epilogue.py: conv2d_bias_act)
    convs = [e for e in rg.eqns if e.op.name in ("conv2d", "conv2d_bias_act")]
    if mode == "merged":        # one conv over both replicas' examples: the batching rule
        assert rg.merged and [e.inputs[0].ty.shape[0] for e in convs] == [8]
        # (the 2x2 max pool keeps its argmax, passes/epilogue.py)
        assert {e.op.name for e in rg.eqns} >= {"max_pool2d_grad_argmax", "avg_pool2d_grad",
                                                "conv2d_backprop_filter"}
    else:
        assert sorted(e.device for e in convs) == ["cpu:0", "cpu:1"]


# ---------------------------------------------------------------- the max-pool kernel


@pytest.mark.parametrize("padding,ksize,strides", [("SAME", (2, 2), (2, 2)),
                                                   ("VALID", (3, 3), (2, 1)),
                                                   ("SAME", (2, 3), (1, 1))])
def test_max_pool_grad_kernel_matches_reference(padding, ksize, strides):
    from graphdist.kernels.pool import max_pool_grad_cpu
    from graphdist.kernels.pool import max_pool_grad_ref as kernel_ref

    from graphdist.ops.window import window_geometry

    rng = np.random.default_rng(9)
    x = rng.integers(0, 3, (2, 7, 9, 3)).astype(np.float32)         # many ties
    p = {"ksize": ksize, "strides": strides, "padding": padding}
    y = gd.nn.max_pool2d(x, **p)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    _, pads = window_geometry("", x.shape[1:3], ksize, strides, (1, 1), padding, "")
    top_left = (pads[0][0], pads[1][0])
    want = max_pool_grad_ref(x, dy, ksize, strides, padding)       # this file's loops
    np.testing.assert_allclose(kernel_ref(x, y, dy, ksize, strides, top_left), want, rtol=1e-6, atol=1e-6)
    dx = np.full_like(x, np.nan)
    max_pool_grad_cpu(x, y, dy, dx, ksize, strides, top_left)
    np.testing.assert_allclose(dx, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(bind(OPS["max_pool2d_grad"], x, y, dy, **p), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("channels", [3, 5])             # columns taps first, rows first
@pytest.mark.parametrize("dtype", [np.float32, F64])
@pytest.mark.parametrize("padding,strides,dilations", COMBOS)
def test_conv_input_grad_kernel_matches_loops_and_the_numpy_bits(
        padding, strides, dilations, dtype, channels, monkeypatch):
    """The CPU kernel (one GEMM, then col2im: Numba's from 4 channels on) against this file's
    loops, in pieces of one image, and bit for bit against the op's numpy form, which the
    warm-up runs first."""
    from graphdist.kernels.conv import col2im_ref

    from graphdist.ops import conv
    from graphdist.runtime.adapters.nn import conv2d_backprop_input_cpu

    rng = np.random.default_rng(11)
    f = rng.standard_normal((3, 2, channels, 4)).astype(dtype)
    s, d = _pair(strides), _pair(dilations)
    dy = rng.standard_normal((3, *out_hw((7, 9), (3, 2), s, d, padding), 4)).astype(dtype)
    p = {"input_size": (7, 9), "strides": s, "padding": padding, "dilations": d}
    want = conv_input_ref(dy, f, (7, 9), s, padding, d)
    monkeypatch.setattr(conv, "PATCH_BYTES", 1)            # one image a piece
    dx, numpy_form = np.full_like(want, np.nan), np.full_like(want, np.nan)
    conv2d_backprop_input_cpu(dx, dy, f, **p)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(dx, want, rtol=tol, atol=tol)
    OPS["conv2d_backprop_input"].out_impl(np, numpy_form, dy, f, **p)
    np.testing.assert_array_equal(dx, numpy_form)
    top_left = (geometry(7, 3, s[0], d[0], padding)[1], geometry(9, 2, s[1], d[1], padding)[1])
    cols = np.einsum("nabo,ijco->nabijc", dy, f)
    np.testing.assert_allclose(col2im_ref(cols, (7, 9), s, d, top_left), want, rtol=tol,
                               atol=tol)


@pytest.mark.parametrize("ksize,kernel_op", [(3, "max_pool2d_grad"),
                                              (2, "max_pool2d_grad_argmax")])
def test_the_compiled_step_uses_the_kernel(ksize, kernel_op, monkeypatch):
    """Overlapping windows: max_pool2d_grad's kernel; windows that do not overlap: the
    gradient routed by the forward pass's argmax (passes/epilogue.py)."""
    from graphdist.runtime import kernel_table

    key, calls = ("cpu", kernel_op), []
    kernel = kernel_table.ENTRIES[key].out
    monkeypatch.setitem(kernel_table.ENTRIES, key, kernel_table.ENTRIES[key].replace(
        out=lambda *a, **kw: calls.append(kernel(*a, **kw))))
    x = np.random.default_rng(10).standard_normal((8, 16, 16, 8)).astype(np.float32)
    f = gd.function(lambda x: gd.value_and_grad(   # the gradient is no result: an arena buffer
        lambda x: gd.reduce_sum(gd.nn.max_pool2d(x, ksize, 2, "VALID") ** 2))(x)[1] * 3.0)
    got = f(x)
    assert len(calls) == 1
    y = gd.nn.max_pool2d(x, ksize, 2, "VALID")
    np.testing.assert_allclose(got, max_pool_grad_ref(x, 6 * y, (ksize, ksize), (2, 2),
                                                      "VALID"), rtol=1e-6)


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("call,kind,words", [
    (lambda: gd.nn.conv2d(np.ones((7, 9, 2)), np.ones((3, 3, 2, 3))), gd.ShapeError,
     ["conv2d", "rank 4", "f64[7,9,2]"]),
    (lambda: gd.nn.conv2d(np.ones((1, 7, 9, 2)), np.ones((3, 3, 4, 3))), gd.ShapeError,
     ["conv2d", "2 channels", "f64[1,7,9,2]", "f64[3,3,4,3]"]),
    (lambda: gd.nn.conv2d(np.ones((1, 7, 9, 2)), np.ones((3, 3, 2))), gd.ShapeError,
     ["conv2d", "HWIO", "f64[3,3,2]"]),
    (lambda: gd.nn.conv2d(np.ones((1, 7, 9, 2)), np.ones((3, 3, 2, 3)), padding="FULL"),
     ValueError, ["conv2d", "padding", "FULL", "f64[1,7,9,2]", "f64[3,3,2,3]"]),
    (lambda: gd.nn.conv2d(np.ones((1, 7, 9, 2)), np.ones((3, 3, 2, 3)), strides=0), ValueError,
     ["conv2d", "strides", "positive", "(0, 0)", "f64[1,7,9,2]"]),
    (lambda: gd.nn.conv2d(np.ones((1, 7, 9, 2)), np.ones((3, 3, 2, 3)), strides=[2, 1, 1, 1]),
     ValueError, ["conv2d", "strides", "[2, 1, 1, 1]", "f64[1,7,9,2]"]),
    (lambda: gd.nn.conv2d(np.ones((1, 7, 9, 2)), np.ones((3, 3, 2, 3)), dilations=(1, -1)),
     ValueError, ["conv2d", "dilations", "(1, -1)"]),
    (lambda: gd.nn.conv2d(np.ones((1, 2, 9, 2)), np.ones((3, 3, 2, 3)), padding="VALID"),
     gd.ShapeError, ["conv2d", "window", "f64[1,2,9,2]", "f64[3,3,2,3]"]),
    (lambda: gd.nn.conv2d(np.ones((1, 7, 9, 2), np.float32), np.ones((3, 3, 2, 3))),
     TypeError, ["conv2d", "f32[1,7,9,2]", "f64[3,3,2,3]"]),
    (lambda: gd.nn.conv2d(np.ones((1, 7, 9, 2), np.int32), np.ones((3, 3, 2, 3), np.int32)),
     TypeError, ["conv2d", "float"]),
    (lambda: gd.nn.max_pool2d(np.ones((7, 9, 2)), 2, 2, "SAME"), gd.ShapeError,
     ["max_pool2d", "rank 4", "f64[7,9,2]"]),
    (lambda: gd.nn.avg_pool2d(np.ones((1, 7, 9, 2)), 2, 0, "SAME"), ValueError,
     ["avg_pool2d", "strides", "positive", "f64[1,7,9,2]"]),
    (lambda: gd.nn.max_pool2d(np.ones((1, 7, 9, 2)), 2, 2, "same!"), ValueError,
     ["max_pool2d", "padding", "f64[1,7,9,2]"]),
    (lambda: gd.pad(np.ones((2, 3)), [[1, 1]]), gd.ShapeError, ["pad", "f64[2,3]", "[[1, 1]]"]),
    (lambda: gd.pad(np.ones((2, 3)), [[0, 0], [3, 0]], "REFLECT"), gd.ShapeError,
     ["pad", "REFLECT", "axis 1", "f64[2,3]"]),
    (lambda: gd.pad(np.ones((2, 3)), [[0, 0], [0, 1]], "WRAP"), ValueError, ["pad", "WRAP"]),
    (lambda: gd.argmax(np.ones((2, 3)), axis=2), gd.ShapeError, ["argmax", "axis 2"]),
    (lambda: gd.argmax(np.ones((2, 3)), output_type="float32"), TypeError, ["argmax", "int"]),
    (lambda: gd.reduce_min(np.ones((2, 0)), axis=1), gd.ShapeError, ["reduce_min", "empty"]),
    (lambda: gd.clip_by_value(np.ones(3), np.zeros(4), 1.0), gd.ShapeError,
     ["clip_by_value", "f64[3]", "f64[4]"]),
])
def test_bad_input_raises_naming_the_op_and_shapes(call, kind, words):
    with pytest.raises(kind) as info:
        call()
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_errors_in_traced_code_name_the_user_line():
    def bad(x, f):
        return gd.nn.conv2d(x, f)
    with pytest.raises(gd.ShapeError) as info:
        gd.function(bad)(np.ones((1, 7, 9, 2)), np.ones((3, 3, 4, 3)))
    assert "conv2d" in str(info.value) and "test_conv.py:" in str(info.value)


# ---------------------------------------------------------------- examples for test_ops.py


def _example(args, params, fn, ref, **more):
    """One sweep example, as test_ops.Case's keyword arguments."""
    return {"args": args, "params": params, "fn": fn, "ref": ref, **more}


_CONV = ({"strides": (2, 1), "padding": "SAME", "dilations": (1, 1)},
         {"strides": (1, 1), "padding": "VALID", "dilations": (2, 1)})
_POOLS = ({"ksize": (3, 2), "strides": (2, 1), "padding": "SAME"},
          {"ksize": (2, 2), "strides": (2, 2), "padding": "VALID"})


def _dy(rng, p, channels, k=(3, 2), dilations=(1, 1)):
    return rng.standard_normal((2, *out_hw((5, 6), k, p["strides"], dilations, p["padding"]),
                                channels))


def _conv_examples(rng):
    return [_example((rng.standard_normal((2, 5, 6, 2)), rng.standard_normal((3, 2, 2, 3))), p,
                     lambda x, f, p=p: gd.nn.conv2d(x, f, **p),
                     lambda x, f, p=p: conv_ref(x, f, **p)) for p in _CONV]


def _conv_input_examples(rng):
    return [_example((_dy(rng, p, 3, dilations=p["dilations"]),
                      rng.standard_normal((3, 2, 2, 3))), {**p, "input_size": (5, 6)},
                     lambda dy, f, p=p: bind(OPS["conv2d_backprop_input"], dy, f,
                                             input_size=(5, 6), **p),
                     lambda dy, f, p=p: conv_input_ref(dy, f, (5, 6), **p)) for p in _CONV]


def _conv_filter_examples(rng):
    return [_example((rng.standard_normal((2, 5, 6, 2)), _dy(rng, p, 3,
                                                             dilations=p["dilations"])),
                     {**p, "filter_size": (3, 2)},
                     lambda x, dy, p=p: bind(OPS["conv2d_backprop_filter"], x, dy,
                                             filter_size=(3, 2), **p),
                     lambda x, dy, p=p: conv_filter_ref(x, dy, (3, 2), **p)) for p in _CONV]


def _distinct(rng, *shape):
    return rng.permutation(np.prod(shape)).reshape(shape) * 0.1 - 1.0    # no ties


def _pool_examples(kind):
    fn = gd.nn.max_pool2d if kind == "max" else gd.nn.avg_pool2d
    return lambda rng: [_example((_distinct(rng, 2, 5, 6, 2),), p,
                                 lambda x, p=p: fn(x, **p),
                                 lambda x, p=p: pool_ref(x, kind=kind, **p)) for p in _POOLS]


def first_max_gather(x, g, ksize, strides, padding):
    """g (shaped like x) read at each window's first max: TF's MaxPoolGradGrad."""
    out = np.zeros((x.shape[0], *out_hw(x.shape[1:3], ksize, strides, (1, 1), padding),
                    x.shape[3]))
    for a, b, taps in windows(x.shape[1:3], ksize, strides, (1, 1), padding):
        for n, c in np.ndindex(x.shape[0], x.shape[3]):
            _, _, r, q = taps[int(np.argmax([x[n, r, q, c] for _, _, r, q in taps]))]
            out[n, a, b, c] = g[n, r, q, c]
    return out


def _max_pool_grad_examples(name):
    def make(rng):
        out = []
        for p in _POOLS:
            x = _distinct(rng, 2, 5, 6, 2)
            y = pool_ref(x, kind="max", **p)
            d = rng.standard_normal(x.shape if name.endswith("grad_grad") else y.shape)
            ref = ((lambda x, y, g, p=p: first_max_gather(x, g, **p))
                   if name.endswith("grad_grad") else
                   (lambda x, y, dy, p=p: max_pool_grad_ref(x, dy, **p)))
            out.append(_example((x, y, d), p, lambda *a, p=p: bind(OPS[name], *a, **p), ref,
                                diff=(2,)))      # linear in its last input only
        return out
    return make


def avg_pool_grad_ref(dy, input_hw, ksize, strides, padding):
    dx = np.zeros((dy.shape[0], *input_hw, dy.shape[3]))
    for a, b, taps in windows(input_hw, ksize, strides, (1, 1), padding):
        for _, _, r, q in taps:
            dx[:, r, q, :] += dy[:, a, b, :] / len(taps)
    return dx


def _avg_pool_grad_examples(rng):
    return [_example((_dy(rng, p, 2, k=p["ksize"]),), {**p, "input_size": (5, 6)},
                     lambda dy, p=p: bind(OPS["avg_pool2d_grad"], dy, input_size=(5, 6), **p),
                     lambda dy, p=p: avg_pool_grad_ref(dy, (5, 6), **p)) for p in _POOLS]


_PADS = ((1, 2), (0, 3))
_PAD_MODES = (("CONSTANT", 0.5), ("REFLECT", 0), ("SYMMETRIC", 0))


def _pad_examples(rng):
    return [_example((rng.standard_normal((3, 4)),),
                     {"paddings": _PADS, "mode": mode, "constant_values": c},
                     lambda x, m=mode, c=c: gd.pad(x, _PADS, m, c),
                     lambda x, m=mode, c=c: np.pad(x, _PADS, m.lower(), **(
                         {"constant_values": c} if m == "CONSTANT" else {})))
            for mode, c in _PAD_MODES]


def pad_adjoint_ref(ct, shape, mode):
    """d/dx <ct, pad(x)>, one basis vector x at a time."""
    x, grad = np.zeros(shape), np.zeros(shape)
    for i in np.ndindex(shape):
        x[i] = 1.0
        grad[i] = np.vdot(ct, np.pad(x, _PADS, mode.lower()))
        x[i] = 0.0
    return grad


def _pad_grad_examples(rng):
    return [_example((rng.standard_normal((6, 7)),), {"paddings": _PADS, "mode": mode},
                     lambda ct, m=mode: bind(OPS["pad_grad"], ct, paddings=_PADS, mode=m),
                     lambda ct, m=mode: pad_adjoint_ref(ct, (3, 4), m)) for mode, _ in _PAD_MODES]


def _argmax_examples(rng):
    x = rng.standard_normal((3, 4, 5))
    ties = np.array([[1.0, 3.0, 3.0], [2.0, 2.0, 0.0]])
    i64, i32 = np.dtype("int64"), np.dtype("int32")
    return [_example((x,), {"axis": -1, "output_type": i64}, gd.argmax,
                     lambda x: np.argmax(x, -1)),
            _example((x,), {"axis": 1, "output_type": i32}, lambda x: gd.argmax(x, 1, "int32"),
                     lambda x: np.argmax(x, 1).astype(np.int32)),
            _example((ties,), {"axis": 0, "output_type": i64}, lambda x: gd.argmax(x, 0),
                     lambda x: np.argmax(x, 0))]


def _clip_examples(rng):
    x = rng.uniform(-2, 2, (4, 5))
    x[np.abs(np.abs(x) - 1) < 0.05] = 0.0              # away from the kinks
    lo, hi = np.full((5,), -1.0), np.full((4, 1), 1.0)
    return [_example((x, lo, hi), {}, gd.clip_by_value,
                     lambda x, lo, hi: np.minimum(np.maximum(x, lo), hi)),
            _example((x,), {}, lambda x: gd.clip_by_value(x, -1.0, 1.0),
                     lambda x: np.clip(x, -1, 1), op_args=(x, F64(-1.0), F64(1.0)))]


# op name -> rng -> examples (test_ops.Case keyword arguments)
SWEEP = {
    "conv2d": _conv_examples,
    "conv2d_backprop_input": _conv_input_examples,
    "conv2d_backprop_filter": _conv_filter_examples,
    "max_pool2d": _pool_examples("max"),
    "avg_pool2d": _pool_examples("avg"),
    "max_pool2d_grad": _max_pool_grad_examples("max_pool2d_grad"),
    "max_pool2d_grad_grad": _max_pool_grad_examples("max_pool2d_grad_grad"),
    "avg_pool2d_grad": _avg_pool_grad_examples,
    "pad": _pad_examples,
    "pad_grad": _pad_grad_examples,
    "argmax": _argmax_examples,
    "clip_by_value": _clip_examples,
}


def test_the_forward_pass_in_pieces_equals_one_piece(monkeypatch):
    """conv2d makes its patches a few images at a time (ops/conv.py PATCH_BYTES): cut into
    pieces of one image it gives the bits of the one-piece product, row by row."""
    from graphdist.ops import conv

    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 7, 9, 3)).astype(np.float32)
    f = rng.standard_normal((3, 2, 3, 4)).astype(np.float32)
    whole = gd.nn.conv2d(x, f, strides=(2, 1), padding="SAME", dilations=1)
    monkeypatch.setattr(conv, "PATCH_BYTES", 1)            # one image a piece
    pieces = gd.nn.conv2d(x, f, strides=(2, 1), padding="SAME", dilations=1)
    np.testing.assert_allclose(pieces, whole, rtol=1e-6, atol=1e-6)
    assert len(conv._image_chunks(5, 10)) == 5


@pytest.mark.parametrize("channels", [1, 5])             # patches taps first, rows first
@pytest.mark.parametrize("dtype", [np.float32, F64])
@pytest.mark.parametrize("padding,strides,dilations", COMBOS)
def test_the_filter_gradient_in_pieces_sums_them_in_order(
        padding, strides, dilations, dtype, channels, monkeypatch):
    """conv2d_backprop_filter makes its patches PATCH_BYTES at a time and adds each piece's
    product into dw in order: cut into pieces of one image it matches the loops, and gives
    the bits of the one-image products added up image after image (a fixed sum order)."""
    from graphdist.ops import conv

    rng = np.random.default_rng(12)
    s, d = _pair(strides), _pair(dilations)
    x = rng.standard_normal((4, 7, 9, channels)).astype(dtype)
    dy = rng.standard_normal((4, *out_hw((7, 9), (3, 2), s, d, padding), 3)).astype(dtype)
    p = {"filter_size": (3, 2), "strides": s, "padding": padding, "dilations": d}
    monkeypatch.setattr(conv, "PATCH_BYTES", 1)            # one image a piece
    dw = bind(OPS["conv2d_backprop_filter"], x, dy, **p)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(dw, conv_filter_ref(x, dy, (3, 2), s, padding, d), rtol=tol,
                               atol=tol)
    in_order = bind(OPS["conv2d_backprop_filter"], x[:1], dy[:1], **p)
    for b in range(1, 4):
        in_order = in_order + bind(OPS["conv2d_backprop_filter"], x[b:b + 1], dy[b:b + 1], **p)
    np.testing.assert_array_equal(dw, in_order)
