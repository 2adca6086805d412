"""gd.cond and gd.while_loop / gd.fori_loop: results against numpy references, variables
assigned inside, errors, the text IR and program, and gradients against finite
differences."""

import numpy as np
import pytest

import graphdist as gd
from graphdist.ir import evaluate

F64 = np.float64


def numeric_grad(f, x, eps=1e-6):
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[i] = eps
        g[i] = (f(x + e) - f(x - e)) / (2 * eps)
    return g


# ---------------------------------------------------------------- cond


def test_cond_runs_the_taken_branch_compiled_once():
    traces = []

    @gd.function
    def step(x, p):
        traces.append(1)
        return gd.cond(p > 0, lambda: gd.tanh(x) * 2.0, lambda: x - 1.0)

    x = np.linspace(-1, 1, 5)
    np.testing.assert_allclose(step(x, F64(1.0)), np.tanh(x) * 2.0)
    np.testing.assert_allclose(step(x, F64(-1.0)), x - 1.0)
    assert len(traces) == 1
    source = step.program_source()
    assert " if " in source and " else " in source


def test_cond_with_operands_and_pytrees():
    @gd.function
    def step(x, y, p):
        return gd.cond(p, lambda a: {"s": a[0] + a[1], "d": a[0] - a[1]},
                       lambda a: {"s": a[0] * a[1], "d": a[1]}, (x, y))

    x, y = np.array([1.0, 2.0]), np.array([3.0, 5.0])
    out = step(x, y, np.bool_(True))
    np.testing.assert_allclose(out["s"], x + y)
    np.testing.assert_allclose(out["d"], x - y)
    out = step(x, y, np.bool_(False))
    np.testing.assert_allclose(out["s"], x * y)
    np.testing.assert_allclose(out["d"], y)


def test_python_bool_predicate_traces_one_branch():
    traced = []

    def other():
        traced.append("false")
        return np.float64(0)

    @gd.function
    def step(x):
        return gd.cond(True, lambda: x + 1.0, other)

    np.testing.assert_allclose(step(np.array([1.0])), [2.0])
    assert traced == []


def test_assignment_happens_only_when_its_branch_runs():
    w = gd.Variable(np.ones(3), name="w_cond")
    count = gd.Variable(np.zeros((), np.int32), name="count_cond")

    @gd.function
    def step(x):
        def grow():
            w.assign(w * 2.0)
            count.assign_add(1)
            return gd.reduce_sum(w)         # reads the new value

        return gd.cond(gd.reduce_sum(x) > 0, grow, lambda: gd.reduce_sum(w) * 0.0) + w

    np.testing.assert_allclose(step(np.ones(2)), np.full(3, 8.0))
    np.testing.assert_allclose(w.numpy(), np.full(3, 2.0))
    np.testing.assert_allclose(step(-np.ones(2)), np.full(3, 2.0))
    np.testing.assert_allclose(w.numpy(), np.full(3, 2.0))
    assert int(count.numpy()) == 1


def test_branches_that_disagree_name_both_and_their_lines():
    def true_fn():
        return np.ones(3)

    def false_fn():
        return np.ones(4)

    @gd.function
    def step(p):
        return gd.cond(p > 0, true_fn, false_fn)

    with pytest.raises(gd.ShapeError) as info:
        step(np.float64(1))
    text = str(info.value)
    assert "true_fn" in text and "false_fn" in text
    assert "def true_fn():" in text and "def false_fn():" in text
    assert "f64[3]" in text and "f64[4]" in text

    @gd.function
    def mixed(p):
        return gd.cond(p > 0, lambda: np.ones(3, np.float32), lambda: np.ones(3))

    with pytest.raises(TypeError, match="f32.3. from true_fn.*f64.3. from false_fn"):
        mixed(np.float64(1))


def test_predicate_must_be_a_scalar_bool():
    @gd.function
    def step(x):
        return gd.cond(x > 0, lambda: x, lambda: -x)

    with pytest.raises(TypeError, match="scalar bool"):
        step(np.ones(3))


def test_text_ir_indents_the_branches():
    @gd.function
    def step(x, p):
        return gd.cond(p > 0, lambda: x * 3.0, lambda: -x)

    step(np.ones(2), F64(1.0))
    text = str(step.graph)
    assert "= cond[branches=" in text
    assert "\n    branches[0](" in text and "\n    branches[1](" in text
    assert "\n      " in text and " = mul " in text and " = neg " in text


def test_cond_gradient_matches_finite_differences():
    def f_np(x, p):
        return np.sum(np.sin(x) * x) if p > 0 else np.sum(np.exp(x) * 0.5)

    @gd.function
    def grad(x, p):
        with gd.GradientTape() as tape:
            tape.watch(x)
            y = gd.cond(p > 0, lambda: gd.reduce_sum(gd.sin(x) * x),
                        lambda: gd.reduce_sum(gd.exp(x) * 0.5))
        return tape.gradient(y, x)

    x = np.array([0.3, -1.2, 2.0])
    for p in (F64(1.0), F64(-1.0)):
        np.testing.assert_allclose(grad(x, p), numeric_grad(lambda v: f_np(v, p), x),
                                   rtol=1e-6, atol=1e-8)


def test_cond_gradient_reaches_a_variable_read_in_a_branch():
    w = gd.Variable(np.array([1.5, -0.5]), name="w_grad_cond")

    @gd.function
    def grad(x, p):
        with gd.GradientTape() as tape:
            y = gd.cond(p > 0, lambda: gd.reduce_sum(w * w * x), lambda: gd.reduce_sum(x))
        return tape.gradient(y, [w])[0]

    x = np.array([2.0, 3.0])
    np.testing.assert_allclose(grad(x, F64(1.0)), 2 * w.numpy() * x)
    np.testing.assert_allclose(grad(x, F64(-1.0)), np.zeros(2))


def test_evaluate_agrees_with_the_compiled_program():
    @gd.function
    def step(x, p):
        return gd.cond(p > 0, lambda: x * x, lambda: x + 1.0)

    x = np.array([1.0, 2.0])
    for p in (F64(1.0), F64(-1.0)):
        g = step.get_graph(x, p) if hasattr(step, "get_graph") else None
        if g is None:
            pytest.skip("no get_graph")
        np.testing.assert_allclose(evaluate(g, x, p)[0], step(x, p))


# ---------------------------------------------------------------- while_loop, fori_loop


def test_while_loop_matches_a_python_loop():
    @gd.function
    def step(x):
        return gd.while_loop(lambda i, v: gd.reduce_sum(v) < 100.0,
                             lambda i, v: (i + 1, v * 2.0 + 1.0), (0, x))

    x = np.array([1.0, 2.0])
    i, v = step(x)
    ri, rv = 0, x.copy()
    while rv.sum() < 100:
        ri, rv = ri + 1, rv * 2 + 1
    assert int(i) == ri
    np.testing.assert_allclose(v, rv)
    i, v = step(np.array([60.0, 50.0]))       # no iteration at all
    assert int(i) == 0


def test_while_loop_stops_at_maximum_iterations():
    @gd.function
    def step(x):
        return gd.while_loop(lambda v: True, lambda v: v + 1.0, x, maximum_iterations=7)

    np.testing.assert_allclose(step(np.zeros(2)), np.full(2, 7.0))


def test_while_loop_assigns_variables_per_iteration():
    acc = gd.Variable(np.zeros(2), name="acc_while")

    @gd.function
    def step(n):
        def body(i):
            acc.assign_add(acc + 1.0)     # reads this iteration's value
            return i + 1

        return gd.while_loop(lambda i: i < n, body, np.int32(0))

    step(np.int32(3))
    np.testing.assert_allclose(acc.numpy(), np.full(2, 7.0))    # 0 -> 1 -> 3 -> 7
    step(np.int32(0))
    np.testing.assert_allclose(acc.numpy(), np.full(2, 7.0))


def test_while_loop_body_must_keep_types_naming_its_line():
    @gd.function
    def step(x):
        return gd.while_loop(lambda v: gd.reduce_sum(v) < 3.0, lambda v: gd.concat([v, v], 0),
                             x)

    with pytest.raises(gd.ShapeError, match="body_fn.*lambda v: gd.concat"):
        step(np.ones(2))


def test_bounded_while_loop_gradient_matches_finite_differences():
    def f_np(x):
        v = x.copy()
        while np.sum(v * v) < 50.0:
            v = np.sin(v) + v * 1.5
        return np.sum(v)

    @gd.function
    def grad(x):
        with gd.GradientTape() as tape:
            tape.watch(x)
            v = gd.while_loop(lambda v: gd.reduce_sum(v * v) < 50.0,
                              lambda v: gd.sin(v) + v * 1.5, x, maximum_iterations=40)
            y = gd.reduce_sum(v)
        return tape.gradient(y, x)

    x = np.array([0.7, 1.1, -0.4])
    np.testing.assert_allclose(grad(x), numeric_grad(f_np, x), rtol=1e-5, atol=1e-8)


def test_unbounded_while_loop_gradient_names_the_loop_line():
    @gd.function
    def grad(x):
        with gd.GradientTape() as tape:
            tape.watch(x)
            v = gd.while_loop(lambda v: gd.reduce_sum(v) < 5.0, lambda v: v * 2.0, x)  # L1
            y = gd.reduce_sum(v)
        return tape.gradient(y, x)

    with pytest.raises(ValueError, match="maximum_iterations(.|\n)*# L1"):
        grad(np.ones(2))


@pytest.mark.parametrize("static", [True, False])
def test_fori_loop(static):
    @gd.function
    def step(x, n):
        upper = 5 if static else n
        return gd.fori_loop(0, upper, lambda i, c: c * 2.0 + gd.cast(i, "float64"), x)

    ref = np.array([1.0, -1.0])
    for i in range(5):
        ref = ref * 2 + i
    np.testing.assert_allclose(step(np.array([1.0, -1.0]), np.int32(5)), ref)


def test_fori_loop_gradient_with_python_bounds():
    @gd.function
    def grad(x):
        with gd.GradientTape() as tape:
            tape.watch(x)
            y = gd.reduce_sum(gd.fori_loop(0, 4, lambda i, c: gd.tanh(c) * x, x))
        return tape.gradient(y, x)

    def f_np(x):
        c = x
        for _ in range(4):
            c = np.tanh(c) * x
        return c.sum()

    x = np.array([0.5, -0.8])
    np.testing.assert_allclose(grad(x), numeric_grad(f_np, x), rtol=1e-6)


def test_eager_calls_run_python_control_flow():
    assert float(gd.cond(np.bool_(False), lambda: 1.0, lambda: 2.0)) == 2.0
    i, v = gd.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, v * 2.0), (0, 1.0))
    assert (i, v) == (3, 8.0)
    assert gd.fori_loop(0, 4, lambda i, c: c + i, 0) == 6


# ---------------------------------------------------------------- under a strategy


def test_collective_under_a_per_replica_predicate_is_refused():
    strategy = gd.MirroredStrategy(["cpu:0", "cpu:1"])

    def replica_step(x):
        ctx = gd.get_replica_context()
        return gd.cond(gd.reduce_sum(x) > 0, lambda: ctx.all_reduce("sum", x), lambda: x)

    @gd.function
    def step(x):
        return strategy.run(replica_step, args=(x,))

    with pytest.raises(ValueError, match="predicate may differ between replicas"):
        step(strategy.experimental_distribute_values_from_function(
            lambda ctx: np.ones(2) * (ctx.replica_id_in_sync_group - 0.5)))


def test_cond_runs_per_replica_under_a_strategy():
    strategy = gd.MirroredStrategy(["cpu:0", "cpu:1"])

    def replica_step(x):
        return gd.cond(gd.reduce_sum(x) > 0, lambda: x * 10.0, lambda: x - 1.0)

    @gd.function
    def step(x):
        return strategy.run(replica_step, args=(x,))

    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.ones(2) * (ctx.replica_id_in_sync_group - 0.5))
    out = step(values).values
    np.testing.assert_allclose(out[0], np.full(2, -1.5))
    np.testing.assert_allclose(out[1], np.full(2, 5.0))


def _merged_step(branch_true):
    strategy = gd.MirroredStrategy(["cpu:0", "cpu:1"])

    def replica_step(x):
        return gd.cond(gd.reduce_sum(x) > 0, lambda: branch_true(x), lambda: x - 1.0)

    @gd.function
    def step(x):
        return strategy.run(replica_step, args=(x,))

    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.ones((4, 4)) * (ctx.replica_id_in_sync_group - 0.5))
    return step, values


@pytest.mark.parametrize("cheap", [True, False])
def test_merged_replicas_select_cheap_branches_else_run_per_replica(cheap):
    from graphdist.ops.control_flow import cond_p
    from graphdist.ops.math import where_p
    from graphdist.passes import merge

    big = np.ones((4, 4))
    branch = (lambda x: x * 10.0) if cheap else (lambda x: x @ big * 10.0)
    step, values = _merged_step(branch)
    expected = [v.copy() for v in values.values]
    expected = [expected[0] - 1.0, branch(expected[1])]
    try:
        gd.config.set_device_concurrency("merged")
        if not cheap:
            old, merge.CHEAP_BRANCH_FLOPS = merge.CHEAP_BRANCH_FLOPS, 10
        out = step(values).values
        g = step.get_replicated_graph(values)
    finally:
        gd.config.set_device_concurrency("auto")
        if not cheap:
            merge.CHEAP_BRANCH_FLOPS = old
    assert g.merged
    ops = [e.op for e in g.eqns]
    assert (cond_p not in ops and where_p in ops) if cheap else ops.count(cond_p) == 2
    for got, want in zip(out, expected):
        np.testing.assert_allclose(got, want)


def test_views_show_bodies_as_groups(tmp_path):
    @gd.function
    def step(x, p):
        return gd.cond(p > 0, lambda: gd.tanh(x) * 3.0, lambda: -x)

    x = np.ones(2)
    step(x, F64(1.0))
    g = step.get_graph(x, F64(1.0))
    g.to_html(tmp_path / "g.html")
    html = (tmp_path / "g.html").read_text()
    assert "cond#" in html and "branches[0]" in html and "branches[1]" in html
    nx = g.to_networkx()
    assert {"tanh", "neg", "cond"} <= {d["op"] for _, d in nx.nodes(data=True)}
    assert "cond" in g.summary()


def test_cost_counts_bodies_by_trip_count():
    from graphdist.ops.control_flow import graph_cost, scan_p

    @gd.function
    def step(xs, w):
        return gd.scan(lambda c, x: (gd.tanh(c @ w + x), c), np.zeros((2, 8)), xs)[0]

    for length in (10, 100):
        xs, w = np.ones((length, 2, 8)), np.ones((8, 8))
        g = step.get_graph(xs, w)
        (eqn,) = [e for e in g.eqns if e.op is scan_p]
        body = dict(eqn.params)["body"]
        flops, _ = eqn.op.cost([v.ty for v in eqn.inputs], [v.ty for v in eqn.outputs],
                               dict(eqn.params))
        assert flops == length * graph_cost(body)[0] > length * 2 * 2 * 8 * 8 - 1


def test_collective_under_a_mirrored_predicate_runs_on_every_replica():
    strategy = gd.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        flag = gd.Variable(np.float64(1.0), name="flag_cond")

    def replica_step(x):
        ctx = gd.get_replica_context()
        y = gd.cond(flag > 0, lambda: ctx.all_reduce("sum", x), lambda: x * 0.0)
        _, ys = gd.scan(lambda c, xi: (c, ctx.all_reduce("sum", xi)), np.float64(0), x)
        return y, ys

    @gd.function
    def step(x):
        return strategy.run(replica_step, args=(x,))

    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.arange(2.0) + 10 * ctx.replica_id_in_sync_group)
    total = values.values[0] + values.values[1]
    y, ys = step(values)
    for k in range(2):
        np.testing.assert_allclose(y.values[k], total)
        np.testing.assert_allclose(ys.values[k], total)
    flag.assign(-1.0)
    y, _ = step(values)
    np.testing.assert_allclose(y.values[0], np.zeros(2))
