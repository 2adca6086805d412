"""gd.scan: results against an unrolled numpy loop, reverse mode against finite
differences, variables assigned per iteration, one node whatever the length."""

import numpy as np
import pytest

import graphdist as gd
from graphdist.ops.control_flow import scan_p
from graphdist.ops.math import exp_p

from tests.ops.test_control_flow import numeric_grad


def rnn_np(h0, xs, w, u):
    h, ys = h0, []
    for x in xs:
        h = np.tanh(x @ w + h @ u)
        ys.append(h.sum())
    return h, np.array(ys)


def rnn_gd(h0, xs, w, u):
    def cell(h, x):
        h = gd.tanh(x @ w + h @ u)
        return h, gd.reduce_sum(h)

    return gd.scan(cell, h0, xs)


def _data(seed=0, steps=6):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(2, 3)) * 0.5, rng.normal(size=(steps, 2, 4)),
            rng.normal(size=(4, 3)) * 0.5, rng.normal(size=(3, 3)) * 0.5)


def test_scan_matches_an_unrolled_numpy_loop():
    h0, xs, w, u = _data()
    h, ys = gd.function(rnn_gd)(h0, xs, w, u)
    rh, rys = rnn_np(h0, xs, w, u)
    np.testing.assert_allclose(h, rh, rtol=1e-12)
    np.testing.assert_allclose(ys, rys, rtol=1e-12)


def test_scan_reverse_pytrees_and_no_xs():
    @gd.function
    def step(xs):
        (total, count), ys = gd.scan(
            lambda c, x: ((c[0] + x["a"] * x["b"], c[1] + 1), {"run": c[0] + x["a"]}),
            (np.float64(0), 0), {"a": xs, "b": xs * 2.0}, reverse=True)
        powers = gd.scan(lambda c, _: (c * 2.0, c), np.float64(1), None, length=4)[1]
        return total, count, ys["run"], powers

    xs = np.array([1.0, 2.0, 3.0])
    total, count, run, powers = step(xs)
    assert float(total) == pytest.approx(np.sum(2 * xs * xs)) and int(count) == 3
    acc, ref = 0.0, np.zeros(3)
    for i in (2, 1, 0):
        ref[i] = acc + xs[i]
        acc += 2 * xs[i] * xs[i]
    np.testing.assert_allclose(run, ref)
    np.testing.assert_allclose(powers, [1.0, 2.0, 4.0, 8.0])


@pytest.mark.parametrize("reverse", [False, True])
def test_scan_gradient_matches_finite_differences(reverse):
    h0, xs, w, u = _data(1, steps=5)

    def loss_np(h0, xs, w, u):
        order = xs[::-1] if reverse else xs
        h, ys = rnn_np(h0, order, w, u)
        return np.sum(h * h) + np.sum(ys * np.arange(1, 6)[::-1 if reverse else 1])

    @gd.function
    def grads(h0, xs, w, u):
        with gd.GradientTape() as tape:
            tape.watch([h0, xs, w, u])

            def cell(h, x):
                h = gd.tanh(x @ w + h @ u)
                return h, gd.reduce_sum(h)

            h, ys = gd.scan(cell, h0, xs, reverse=reverse)
            loss = gd.reduce_sum(h * h) + gd.reduce_sum(ys * np.arange(1.0, 6.0))
        return tape.gradient(loss, [h0, xs, w, u])

    got = grads(h0, xs, w, u)
    args = [h0, xs, w, u]
    for k, g in enumerate(got):
        def f(v, k=k):
            a = list(args)
            a[k] = v
            return loss_np(*a)

        np.testing.assert_allclose(g, numeric_grad(f, args[k]), rtol=1e-5, atol=1e-8)


def test_scan_assigns_a_variable_each_iteration():
    total = gd.Variable(np.zeros(()), name="total_scan")

    @gd.function
    def step(xs):
        def body(c, x):
            total.assign_add(x * c)          # reads the previous iteration's total
            return c + 1.0, total.read_value()

        return gd.scan(body, np.float64(1), xs)[1]

    running = step(np.array([1.0, 2.0, 3.0]))
    np.testing.assert_allclose(running, [1.0, 5.0, 14.0])
    assert float(total.numpy()) == 14.0


def _scan_eqns(g):
    return [e for e in g.eqns if e.op is scan_p]


def test_one_node_whatever_the_length_and_history_only_for_gradients():
    @gd.function
    def forward(xs):
        return gd.scan(lambda c, x: (c * 0.5 + x, c), np.float64(0), xs)[0]

    short, long = np.ones(10), np.ones(1000)
    forward(short)
    forward(long)
    g10, g1000 = forward.get_graph(short), forward.get_graph(long)
    assert len(g10.eqns) == len(g1000.eqns)
    assert len(forward.program_source(short)) == len(forward.program_source(long))
    (placed,) = _scan_eqns(forward.get_replicated_graph(long))
    assert dict(placed.params)["history"] is False          # no gradient: none kept
    ref = 0.0
    for _ in range(1000):
        ref = ref * 0.5 + 1.0
    assert float(forward(long)) == pytest.approx(ref)


def test_scan_errors_name_the_body():
    @gd.function
    def step(xs):
        return gd.scan(lambda c, x: (gd.concat([c, x], 0), x), np.zeros(2), xs)

    with pytest.raises(gd.ShapeError, match=r"scan's f.*lambda c, x: \(gd.concat"):
        step(np.ones((3, 2)))

    @gd.function
    def uneven(a, b):
        return gd.scan(lambda c, x: (c, x[0] + x[1]), np.float64(0), (a, b))

    with pytest.raises(gd.ShapeError, match="leading axes"):
        uneven(np.ones(3), np.ones(4))


def test_dead_ys_are_not_stacked():
    @gd.function
    def step(xs):
        carry, (kept, dropped) = gd.scan(lambda c, x: (c + x, (c * 2.0, gd.exp(c))),
                                         np.float64(0), xs)
        return carry, kept

    xs = np.array([1.0, 2.0, 3.0])
    carry, kept = step(xs)
    np.testing.assert_allclose(kept, [0.0, 2.0, 6.0])
    (placed,) = _scan_eqns(step.get_replicated_graph(xs))
    body = dict(placed.params)["body"]
    assert len(placed.outputs) == 2 and len(body.outputs) == 2
    assert all(e.op is not exp_p for e in body.eqns)


def test_nested_cond_in_scan_with_captures_and_gradient():
    w = np.array([0.7, -0.3])

    def f_np(x, scale):
        c = np.zeros(2)
        for xi in x:
            c = np.sin(c + xi * scale) if xi.sum() > 0 else c * scale - xi
        return np.sum(c * w)

    @gd.function
    def grads(x, scale):
        with gd.GradientTape() as tape:
            tape.watch([x, scale])

            def body(c, xi):
                c = gd.cond(gd.reduce_sum(xi) > 0, lambda: gd.sin(c + xi * scale),
                            lambda: c * scale - xi)
                return c, ()

            c, _ = gd.scan(body, np.zeros(2), x)
            loss = gd.reduce_sum(c * w)
        return loss, tape.gradient(loss, [x, scale])

    rng = np.random.default_rng(5)
    x, scale = rng.normal(size=(6, 2)), np.float64(1.3)
    loss, (gx, gs) = grads(x, scale)
    assert float(loss) == pytest.approx(f_np(x, scale))
    np.testing.assert_allclose(gx, numeric_grad(lambda v: f_np(v, scale), x), rtol=1e-5,
                               atol=1e-8)
    assert float(gs) == pytest.approx(
        (f_np(x, scale + 1e-6) - f_np(x, scale - 1e-6)) / 2e-6, rel=1e-5)
