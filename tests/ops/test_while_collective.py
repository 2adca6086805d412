"""A while_loop whose body holds a collective, under a strategy: accepted when its trip
count is the same on every replica (the replicas run it in lock step, the collective once
per iteration on all of them), refused at trace time, naming the line, when it may differ."""

import numpy as np
import pytest

import graphdist as gd


def _halving_all_reduce(strategy, limit):
    """Per replica: v <- all_reduce(sum, v) / n, while the counter (mirrored) is below
    `limit` (a mirrored variable): the replicas agree on the trip count."""
    n = strategy.num_replicas_in_sync

    def replica_step(x):
        ctx = gd.get_replica_context()

        def body(i, v, s):
            total = ctx.all_reduce("sum", v)
            return i + 1, total / float(n) + x, s + total

        return gd.while_loop(lambda i, v, s: i < limit, body,
                             (np.int32(0), x, gd.zeros_like(x)))

    @gd.function
    def step(x):
        return strategy.run(replica_step, args=(x,))

    return step


def _numpy_reference(xs, trips):
    n = len(xs)
    vs, ss = [x.copy() for x in xs], [np.zeros_like(x) for x in xs]
    for _ in range(trips):
        total = sum(vs)
        vs = [total / n + x for x in xs]
        ss = [s + total for s in ss]
    return vs, ss


@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize("mode", ["auto", "merged"])
def test_while_loop_with_all_reduce_runs_in_lock_step(replicas, mode):
    strategy = gd.MirroredStrategy([f"cpu:{k}" for k in range(replicas)])
    with strategy.scope():
        limit = gd.Variable(np.int32(3), name=f"limit_{replicas}_{mode}")
    step = _halving_all_reduce(strategy, limit)
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.arange(3.0) * (ctx.replica_id_in_sync_group + 1) - 1.0)
    xs = [v.copy() for v in values.values]
    try:
        gd.config.set_device_concurrency(mode)
        for trips in (3, 0, 5):          # one compiled step, trip counts from data
            limit.assign(np.int32(trips))
            i, v, s = step(values)
            want_v, want_s = _numpy_reference(xs, trips)
            for k in range(replicas):
                assert int(i.values[k]) == trips
                np.testing.assert_allclose(v.values[k], want_v[k], rtol=1e-12)
                np.testing.assert_allclose(s.values[k], want_s[k], rtol=1e-12)
    finally:
        gd.config.set_device_concurrency("auto")


def test_lock_step_loop_is_one_node_holding_the_replicated_body():
    from graphdist.ops.collectives import all_reduce_p
    from graphdist.ops.control_flow import while_p

    strategy = gd.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        limit = gd.Variable(np.int32(2), name="limit_graph")
    step = _halving_all_reduce(strategy, limit)
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.ones(2) * ctx.replica_id_in_sync_group)
    g = step.get_replicated_graph(values)
    loops = [e for e in g.eqns if e.op is while_p]
    assert len(loops) == 1
    body = dict(loops[0].params)["body"]
    assert {e.device for e in body.eqns} == {"cpu:0", "cpu:1"}
    ops = [e.op for e in body.eqns]
    assert all_reduce_p not in ops and sum(op.collective for op in ops) == 1   # lowered


def test_per_replica_trip_count_with_a_collective_is_refused_naming_the_line():
    strategy = gd.MirroredStrategy(["cpu:0", "cpu:1"])

    def replica_step(x):
        ctx = gd.get_replica_context()
        # the carry the predicate reads takes a per-replica value in the body
        return gd.while_loop(lambda i, v: i < 3.0,
                             lambda i, v: (i + gd.reduce_sum(x), ctx.all_reduce("sum", v)),
                             (np.float64(0), x))

    @gd.function
    def step(x):
        return strategy.run(replica_step, args=(x,))

    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.ones(2) * (ctx.replica_id_in_sync_group + 1))
    with pytest.raises(ValueError, match=r"trip count may differ between replicas") as err:
        step(values)
    assert "test_while_collective.py" in str(err.value)


def _unrolled_losses(w, xs, trips):
    vs = [x.copy() for x in xs]
    for _ in range(trips):
        total = sum(vs)
        vs = [np.tanh(total * w) for _ in vs]
    return [v.sum() for v in vs]


@pytest.mark.parametrize("replicas", [2, 4])
def test_gradient_through_a_bounded_lock_step_loop(replicas):
    """The backward loop counts down the (mirrored) trip count, so it runs in lock step
    too; gradients against finite differences of the unrolled loop in numpy."""
    strategy = gd.MirroredStrategy([f"cpu:{k}" for k in range(replicas)])
    w0 = np.array([0.5, -0.3])
    with strategy.scope():
        w = gd.Variable(w0.copy(), name=f"w_lockstep_{replicas}")

    def replica_step(x):
        ctx = gd.get_replica_context()

        def body(i, v):
            return i + 1, gd.tanh(ctx.all_reduce("sum", v) * w)

        with gd.GradientTape() as tape:
            _, v = gd.while_loop(lambda i, v: i < 3, body, (np.int32(0), x),
                                 maximum_iterations=5)
            loss = gd.reduce_sum(v)
        return loss, tape.gradient(loss, w)

    @gd.function
    def step(x):
        return strategy.run(replica_step, args=(x,))

    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.ones(2) * (ctx.replica_id_in_sync_group + 1) * 0.1)
    xs = [v.copy() for v in values.values]
    loss, grad = step(values)
    eps = 1e-6
    for k in range(replicas):
        want = [(_unrolled_losses(w0 + e, xs, 3)[k] - _unrolled_losses(w0 - e, xs, 3)[k])
                / (2 * eps) for e in np.eye(2) * eps]
        np.testing.assert_allclose(loss.values[k], _unrolled_losses(w0, xs, 3)[k])
        np.testing.assert_allclose(grad.values[k], want, rtol=1e-6)


# ---------------------------------------------------------------- scan


def _scan_step(strategy):
    def replica_step(xs):
        ctx = gd.get_replica_context()

        def f(c, x):
            total = ctx.all_reduce("sum", x * c)
            return c + 1.0, total + x

        return gd.scan(f, np.float64(1.0), xs)

    @gd.function
    def step(xs):
        return strategy.run(replica_step, args=(xs,))

    return step


@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize("mode", ["auto", "merged"])
def test_scan_with_all_reduce_is_one_loop_node(replicas, mode):
    from graphdist.ops.control_flow import scan_p

    strategy = gd.MirroredStrategy([f"cpu:{k}" for k in range(replicas)])
    step = _scan_step(strategy)
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.arange(12.0).reshape(6, 2) * (ctx.replica_id_in_sync_group + 1))
    xs = [v.copy() for v in values.values]
    try:
        gd.config.set_device_concurrency(mode)
        c, ys = step(values)
        g = step.get_replicated_graph(values)
    finally:
        gd.config.set_device_concurrency("auto")
    assert [e.op for e in g.eqns].count(scan_p) == 1          # not unrolled
    for k in range(replicas):
        want = np.stack([sum(x[t] * (1.0 + t) for x in xs) + xs[k][t] for t in range(6)])
        np.testing.assert_allclose(ys.values[k], want, rtol=1e-12)
        assert float(c.values[k]) == 7.0


def test_gradient_through_a_scan_holding_an_all_reduce():
    """Forward and backward scans both run in lock step; against finite differences of
    the unrolled loop in numpy (each replica's loss reads every replica's xs)."""
    from graphdist.ops.control_flow import scan_p

    strategy = gd.MirroredStrategy(["cpu:0", "cpu:1"])
    w0 = np.array([0.7, -0.4])
    with strategy.scope():
        w = gd.Variable(w0.copy(), name="w_scan_lockstep")

    def replica_step(xs):
        ctx = gd.get_replica_context()

        def f(h, x):
            h = gd.tanh(ctx.all_reduce("sum", h * w) + x)
            return h, h

        with gd.GradientTape() as tape:
            _, hs = gd.scan(f, gd.zeros_like(xs[0]), xs)
            loss = gd.reduce_sum(hs)
        return loss, tape.gradient(loss, w)

    @gd.function
    def step(xs):
        return strategy.run(replica_step, args=(xs,))

    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.linspace(-1, 1, 8).reshape(4, 2) * (ctx.replica_id_in_sync_group + 1))
    xs = [v.copy() for v in values.values]

    def losses(wv):
        hs = [np.zeros(2) for _ in xs]
        out = [0.0 for _ in xs]
        for t in range(4):
            total = sum(h * wv for h in hs)
            hs = [np.tanh(total + x[t]) for x in xs]
            out = [o + h.sum() for o, h in zip(out, hs)]
        return out

    loss, grad = step(values)
    assert [e.op for e in step.get_replicated_graph(values).eqns].count(scan_p) == 2
    for k in range(2):
        np.testing.assert_allclose(loss.values[k], losses(w0)[k])
    # all_reduce's gradient is the all-reduced cotangent (TF's rule): the replicas'
    # gradients add up to that of the summed loss
    eps = 1e-6
    want = [(sum(losses(w0 + e)) - sum(losses(w0 - e))) / (2 * eps) for e in np.eye(2) * eps]
    np.testing.assert_allclose(grad.values[0] + grad.values[1], want, rtol=1e-6)

    def unrolled_step(xs):                    # the same loop unrolled by Python
        ctx = gd.get_replica_context()
        with gd.GradientTape() as tape:
            h, loss = gd.zeros_like(xs[0]), 0.0
            for t in range(4):
                h = gd.tanh(ctx.all_reduce("sum", h * w) + xs[t])
                loss = loss + gd.reduce_sum(h)
        return tape.gradient(loss, w)

    unrolled = gd.function(lambda xs: strategy.run(unrolled_step, args=(xs,)))(values)
    for k in range(2):
        np.testing.assert_allclose(grad.values[k], unrolled.values[k], rtol=1e-12)
