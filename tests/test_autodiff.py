"""Tests for gd.GradientTape and gd.value_and_grad: gradients against finite differences and
closed forms, TF tape semantics (watching, non-scalar targets, assigns), eager use."""

from __future__ import annotations

import numpy as np
import pytest

import graphdist as gd

# ---------------------------------------------------------------- an MLP in float64


def _mlp_params(seed=0):
    rng = np.random.default_rng(seed)
    return {"w1": rng.normal(size=(3, 4)), "b1": rng.normal(size=4) * 0.1,
            "w2": rng.normal(size=(4, 2)), "b2": rng.normal(size=2) * 0.1}


def _mlp_loss_np(p, x, y):
    h = np.tanh(x @ p["w1"] + p["b1"])
    o = 1 / (1 + np.exp(-(h @ p["w2"] + p["b2"])))
    return np.mean((o - y) ** 2) + 0.1 * np.sum(p["w1"] * p["w1"])


def _fd_grad(f, p, name, eps=1e-6):
    g = np.zeros_like(p[name])
    for idx in np.ndindex(*p[name].shape):
        hi = {k: v.copy() for k, v in p.items()}
        lo = {k: v.copy() for k, v in p.items()}
        hi[name][idx] += eps
        lo[name][idx] -= eps
        g[idx] = (f(hi) - f(lo)) / (2 * eps)
    return g


def test_mlp_gradients_match_finite_differences():
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(5, 3)), rng.uniform(size=(5, 2))
    p = _mlp_params()
    vs = {k: gd.Variable(v, name=k) for k, v in p.items()}

    @gd.function
    def grads(x, y):
        with gd.GradientTape() as tape:
            h = gd.tanh(x @ vs["w1"] + vs["b1"])
            o = gd.sigmoid(h @ vs["w2"] + vs["b2"])
            loss = gd.reduce_mean(gd.square(o - y)) + 0.1 * gd.reduce_sum(vs["w1"] * vs["w1"])
        return loss, tape.gradient(loss, [vs[k] for k in p])

    loss, gs = grads(x, y)
    assert isinstance(gs, list) and len(gs) == 4
    np.testing.assert_allclose(loss, _mlp_loss_np(p, x, y), rtol=1e-12)
    for k, g in zip(p, gs):
        assert g.dtype == np.float64 and g.shape == p[k].shape
        fd = _fd_grad(lambda q: _mlp_loss_np(q, x, y), p, k)
        np.testing.assert_allclose(g, fd, rtol=1e-6, atol=1e-9, err_msg=k)
    for k in p:   # taking gradients changes no variable
        np.testing.assert_array_equal(vs[k].numpy(), p[k])


def test_watch_tensor_argument_and_single_source():
    @gd.function
    def f(x, y):
        with gd.GradientTape(persistent=True) as tape:
            tape.watch(x)
            z = gd.reduce_sum(gd.exp(x) * y)
        return tape.gradient(z, x), tape.gradient(z, [y])

    x = np.array([0.0, 1.0, -2.0])
    y = np.array([1.0, 2.0, 3.0])
    gx, gy = f(x, y)
    np.testing.assert_allclose(gx, np.exp(x) * y, rtol=1e-12)    # a single array, not a list
    assert gy == [None], "an unwatched argument gets None"


def test_a_non_persistent_tape_gives_gradients_once():
    @gd.function
    def f(x):
        with gd.GradientTape() as tape:
            tape.watch(x)
            z = gd.reduce_sum(x * x)
        tape.gradient(z, x)
        return tape.gradient(z, x)

    with pytest.raises(RuntimeError, match="persistent=True"):
        f(np.ones(2, np.float32))


def test_value_and_grad_takes_python_floats_and_refuses_integers():
    value, grad = gd.value_and_grad(lambda a: a * a)(3.0)
    assert (value, grad) == (9.0, 6.0)                 # d(a^2)/da = 2a
    for bad in (3, np.array([1, 2])):
        with pytest.raises(TypeError, match="argument 0 is int"):
            gd.value_and_grad(lambda a: gd.reduce_sum(a * a))(bad)


def test_non_scalar_target_is_summed():
    w = gd.Variable(np.array([1.0, 2.0, 3.0]))

    @gd.function
    def f(x):
        with gd.GradientTape() as tape:
            tape.watch(x)
            out = gd.matmul(x, gd.reshape(w, (3, 1))) * w     # (2, 3)
        return tape.gradient(out, [w, x])

    x = np.array([[1.0, 0.0, 2.0], [0.5, 1.0, -1.0]])
    gw, gx = f(x)
    wn = np.array([1.0, 2.0, 3.0])
    # out[i, j] = (x[i] . w) * w[j]; d sum / dw = sum_i [x[i] * sum_j w_j + (x[i] . w)]
    np.testing.assert_allclose(gw, (x * wn.sum()).sum(0) + (x @ wn).sum(), rtol=1e-12)
    np.testing.assert_allclose(gx, np.tile(wn * wn.sum(), (2, 1)), rtol=1e-12)


def test_list_of_targets_is_summed():
    w = gd.Variable(np.array(2.0))

    @gd.function
    def f():
        with gd.GradientTape() as tape:
            a = w * w
            b = w * 3.0
        return tape.gradient([a, b], w)

    np.testing.assert_allclose(f(), 2 * 2.0 + 3.0)


def test_unrelated_source_gets_none():
    w = gd.Variable(np.ones(2), name="used")
    u = gd.Variable(np.ones(2), name="unused")
    r = gd.Variable(np.ones(2), name="read_but_unrelated")

    @gd.function
    def f(x):
        with gd.GradientTape() as tape:
            tape.watch(x)
            side = r * 2.0
            loss = gd.reduce_sum(w * 3.0)
        return tape.gradient(loss, [w, u, r, x]), side

    (gw, gu, gr, gx), _ = f(np.ones(2))
    np.testing.assert_allclose(gw, [3.0, 3.0])
    assert gu is None and gr is None and gx is None


def test_non_trainable_variable_needs_watch():
    c = gd.Variable(np.array([1.0, 2.0]), trainable=False)

    @gd.function
    def f(watch):
        with gd.GradientTape() as tape:
            if watch:
                tape.watch(c)
            loss = gd.reduce_sum(c * c)
        return tape.gradient(loss, c)

    assert f(False) is None
    np.testing.assert_allclose(f(True), [2.0, 4.0])


def test_watch_accessed_variables_false():
    w = gd.Variable(np.array([1.0, 2.0]))
    v = gd.Variable(np.array([3.0, 4.0]))

    @gd.function
    def f():
        with gd.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(v)
            loss = gd.reduce_sum(w * v)
        return tape.gradient(loss, [w, v])

    gw, gv = f()
    assert gw is None
    np.testing.assert_allclose(gv, [1.0, 2.0])


def test_variable_used_twice_accumulates():
    w = gd.Variable(np.array([1.0, -2.0, 0.5]))

    @gd.function
    def f(x):
        with gd.GradientTape() as tape:
            loss = (gd.reduce_sum(w * x) + gd.reduce_sum(gd.square(w))
                    + gd.reduce_sum(w.read_value()))
        return tape.gradient(loss, w)

    x = np.array([3.0, 4.0, 5.0])
    np.testing.assert_allclose(f(x), x + 2 * np.array([1.0, -2.0, 0.5]) + 1.0, rtol=1e-12)


def test_two_reads_of_different_versions_accumulate():
    w = gd.Variable(np.array([1.0, 2.0]))

    @gd.function
    def f():
        with gd.GradientTape() as tape:
            r1 = w.read_value()
            w.assign_add(np.array([1.0, 1.0]))
            r2 = w.read_value()
            loss = gd.reduce_sum(r1 * r2)
        return tape.gradient(loss, w)

    # TF: both reads are reads of w; d/dr1 = r2, d/dr2 = r1 -> r1 + r2
    np.testing.assert_allclose(f(), np.array([1.0, 2.0]) + np.array([2.0, 3.0]))


def test_assign_breaks_the_gradient_path():
    w = gd.Variable(np.array([1.0, 2.0]))

    @gd.function
    def f(x):
        with gd.GradientTape() as tape:
            tape.watch(x)
            w.assign(w * x)                 # no gradient flows through the assign
            loss = gd.reduce_sum(w * 3.0)  # a read of the new value
        return tape.gradient(loss, [w, x])

    gw, gx = f(np.array([5.0, 7.0]))
    np.testing.assert_allclose(gw, [3.0, 3.0])
    assert gx is None
    np.testing.assert_allclose(w.numpy(), [5.0, 14.0])


def test_ops_before_the_tape_are_not_recorded():
    w = gd.Variable(np.array(3.0))

    @gd.function
    def f():
        y = w * w
        with gd.GradientTape() as tape:
            loss = y * 2.0 + w
        return tape.gradient(loss, w)

    np.testing.assert_allclose(f(), 1.0)


def test_second_order_with_nested_tapes():
    @gd.function
    def f(x):
        with gd.GradientTape() as outer:
            outer.watch(x)
            with gd.GradientTape() as inner:
                inner.watch(x)
                y = x * x * x
            dy = inner.gradient(y, x)
        return dy, outer.gradient(dy, x)

    dy, d2y = f(np.array([2.0, -1.0]))
    np.testing.assert_allclose(dy, 3 * np.array([4.0, 1.0]))
    np.testing.assert_allclose(d2y, 6 * np.array([2.0, -1.0]))


def test_stop_gradient_and_integer_variable():
    w = gd.Variable(np.array([1.0, 2.0]))
    k = gd.Variable(np.array([3, 4], np.int32))

    @gd.function
    def f():
        with gd.GradientTape() as tape:
            loss = gd.reduce_sum(gd.stop_gradient(w) * w * gd.cast(k, "float64"))
        return tape.gradient(loss, [w, k])

    gw, gk = f()
    np.testing.assert_allclose(gw, np.array([1.0, 2.0]) * [3.0, 4.0])
    assert gk is None


def test_indexing_concat_and_max_gradients():
    v = gd.Variable(np.arange(6.0).reshape(2, 3))

    @gd.function
    def f():
        with gd.GradientTape() as tape:
            y = (gd.reduce_sum(v[0] * v[1, :]) + gd.reduce_max(v)
                 + gd.reduce_sum(gd.concat([v, v], axis=0) ** 2))
        return tape.gradient(y, v)

    a = np.arange(6.0).reshape(2, 3)
    expected = 4 * a + np.stack([a[1], a[0]])
    expected[1, 2] += 1.0
    np.testing.assert_allclose(f(), expected)


def test_gradient_in_float32_has_float32_dtype():
    w = gd.Variable(np.array([1.0, 2.0], np.float32))

    @gd.function
    def f():
        with gd.GradientTape() as tape:
            loss = gd.reduce_mean(w * w)
        return tape.gradient(loss, w)

    g = f()
    assert g.dtype == np.float32
    np.testing.assert_allclose(g, [1.0, 2.0])


def test_tape_outside_trace_raises_helpful_trace_error():
    with pytest.raises(gd.TraceError, match="gd.function") as info, gd.GradientTape():
        pass
    assert "value_and_grad" in str(info.value)


def test_tape_gradient_in_another_trace_raises():
    leaked = []

    @gd.function
    def record(x):
        with gd.GradientTape() as tape:
            tape.watch(x)
            y = x * x
        leaked.append((tape, y, x))
        return y

    record(np.ones(2))

    @gd.function
    def use(x):
        tape, y, src = leaked[0]
        return tape.gradient(y, src)

    with pytest.raises(gd.TraceError):
        use(np.ones(2))


# ---------------------------------------------------------------- value_and_grad


def test_value_and_grad_eager_argnums_int():
    vg = gd.value_and_grad(lambda x, y: gd.reduce_sum(gd.tanh(x) * y))
    x = np.array([0.5, -1.0, 2.0])
    y = np.array([1.0, 2.0, 3.0])
    value, g = vg(x, y)
    np.testing.assert_allclose(value, np.sum(np.tanh(x) * y), rtol=1e-12)
    np.testing.assert_allclose(g, (1 - np.tanh(x) ** 2) * y, rtol=1e-12)
    assert isinstance(g, np.ndarray)
    # a second call with new values reuses the compiled trace and gives new results
    value2, g2 = vg(2 * x, y)
    np.testing.assert_allclose(value2, np.sum(np.tanh(2 * x) * y), rtol=1e-12)
    np.testing.assert_allclose(g2, (1 - np.tanh(2 * x) ** 2) * y, rtol=1e-12)


def test_value_and_grad_eager_argnums_tuple():
    vg = gd.value_and_grad(lambda a, b, c: gd.reduce_sum(a * a * b + c), argnums=(0, 1))
    a, b, c = np.array([1.0, 2.0]), np.array([3.0, 4.0]), np.array([5.0, 6.0])
    value, grads = vg(a, b, c)
    np.testing.assert_allclose(value, np.sum(a * a * b + c))
    assert isinstance(grads, tuple) and len(grads) == 2
    np.testing.assert_allclose(grads[0], 2 * a * b)
    np.testing.assert_allclose(grads[1], a * a)
    rev_vg = gd.value_and_grad(lambda a, b, c: gd.reduce_sum(a * a * b + c), argnums=(2, 0))
    _, rev = rev_vg(a, b, c)
    np.testing.assert_allclose(rev[0], [1.0, 1.0])
    np.testing.assert_allclose(rev[1], 2 * a * b)


def test_value_and_grad_inside_function():
    w = gd.Variable(np.array([1.0, 2.0]))

    def loss_fn(x, scale):
        return gd.reduce_sum(gd.square(x * w)) * scale

    @gd.function
    def f(x, s):
        v1, g1 = gd.value_and_grad(loss_fn)(x, s)
        v2, (gx, gs) = gd.value_and_grad(loss_fn, argnums=(0, 1))(x, s)
        return v1, g1, v2, gx, gs

    x, s = np.array([3.0, -1.0]), np.array(0.5)
    v1, g1, v2, gx, gs = f(x, s)
    wn = np.array([1.0, 2.0])
    np.testing.assert_allclose(v1, np.sum((x * wn) ** 2) * 0.5)
    np.testing.assert_allclose(v2, v1)
    np.testing.assert_allclose(g1, 2 * x * wn * wn * 0.5)
    np.testing.assert_allclose(gx, g1)
    np.testing.assert_allclose(gs, np.sum((x * wn) ** 2))
    assert f.trace_count == 1


def test_value_and_grad_bad_argnums():
    vg = gd.value_and_grad(lambda x: gd.reduce_sum(x), argnums=1)
    with pytest.raises(ValueError, match="argnums"):
        vg(np.ones(2))
