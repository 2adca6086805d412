"""The fuse_elementwise stage (passes/fuse_elementwise.py): which clusters it finds, what it
leaves alone, the node it makes (its members as a body the views show), and programs that
give the unfused program's bits, forward and gradients, for every op family it fuses."""

from __future__ import annotations

import networkx as nx
import numpy as np
import pytest

import graphdist as gd
from graphdist import pipeline
from graphdist.ir import check
from graphdist.ops.fused import fused_elementwise_p
from graphdist.passes.fuse_elementwise import MIN_ELEMENTS, fuse_elementwise, input_kind
from graphdist.runtime import warmup

M, N = 1024, 128        # 131072 elements: MIN_ELEMENTS


@pytest.fixture(autouse=True)
def _kernels_loaded():
    yield
    warmup.wait()


def fused_nodes(g):
    return [e for e in g.eqns if e.op is fused_elementwise_p]


def run_unfused(f, *args, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(pipeline, "elementwise_fusion", lambda: [])
        return f(*args)


def inputs(dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, N)).astype(dtype)
    y = rng.standard_normal((M, N)).astype(dtype)
    b = rng.standard_normal(N).astype(dtype)
    mask = rng.random((M, N)) < 0.5
    return x, y, b, mask


def grads(forward, n_sources):
    """A step returning forward(*sources, *rest) and its gradients by the tape with respect
    to the first n_sources arguments (their sum as the loss)."""
    def step(*args):
        sources = list(args[:n_sources])
        with gd.GradientTape() as tape:
            for s in sources:
                tape.watch(s)
            out = forward(*args)
            loss = gd.reduce_sum(out * out)
        return (out, *tape.gradient(loss, sources))
    return step


# op families: (forward of x, y, b, mask; gradients taken for x and y; fused clusters at least)
FAMILIES = {
    "arithmetic": lambda x, y, b, m: (x * y - x / (y * y + 1.0)) + (-x) * 0.5,
    "unary math": lambda x, y, b, m: gd.sqrt(gd.abs(x) + 1.0) * gd.square(y) - x,
    "relu": lambda x, y, b, m: gd.relu(x * 2.0 + y) * 0.5 + y,
    "gelu erf": lambda x, y, b, m: gd.nn.gelu(x + y, approximate=False) * 2.0 - y,
    "gelu tanh": lambda x, y, b, m: gd.nn.gelu(x * 0.5 + y, approximate=True) + x,
    "where and masks": lambda x, y, b, m: gd.where(m, x, y * 0.5) + gd.where(x > 0, x, x * 0.1),
    "mask cast": lambda x, y, b, m: x * gd.cast(m, x.dtype) + y,
    "bias row": lambda x, y, b, m: gd.relu(x + b) * y,
    "bias (1, n)": lambda x, y, b, m: (x - gd.reshape(b, (1, N))) * 3.0 + y,
    "clip and extrema": lambda x, y, b, m: gd.clip_by_value(x * 2.0, -1.0, 1.0) + gd.maximum(
        x, y) - gd.minimum(x, y * 0.5),
    "residual": lambda x, y, b, m: (x + y) + (x * y + b),
    "normalize by row statistics": lambda x, y, b, m: (
        x - gd.reduce_mean(x, axis=1, keepdims=True)) / gd.sqrt(
        gd.reduce_mean(y * y, axis=1, keepdims=True) + 1.0) * b + y,
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_fused_gives_the_unfused_bits_forward_and_gradients(family, dtype,
                                                                        monkeypatch):
    forward = FAMILIES[family]
    x, y, b, mask = inputs(dtype)
    step = grads(forward, 2)
    fused, plain = gd.function(step), gd.function(step)
    got = fused(x, y, b, mask)
    want = run_unfused(plain, x, y, b, mask, monkeypatch=monkeypatch)
    assert fused_nodes(fused.replicated_graph), f"{family}: nothing fused"
    assert not fused_nodes(plain.replicated_graph)
    warmup.wait()                  # the first call ran the twin; now the kernel
    again = fused(x, y, b, mask)
    for a, w, k in zip(got, want, again):
        np.testing.assert_array_equal(a, w)
        np.testing.assert_array_equal(k, w)


def test_the_forward_value_matches_numpy():
    """An independent reference for one chain: numpy in float64, to float32 tolerance."""
    x, y, b, _ = inputs(np.float32, seed=3)
    f = gd.function(lambda x, y, b: gd.relu(x * 2.0 + b) * 0.5 - y)
    want = np.maximum(x.astype(np.float64) * 2 + b, 0) * 0.5 - y
    for _ in range(2):
        np.testing.assert_allclose(f(x, y, b), want, rtol=1e-6, atol=1e-6)
        warmup.wait()


def test_a_transcendental_ends_the_cluster_and_the_rest_still_fuses(monkeypatch):
    x, y, _, _ = inputs(np.float32)
    f = gd.function(lambda x, y: gd.exp(x * 0.5 + y) * y - 1.0)
    out = f(x, y)
    g = f.replicated_graph
    ops = [e.op.name for e in g.eqns]
    assert "exp" in ops
    members = [[m.op.name for m in dict(e.params)["body"].eqns] for e in fused_nodes(g)]
    assert sorted(map(sorted, members)) == [["add", "mul"], ["mul", "sub"]]
    np.testing.assert_array_equal(out, run_unfused(gd.function(lambda x, y: gd.exp(
        x * 0.5 + y) * y - 1.0), x, y, monkeypatch=monkeypatch))


def test_a_chain_becomes_one_node_holding_its_members_in_order():
    x, y, b, _ = inputs(np.float32)
    f = gd.function(lambda x, y, b: gd.relu((x * 2.0 + b) - y) * 0.5 + y)
    f(x, y, b)
    g = f.replicated_graph
    (node,) = fused_nodes(g)
    body = dict(node.params)["body"]
    assert [e.op.name for e in body.eqns] == ["mul", "add", "sub", "relu", "mul", "add"]
    assert [v.ty.shape for v in node.inputs] == [(M, N), (N,), (M, N)]
    assert len(node.outputs) == 1 and node.outputs[0] is g.outputs[0]
    assert len(g.eqns) == 1
    check(g)
    check(body)
    formula = dict(node.params)["formula"].text
    assert formula.startswith("t0=mul(x0,2.0:float32) t1=add(t0,x1)") and formula.endswith(
        "-> t5")
    assert f"formula={dict(node.params)['formula'].param_text()}," in str(g)


def test_a_value_read_outside_becomes_a_second_output():
    x, y, _, _ = inputs(np.float32)

    def fn(x, y):
        h = x * y + 1.0
        return gd.relu(h) - y, gd.reduce_sum(h, axis=0)

    f = gd.function(fn)
    out, total = f(x, y)
    (node,) = fused_nodes(f.replicated_graph)
    assert len(node.outputs) == 2
    h = x * y + np.float32(1)
    np.testing.assert_array_equal(out, np.maximum(h, 0) - y)
    np.testing.assert_allclose(total, h.sum(axis=0), rtol=1e-5)


def test_a_merge_that_would_make_a_cycle_is_refused():
    """t = x * y feeds a matmul whose result comes back into t's consumer: fusing t with
    that consumer would need the matmul's result before it exists."""
    x, y, _, _ = inputs(np.float32)
    w = np.eye(N, dtype=np.float32)

    def fn(x, y, w):
        t = x * y
        return (t + (t @ w)) * 2.0

    f = gd.function(fn)
    out = f(x, y, w)
    g = f.replicated_graph
    check(g)
    for node in fused_nodes(g):
        names = [e.op.name for e in dict(node.params)["body"].eqns]
        assert names == ["add", "mul"]
    t = x * y
    np.testing.assert_allclose(out, (t + t @ w) * 2, rtol=1e-6)


def test_small_values_and_unsupported_broadcasts_stay_unfused():
    small = np.ones((8, 8), np.float32)
    f = gd.function(lambda x: (x * 2.0 + 1.0) * x)
    f(small)
    assert not fused_nodes(f.replicated_graph)
    x = np.ones((4, 16, N), np.float32)
    mid = np.linspace(0, 1, 4 * N, dtype=np.float32).reshape(4, 1, N)
    g = gd.function(lambda x, c: (x + c) * 2.0)       # a middle axis: not indexed
    out = g(x, mid)
    assert not any("add" in dict(e.params)["members"] for e in fused_nodes(g.replicated_graph))
    np.testing.assert_array_equal(out, (x + mid) * np.float32(2))


def test_input_kinds():
    from graphdist.ir.types import ArrayType

    f32 = np.dtype("float32")
    assert input_kind(ArrayType((4, 5), f32), (4, 5)) == ("full", 0)
    assert input_kind(ArrayType((), f32), (4, 5)) == ("scalar", 0)
    assert input_kind(ArrayType((1, 1), f32), (4, 5)) == ("scalar", 0)
    assert input_kind(ArrayType((5,), f32), (4, 5)) == ("row", 5)
    assert input_kind(ArrayType((1, 5), f32), (4, 5)) == ("row", 5)
    assert input_kind(ArrayType((3, 5), f32), (2, 3, 5)) == ("row", 15)
    assert input_kind(ArrayType((4, 1), f32), (4, 5)) == ("col", 5)
    assert input_kind(ArrayType((2, 3, 1), f32), (2, 3, 5)) == ("col", 5)
    assert input_kind(ArrayType((3, 1), f32), (2, 3, 5)) is None       # fewer axes
    assert input_kind(ArrayType((2, 1, 5), f32), (2, 3, 5)) is None    # a middle axis
    assert input_kind(ArrayType((4, 5), np.dtype("int32")), (4, 5)) is None
    assert MIN_ELEMENTS <= M * N


def test_nothing_to_fuse_returns_the_same_graph():
    x = np.ones((M, N), np.float32)
    f = gd.function(lambda x: gd.exp(x))
    f(x)
    names = list(f.stages)
    assert names.index("fuse_elementwise") == names.index("schedule") - 1
    before = f.stages[names[names.index("fuse_elementwise") - 1]]
    assert f.stages["fuse_elementwise"] is before
    assert fuse_elementwise(before) is before


def test_nothing_fuses_across_devices_or_collectives():
    """Two replicas: each device's chain is its own node; the all-reduce stays between."""
    strategy = gd.MirroredStrategy(["cpu:0", "cpu:1"])
    rng = np.random.default_rng(1)
    with strategy.scope():
        w = gd.Variable(rng.standard_normal((N, N)).astype(np.float32) / 10)
        opt = gd.optimizers.SGD(0.1)

    @gd.function
    def step(x, y):
        def replica_fn(x, y):
            with gd.GradientTape() as tape:
                h = x @ w
                loss = gd.reduce_mean(gd.square(gd.relu(h * 2.0 + y) - y))
            grads = tape.gradient(loss, [w])
            opt.apply_gradients(zip(grads, [w]))
            return loss
        return strategy.reduce("mean", strategy.run(replica_fn, args=(x, y)))

    x = rng.standard_normal((2 * M, N)).astype(np.float32)
    y = rng.standard_normal((2 * M, N)).astype(np.float32)
    batch = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
    step(*batch)
    g = step.replicated_graph
    nodes = fused_nodes(g)
    assert {e.device for e in nodes} == {"cpu:0", "cpu:1"}
    for e in nodes:
        body = dict(e.params)["body"]
        assert not any(m.op.collective for m in body.eqns)
        assert {m.device for m in body.eqns} == {e.device}
        assert {v.device for v in e.inputs} == {e.device}


def test_the_views_show_the_members(tmp_path):
    x, y, b, _ = inputs(np.float32)
    f = gd.function(lambda x, y, b: gd.relu(x + b) * y)
    f(x, y, b)
    g = f.replicated_graph
    text = str(g)
    assert "fused_elementwise" in text and "body(" in text
    assert "relu" in text.split("body(")[1]
    g.to_html(tmp_path / "g.html")
    page = (tmp_path / "g.html").read_text()
    assert "fused_elementwise" in page and "relu" in page
    assert "fused_elementwise#0/body" in page          # the members' group in the viewer
    graph = g.to_networkx()
    ops = {d.get("op") for _, d in graph.nodes(data=True)}
    assert {"fused_elementwise", "add", "relu", "mul"} <= ops
    assert nx.is_directed_acyclic_graph(graph)
    assert "fused_elementwise x1: add + relu + mul" in g.summary()


def test_stages_and_cli_show_the_stage(capsys):
    from graphdist.cli import main

    assert main(["show", "graphdist.examples.mlp_digits:traced_step", "--stages"]) == 0
    out = capsys.readouterr().out
    assert "==== after fuse_elementwise:" in out
    assert out.index("==== after fuse_elementwise:") < out.index("==== after schedule:")


def test_fused_kernels_off_runs_no_stage():
    gd.config.set_fused_kernels(False)
    try:
        f = gd.function(lambda x: (x * 2.0 + 1.0) * x)
        f(np.ones((M, N), np.float32))
        assert "fuse_elementwise" not in f.stages
    finally:
        gd.config.set_fused_kernels(True)


def _train(make, batch, fused: bool, monkeypatch) -> tuple:
    """Losses of three steps and the variables after them, from the same start."""
    with monkeypatch.context() as m:
        if not fused:
            m.setattr(pipeline, "elementwise_fusion", lambda: [])
        step, variables = make()
        losses = [float(step(batch))]
    warmup.wait()
    losses += [float(step(batch)) for _ in range(2)]
    nodes = fused_nodes(step.replicated_graph)
    return losses, [v.numpy() for v in variables], nodes


@pytest.mark.parametrize("model", ["mlp", "gpt2"])
def test_a_training_step_on_two_replicas_gives_the_unfused_bits(model, monkeypatch):
    """The benchmark MLP and the GPT-2-style step (tanh GELU, additive mask; bench/models.py)
    on 2 replicas with Adam: three steps fused and unfused, the same losses and variables
    bit for bit (every fused kernel is exact)."""
    from bench.models import make_gpt2_step, make_step
    from bench.peers.common import data
    from bench.peers.gpt_common import gpt2_data

    strategy = gd.MirroredStrategy(["cpu:0", "cpu:1"])
    if model == "mlp":
        x, y = data()
        batch = (x[:256], y[:256])
        make = lambda: make_step(strategy)          # noqa: E731
    else:
        ids, targets = gpt2_data()
        batch = (ids[:32], targets[:32])        # 16 a replica: values of 131K elements
        make = lambda: make_gpt2_step(strategy)     # noqa: E731
    batch = next(iter(strategy.experimental_distribute_dataset([batch])))
    fused_losses, fused_vars, nodes = _train(make, batch, True, monkeypatch)
    losses, variables, none = _train(make, batch, False, monkeypatch)
    assert not none
    if model == "gpt2":
        assert {e.device for e in nodes} == {"cpu:0", "cpu:1"}
    assert fused_losses == losses
    for a, b in zip(fused_vars, variables):
        np.testing.assert_array_equal(a, b)


def test_a_variable_updated_by_a_chain_and_a_cond_beside_it(monkeypatch):
    """A chain whose result is a variable's next state (written back to its storage), next
    to a cond: the cond stays a node of its own, each branch fused on its own
    (tests/passes/test_fusion_in_bodies.py)."""
    def make():
        v = gd.Variable(np.linspace(-1, 1, M * N, dtype=np.float32).reshape(M, N))

        @gd.function
        def step(x, flag):
            v.assign(v * 0.9 + x * 0.1)
            return gd.cond(flag, lambda: v * 2.0 + x, lambda: v - x)

        return step, v

    x, _, _, _ = inputs(np.float32, seed=5)
    results = {}
    for fused in (True, False):
        with monkeypatch.context() as m:
            if not fused:
                m.setattr(pipeline, "elementwise_fusion", lambda: [])
            step, v = make()
            outs = [step(x, np.bool_(k % 2 == 0)) for k in range(3)]
        warmup.wait()
        outs.append(step(x, np.bool_(True)))
        results[fused] = (outs, v.numpy(), step.replicated_graph)
    for a, b in zip(results[True][0], results[False][0]):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(results[True][1], results[False][1])
    g = results[True][2]
    (node,) = fused_nodes(g)
    assert dict(node.params)["members"] == ("mul", "mul", "add")
    (cond,) = [e for e in g.eqns if e.op.name == "cond"]
    true_branch, false_branch = dict(cond.params)["branches"]
    assert [dict(e.params)["members"] for e in fused_nodes(true_branch)] == [("mul", "add")]
    assert not fused_nodes(false_branch)                  # v - x: one op


def test_merged_replicas_fuse_too():
    strategy = gd.MirroredStrategy(["cpu:0", "cpu:1"])
    rng = np.random.default_rng(2)
    with strategy.scope():
        w = gd.Variable(rng.standard_normal((N, N)).astype(np.float32) / 10)
        opt = gd.optimizers.SGD(0.1)

    def make():
        @gd.function
        def step(x, y):
            def replica_fn(x, y):
                with gd.GradientTape() as tape:
                    loss = gd.reduce_mean(gd.square(gd.relu(x @ w * 2.0 + y) - y))
                opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))
                return loss
            return strategy.reduce("mean", strategy.run(replica_fn, args=(x, y)))
        return step

    x = rng.standard_normal((2 * M, N)).astype(np.float32)
    y = rng.standard_normal((2 * M, N)).astype(np.float32)
    batch = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
    gd.config.set_device_concurrency("merged")
    try:
        step = make()
        step(*batch)
    finally:
        gd.config.set_device_concurrency("auto")
    g = step.replicated_graph
    assert g.merged and fused_nodes(g)
    assert "fuse_elementwise" in step.stages


def test_casts_between_floats_fuse_with_their_neighbours(monkeypatch):
    x, y, _, _ = inputs(np.float32, seed=6)
    x64 = x.astype(np.float64) * 3.0

    def fn(x64, y):
        narrow = gd.cast(x64 * 2.0 + 1.0, "float32")
        return narrow * y, gd.cast(y + 0.5, "float64") - x64

    f = gd.function(fn)
    got = f(x64, y)
    members = sorted(dict(e.params)["members"] for e in fused_nodes(f.replicated_graph))
    assert ("mul", "add", "cast", "mul") in members
    want = run_unfused(gd.function(fn), x64, y, monkeypatch=monkeypatch)
    for a, w in zip(got, want):
        np.testing.assert_array_equal(a, w)
    np.testing.assert_array_equal(got[0], (x64 * 2 + 1).astype(np.float32) * y)


def test_a_cluster_that_saves_too_few_bytes_stays_unfused():
    """t = x * y and -t, both returned: fused it would move 4 arrays' bytes of the members'
    5, above MAX_TRAFFIC; t + x returned alone moves 3 of 6 and fuses."""
    from graphdist.passes.fuse_elementwise import MAX_TRAFFIC

    x, y, _, _ = inputs(np.float32)
    both = gd.function(lambda x, y: (x * y, -(x * y)))
    both(x, y)
    assert 4 / 5 > MAX_TRAFFIC and not fused_nodes(both.replicated_graph)
    one = gd.function(lambda x, y: x * y + x)
    np.testing.assert_array_equal(one(x, y), x * y + x)
    assert 3 / 6 <= MAX_TRAFFIC and fused_nodes(one.replicated_graph)


def test_a_long_chain_becomes_nodes_of_at_most_max_members():
    from graphdist.passes.fuse_elementwise import MAX_MEMBERS

    def fn(x, y):
        for _ in range(40):
            x = x * 0.999 + y
        return x

    x, y, _, _ = inputs(np.float32, seed=8)
    f = gd.function(fn)
    got = f(x, y)
    sizes = [len(dict(e.params)["members"]) for e in fused_nodes(f.replicated_graph)]
    assert sum(sizes) == 80 and max(sizes) <= MAX_MEMBERS and len(sizes) == -(-80 // MAX_MEMBERS)
    want = x
    for _ in range(40):
        want = want * np.float32(0.999) + y
    np.testing.assert_array_equal(got, want)


def test_two_clusters_that_would_wait_on_each_other_are_not_both_made():
    """a1 -> a2 -> a3 on cpu:0 and c1 -> c2 -> c3 on cpu:1, each reading the other's first value
    through a copy: fused both ways, A's node would need C's and C's A's. The second
    merge (c1 with c2) is refused, seeing the first cluster as the one node it becomes (the
    hierarchical all-reduce lowering built such a graph)."""
    from graphdist.ir import Eqn, Graph, Lit, Var, evaluate
    from graphdist.ir.types import ArrayType
    from graphdist.ops.collectives import copy_p
    from graphdist.ops.math import add_p, mul_p

    ty = ArrayType((M, N), np.dtype("float32"))
    two = Lit(np.float32(2.0), ArrayType((), np.dtype("float32")))
    x0, y1 = Var(ty, "x", "cpu:0"), Var(ty, "y", "cpu:1")
    a1, c1, a2, c2, a3, c3 = (Var(ty, n, d) for n, d in (
        ("a1", "cpu:0"), ("c1", "cpu:1"), ("a2", "cpu:0"), ("c2", "cpu:1"), ("a3", "cpu:0"),
        ("c3", "cpu:1")))
    to1, to0 = Var(ty, "to1", "cpu:1"), Var(ty, "to0", "cpu:0")
    eqns = (Eqn(mul_p, (x0, two), (a1,), device="cpu:0"),
            Eqn(mul_p, (y1, two), (c1,), device="cpu:1"),
            Eqn(copy_p, (a1,), (to1,), (("device", "cpu:1"),), device="cpu:1"),
            Eqn(copy_p, (c1,), (to0,), (("device", "cpu:0"),), device="cpu:0"),
            Eqn(add_p, (a1, to0), (a2,), device="cpu:0"),
            Eqn(add_p, (c1, to1), (c2,), device="cpu:1"),
            Eqn(mul_p, (a2, two), (a3,), device="cpu:0"),
            Eqn(mul_p, (c2, two), (c3,), device="cpu:1"))
    g = check(Graph((x0, y1), eqns, (a3, c3), devices=("cpu:0", "cpu:1")))
    fused = check(fuse_elementwise(g))
    members = sorted(dict(e.params)["members"] for e in fused_nodes(fused))
    assert members == [("add", "mul"), ("mul", "add", "mul")]     # c1 stays out
    x, y = inputs(np.float32)[:2]
    for a, b in zip(evaluate(fused, x, y), evaluate(g, x, y)):
        np.testing.assert_array_equal(a, b)

