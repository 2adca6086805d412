"""The replication pass (graphdist/passes/replicate.py): N logical graphs become one placed
graph. Structural checks on small graphs (valid IR, every eqn placed, cross-device data only
through collective nodes, a DAG, N copies of the compute, replica_id as constants, the text
form), and an independent interpreter that runs the placed graph eqn by eqn against numpy."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

import graphdist as gd
from graphdist import pipeline
from graphdist.distribute import cross_device_ops as cdo_module
from graphdist.errors import GraphError
from graphdist.ir import Lit, Var
from graphdist.ir.check import check
from graphdist.passes.collectives import lower_collectives
from graphdist.passes.replicate import replicate

DEVICES = ("cpu:0", "cpu:1", "cpu:2", "cpu:3")
LOGICAL_COLLECTIVES = {"all_reduce", "broadcast"}


def _lowerings():
    out = [pytest.param(None, id="default"),
           pytest.param(gd.ReductionToOneDevice(), id="to_one_device"),
           pytest.param(gd.ReductionToOneDevice("cpu:2"), id="to_cpu2")]
    for name, kw in [("RingAllReduce", {}), ("RingAllReduce", {"num_chunks": 3}),
                     ("HierarchicalCopyAllReduce", {}), ("HostAllReduce", {})]:
        cls = getattr(cdo_module, name, None)
        if cls is not None:
            out.append(pytest.param(cls(**kw), id=f"{name}{kw or ''}"))
    return out


LOWERINGS = _lowerings()


# ---------------------------------------------------------------- the small programs


def _model_step(strategy, x_rows=8):
    """A logical graph with every kind of node: a name scope, variable reads and writes,
    gradients, a (bucketed) gradient all-reduce, a replica id, a broadcast and a reduce."""
    rng = np.random.default_rng(0)
    with strategy.scope():
        w = gd.Variable(rng.standard_normal((3, 2)).astype(np.float32), name="w")
        b = gd.Variable(np.zeros(2, np.float32), name="b")
        first = gd.Variable(np.zeros(2, np.float32), name="first",
                            aggregation=gd.VariableAggregation.ONLY_FIRST_REPLICA)
        opt = gd.optimizers.SGD(learning_rate=0.5)

    @gd.function
    def step(x):
        def replica_fn(x):
            ctx = gd.get_replica_context()
            with gd.name_scope("layer"):
                h = gd.tanh(x @ w + b)
                loss = gd.reduce_mean(h * h)
            with gd.GradientTape() as tape, gd.name_scope("layer"):
                loss = gd.reduce_mean(gd.tanh(x @ w + b) ** 2)
            opt.apply_gradients(zip(tape.gradient(loss, [w, b]), [w, b]))
            rid = gd.cast(ctx.replica_id_in_sync_group, "float32")
            first.assign(gd.reduce_sum(h, axis=0) + rid)
            return loss, rid * 10.0, ctx.all_reduce("sum", loss)

        loss, rid, total = strategy.run(replica_fn, args=(x,))
        return strategy.reduce("mean", loss, axis=None), rid, total

    rows = x_rows
    x = rng.standard_normal((rows, 3)).astype(np.float32)
    batch = next(iter(strategy.experimental_distribute_dataset([x])))
    return step, batch, x, (w, b, first)


def _np_model_step(params, x, n=4):
    w, b, _ = (p.astype(np.float64) for p in params)
    shards = np.array_split(x.astype(np.float64), n)
    losses, gws, gbs, hs = [], [], [], []
    for s in shards:
        h = np.tanh(s @ w + b)
        losses.append(np.mean(h * h))
        dh = 2 * h / h.size * (1 - h * h)
        gws.append(s.T @ dh)
        gbs.append(dh.sum(0))
        hs.append(h.sum(0))
    new_w = w - 0.5 * np.mean(gws, 0)
    new_b = b - 0.5 * np.mean(gbs, 0)
    return np.mean(losses), losses, new_w, new_b, hs[0] + 0.0


# ---------------------------------------------------------------- structural checks


def _producers(g):
    made = {v: None for v in g.inputs}
    for eqn in g.eqns:
        for v in eqn.outputs:
            assert v not in made, f"{v} bound twice"
            made[v] = eqn
    return made


def _assert_dag(g):
    """Kahn's algorithm on the eqn dependency graph, independent of the eqn order."""
    made = _producers(g)
    index = {id(e): i for i, e in enumerate(g.eqns)}
    deps = [set() for _ in g.eqns]
    for i, eqn in enumerate(g.eqns):
        for v in eqn.inputs:
            if isinstance(v, Var):
                assert v in made, f"{v} is read but never defined"
                if made[v] is not None:
                    deps[i].add(index[id(made[v])])
    users = [[] for _ in g.eqns]
    for i, ds in enumerate(deps):
        for d in ds:
            users[d].append(i)
    waiting = [len(ds) for ds in deps]
    ready = [i for i, k in enumerate(waiting) if k == 0]
    seen = 0
    while ready:
        i = ready.pop()
        seen += 1
        for u in users[i]:
            waiting[u] -= 1
            if waiting[u] == 0:
                ready.append(u)
    assert seen == len(g.eqns), "the placed graph has a cycle"
    # and the eqn order itself is a topological order
    position = {}
    for i, eqn in enumerate(g.eqns):
        for v in eqn.inputs:
            if isinstance(v, Var) and made[v] is not None:
                assert position[v] < i
        position.update((v, i) for v in eqn.outputs)


def _assert_placed(g, devices):
    check(g)
    assert tuple(g.devices) == tuple(devices)
    for v in g.inputs:
        assert v.device in devices, f"input {v} has no device"
    for eqn in g.eqns:
        assert eqn.device in devices, f"unplaced eqn: {eqn}"
        assert eqn.op.name not in LOGICAL_COLLECTIVES, f"collective left unlowered: {eqn}"
        assert eqn.op.name != "replica_id", "replica_id must become a per-device constant"
        for v in eqn.outputs:
            assert v.device in devices, f"{eqn}: output without a device"
        if eqn.op.collective:
            continue
        for v in (*eqn.inputs, *eqn.outputs):
            if isinstance(v, Var):
                assert v.device == eqn.device, f"cross-device edge outside a collective: {eqn}"
    for v in g.outputs:
        assert not isinstance(v, Var) or v.device in devices
    _assert_dag(g)


def _compute_eqns(g, device=None):
    return [e for e in g.eqns if e.scope != "collectives" and not e.op.collective
            and (device is None or e.device == device)]


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_placed_graph_is_valid_placed_and_acyclic(lowering):
    strategy = gd.MirroredStrategy(list(DEVICES), cross_device_ops=lowering)
    step, batch, _, _ = _model_step(strategy)
    step(batch)
    logical, placed = step.graph, step.replicated_graph
    check(logical)
    assert all(e.device is None for e in logical.eqns)
    assert sum(e.op.name in LOGICAL_COLLECTIVES for e in logical.eqns) >= 3
    _assert_placed(placed, DEVICES)
    # per-device inputs: N x the logical arguments and states, in replica order
    assert len(placed.inputs) == 4 * len(logical.inputs)
    assert len(placed.outputs) == 4 * len(logical.outputs)
    assert placed.replication.replicas == 4
    a = logical.num_args
    assert [v.device for v in placed.inputs[:4 * a]] == [d for d in DEVICES for _ in range(a)]
    assert len(placed.variables) == 4 * len(logical.variables)


@pytest.mark.parametrize("lowering", LOWERINGS[:2])
def test_compute_is_cloned_once_per_device(lowering, monkeypatch):
    strategy = gd.MirroredStrategy(list(DEVICES), cross_device_ops=lowering)
    # no epilogues either: they fold each matmul's bias add and activation into one node
    monkeypatch.setattr(pipeline, "epilogues", lambda: [])
    gd.config.set_device_concurrency("threads")   # the replicated graph as replicate made it
    try:                                            # (one program would fuse the updates)
        step, batch, _, _ = _model_step(strategy)
        step(batch)
    finally:
        gd.config.set_device_concurrency("auto")
    logical, placed = step.graph, step.replicated_graph
    logical_compute = [e for e in logical.eqns
                       if e.op.name not in LOGICAL_COLLECTIVES and e.op.name != "replica_id"]
    assert len(_compute_eqns(placed)) == 4 * len(logical_compute)
    want = Counter((e.op.name, e.scope, e.params) for e in logical_compute)
    for d in DEVICES:
        got = Counter((e.op.name, e.scope, e.params) for e in _compute_eqns(placed, d))
        assert got == want, d
    assert any(e.scope == "layer" for e in _compute_eqns(placed, "cpu:3"))
    # every logical collective became work in the "collectives" scope
    assert any(e.scope == "collectives" for e in placed.eqns)


def test_replica_id_becomes_per_device_constants():
    strategy = gd.MirroredStrategy(list(DEVICES), cross_device_ops=gd.ReductionToOneDevice())

    @gd.function
    def f(x):
        return strategy.run(lambda x: x * gd.cast(
            gd.get_replica_context().replica_id_in_sync_group, "float32"), args=(x,))

    out = f(np.ones(3, np.float32))
    assert [v.tolist() for v in out.values] == [[float(d)] * 3 for d in range(4)]
    assert [e.op.name for e in f.graph.eqns].count("replica_id") == 1
    placed = f.replicated_graph
    assert "replica_id" not in [e.op.name for e in placed.eqns]
    casts = [e for e in placed.eqns if e.op.name == "cast"]
    assert len(casts) == 4
    for eqn in casts:
        (lit,) = eqn.inputs
        assert isinstance(lit, Lit) and lit.ty.dtype == np.int32
        assert int(lit.value) == DEVICES.index(eqn.device)


def _momentum_step_text(strategy):
    with strategy.scope():
        w = gd.Variable(np.ones((3, 2), np.float32), name="w")
        opt = gd.optimizers.SGD(0.1, momentum=0.9)

    @gd.function
    def step(x):
        def replica_fn(x):
            with gd.GradientTape() as tape:
                loss = gd.reduce_sum(x @ w)
            opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))
            return loss

        return strategy.run(replica_fn, args=(x,))

    step(next(iter(strategy.experimental_distribute_dataset([np.ones((8, 3), np.float32)]))))
    return str(step.replicated_graph)


def test_text_form_names_replicas_and_devices():
    strategy = gd.MirroredStrategy(list(DEVICES), cross_device_ops=gd.ReductionToOneDevice())
    step, batch, _, _ = _model_step(strategy)
    step(batch)
    text = str(step.replicated_graph)
    header = text.splitlines()[0]
    assert header.endswith("on cpu:0,cpu:1,cpu:2,cpu:3 {"), header
    for d in range(4):
        assert f"@{d}" in text
        assert f"# cpu:{d}" in text
    assert "@4" not in text
    assert "copy_to" in text and "all_reduce" not in text
    assert "# collectives" in text and "# layer" in text
    logical_text = str(step.graph)
    assert "@0" not in logical_text and " on cpu" not in logical_text.splitlines()[0]
    assert "all_reduce" in logical_text
    # the same logical value has the same name on every device (no clash with the names of
    # the collectives' temporaries), so identical replicas fold, the optimizer tail included
    assert "_1@" not in text
    folds = [line for line in text.splitlines() if "same" in line and "eqns as cpu:0" in line]
    assert len(folds) >= 3 and any("@0 -> @3" in line for line in folds), text
    tail = _momentum_step_text(strategy)
    lines = tail.splitlines()
    after = lines[max(i for i, line in enumerate(lines) if line == "  # collectives"):]
    assert any("same" in line and "@0 -> @3" in line for line in after), tail
    assert "_1@" not in tail


def test_text_form_is_one_line_per_eqn():
    # the gradient of reduce_mean makes an array constant: it must print on one line too
    from graphdist.ir.printer import graph_text

    strategy = gd.MirroredStrategy(list(DEVICES), cross_device_ops=gd.ReductionToOneDevice())
    step, batch, _, _ = _model_step(strategy)
    step(batch)
    g = step.replicated_graph
    unfolded = graph_text(g, None, fold=False)
    body = [line for line in unfolded.splitlines()[1:-2] if not line.strip().startswith("#")]
    assert len(body) == len(g.eqns), [line for line in body if "=" not in line]
    assert "_1@" not in unfolded


# ---------------------------------------------------------------- semantics


def _interpret(g, args, states):
    """Run a placed graph eqn by eqn with each op's numpy impl (no executor involved)."""
    env = dict(zip(g.inputs, list(args) + [s.copy() for s in states]))

    def value(v):
        return np.asarray(v.value, dtype=v.ty.dtype) if isinstance(v, Lit) else env[v]

    for eqn in g.eqns:
        out = eqn.op.impl(np, *(value(v) for v in eqn.inputs), **dict(eqn.params))
        outs = (out,) if len(eqn.outputs) == 1 and not isinstance(out, tuple) else out
        assert len(outs) == len(eqn.outputs), eqn
        for v, o in zip(eqn.outputs, outs):
            o = np.asarray(o)
            assert o.shape == v.ty.shape and o.dtype == v.ty.dtype, eqn
            env[v] = o
    return [value(v) for v in g.outputs]


@pytest.mark.parametrize("rows", [8, 10])
@pytest.mark.parametrize("lowering", LOWERINGS)
# 10 rows on 4 replicas: the per-replica mean of uneven shards warns (distribute/recipes.py)
@pytest.mark.filterwarnings("ignore:.*the shards are uneven:UserWarning")
def test_interpreted_placed_graph_matches_numpy(lowering, rows):
    strategy = gd.MirroredStrategy(list(DEVICES), cross_device_ops=lowering)
    step, batch, x, variables = _model_step(strategy, x_rows=rows)
    initial = [v.numpy() for v in variables]
    states_before = None
    placed = step.get_replicated_graph(batch)
    _assert_placed(placed, DEVICES)
    assert [v.shape for v in placed.inputs[:4]] == [s.shape for s in batch.values]
    n_vars = len(placed.variables) // 4
    live = step._latest().variables     # the graph names state by reference only
    assert set(live) == set(placed.variables) and all(v.ref in live for v in variables)
    states_before = [live[placed.variables[i]].values[DEVICES.index(placed.inputs[4 + i].device)]
                     for i in range(4 * n_vars)]
    outs = _interpret(placed, batch.values, states_before)
    mean_loss, losses, new_w, new_b, first = _np_model_step(initial, x)
    assert first.shape == (2,)
    r = placed.replication.results_per_replica
    results, finals = outs[:4 * r], outs[4 * r:]
    for d in range(4):
        loss, rid, total = results[d * r:(d + 1) * r]
        np.testing.assert_allclose(loss, mean_loss, rtol=1e-5)
        assert float(rid) == 10.0 * d
        np.testing.assert_allclose(total, np.sum(losses), rtol=1e-5)
    for k, var in enumerate(placed.variables):
        name = var.name
        want = {"w": new_w, "b": new_b, "first": first}.get(name)
        if want is not None:
            np.testing.assert_allclose(finals[k], want, rtol=1e-5, atol=1e-6, err_msg=name)
    # the executor agrees with the interpreter, bit for bit
    loss, rid, total = step(batch)
    np.testing.assert_allclose(loss, mean_loss, rtol=1e-5)
    for k, ref in enumerate(placed.variables):
        d = k // n_vars
        assert np.array_equal(live[ref].values[d], finals[k]), (ref.name, d)


def test_replicate_directly_on_logical_graphs():
    strategy = gd.MirroredStrategy(list(DEVICES))

    @gd.function
    def f(x):
        return strategy.run(lambda x: gd.get_replica_context().all_reduce(
            "sum", gd.reduce_sum(x * 2.0, axis=0)), args=(x,))

    batch = next(iter(strategy.experimental_distribute_dataset([np.ones((10, 2))])))
    np.testing.assert_array_equal(f(batch), [20.0, 20.0])
    g3 = f.graph            # replica 0's logical graph, shard of 3 rows
    text_before = str(g3)
    lowering = gd.ReductionToOneDevice()
    joined = replicate([g3] * 4, DEVICES)
    # one N-way node per collective: an input and an output on every device
    (node,) = [e for e in joined.eqns if e.op.name in LOGICAL_COLLECTIVES]
    assert [v.device for v in node.inputs] == [v.device for v in node.outputs] == list(DEVICES)
    placed = lower_collectives(joined, lowering)
    assert str(g3) == text_before, "replicate must not change its input"
    _assert_placed(placed, DEVICES)
    assert [v.shape for v in placed.inputs] == [(3, 2)] * 4
    outs = _interpret(placed, [np.full((3, 2), d, np.float64) for d in range(4)], [])
    for o in outs:
        np.testing.assert_array_equal(o, np.full(2, 36.0))
    two = lower_collectives(replicate([g3, g3], DEVICES[:2]), lowering)
    _assert_placed(two, DEVICES[:2])
    assert "@2" not in str(two)
    with pytest.raises(GraphError):
        replicate([g3] * 3, DEVICES)


@pytest.mark.parametrize("shape_b", [(2,), (3,)])
def test_replicate_rejects_replicas_that_captured_different_variables(shape_b):
    strategy = gd.MirroredStrategy(list(DEVICES[:2]))
    with strategy.scope():
        a = gd.Variable(np.zeros(2, np.float32), name="a")
        b = gd.Variable(np.zeros(shape_b, np.float32), name="b")
    graphs = []
    for v in (a, b):
        f = gd.function(lambda v=v: strategy.run(lambda: v.read_value() * 2.0))
        f()
        graphs.append(f.graph)
    with pytest.raises(GraphError, match="variables"):
        replicate(graphs, DEVICES[:2])


def test_replicate_rejects_replicas_that_disagree_on_collectives():
    strategy = gd.MirroredStrategy(list(DEVICES))

    def make(op):
        @gd.function
        def f(x):
            return strategy.run(lambda x: gd.get_replica_context().all_reduce(op, x * 2.0),
                                args=(x,))

        f(next(iter(strategy.experimental_distribute_dataset([np.ones((8, 2))]))))
        return f.graph

    total, mean = make("sum"), make("mean")
    with pytest.raises(GraphError, match="collective"):
        replicate([total, total, mean, total], DEVICES)

    @gd.function
    def none(x):
        return strategy.run(lambda x: x * 2.0, args=(x,))

    none(next(iter(strategy.experimental_distribute_dataset([np.ones((8, 2))]))))
    with pytest.raises(GraphError):
        replicate([total, none.graph, total, total], DEVICES)


def test_mirrored_only_step_without_run_is_replicated():
    # no strategy.run: the mirrored variables alone make the step run on every device
    strategy = gd.MirroredStrategy(list(DEVICES))
    with strategy.scope():
        v = gd.Variable(np.arange(3, dtype=np.float32), name="v")

    @gd.function
    def bump(delta):
        v.assign_add(delta)
        return v.read_value() * 2.0

    out = bump(np.ones(3, np.float32))
    np.testing.assert_array_equal(out, [2.0, 4.0, 6.0])
    placed = bump.replicated_graph
    _assert_placed(placed, DEVICES)
    assert {e.device for e in placed.eqns} == set(DEVICES)
    assert [c.tolist() for c in v.values] == [[1.0, 2.0, 3.0]] * 4


@pytest.mark.parametrize("lowering", LOWERINGS[:2])
def test_all_reduce_of_differently_shaped_shards_is_a_shape_error(lowering):
    # per-example values of uneven shards (3, 3, 2, 2 rows) cannot be all-reduced
    strategy = gd.MirroredStrategy(list(DEVICES), cross_device_ops=lowering)

    @gd.function
    def f(x):
        return strategy.run(lambda x: gd.get_replica_context().all_reduce("sum", x * 2.0),
                            args=(x,))

    batch = next(iter(strategy.experimental_distribute_dataset([np.ones((10, 2))])))
    pattern = r"all_reduce.*f64\[3,2\] on cpu:0.*f64\[2,2\] on cpu:2"
    with pytest.raises(gd.ShapeError, match=pattern):
        f(batch)
