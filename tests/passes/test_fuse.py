"""fuse_optimizer: one multi-tensor update per device and dtype, same numbers as the
per-variable path, and in-place kernels that leave mirrored replicas bit-identical."""

from __future__ import annotations

import numpy as np
import pytest

import graphdist as gd
from graphdist.passes.fuse import fuse_optimizer


# about the fused all-reduce + update, which runs where collectives are inline
pytestmark = pytest.mark.usefixtures("inline_collectives")


@pytest.fixture(autouse=True)
def _restore_fused_setting():
    yield
    gd.config.set_fused_kernels(True)


def _model(strategy, opt_factory, dtypes=("float32",) * 4, seed=0):
    rng = np.random.default_rng(seed)
    shapes = [(8, 16), (16,), (16, 4), (4,)]
    with strategy.scope():
        ws = [gd.Variable(rng.standard_normal(s).astype(dt), name=f"w{i}")
              for i, (s, dt) in enumerate(zip(shapes, dtypes))]
        opt = opt_factory()

    @gd.function
    def step(batch):
        def replica_fn(x, y):
            with gd.GradientTape() as tape:
                h = gd.tanh(x @ ws[0] + ws[1])
                out = h @ ws[2] + ws[3]
                loss = gd.reduce_mean((out - y) ** 2.0)
            opt.apply_gradients(zip(tape.gradient(loss, ws), ws))
            return loss
        return strategy.reduce(gd.ReduceOp.MEAN, strategy.run(replica_fn, args=batch))

    return step, ws


OPTIMIZERS = {
    "sgd": lambda: gd.optimizers.SGD(0.1, weight_decay=0.01),
    "momentum": lambda: gd.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: gd.optimizers.Adam(0.01),
    "adamw": lambda: gd.optimizers.AdamW(0.01, weight_decay=0.1),
}


def _data(seed=1):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((32, 8)).astype(np.float32),
            rng.standard_normal((32, 4)).astype(np.float32))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fused_matches_unfused(name):
    x, y = _data()
    results = {}
    for fused in (True, False):
        gd.config.set_fused_kernels(fused)
        step, ws = _model(gd.OneDeviceStrategy("cpu:0"), OPTIMIZERS[name])
        for _ in range(4):
            step((x, y))
        ops = [e.op.name for e in step.graph.eqns]
        results[fused] = ([w.numpy() for w in ws], ops)
    assert sum("multi_update" in op for op in results[True][1]) == 1
    assert not any("multi_update" in op for op in results[False][1])
    for a, b in zip(results[True][0], results[False][0]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mode", ["sequential", "threads"])
def test_one_fused_node_per_device_and_replicas_bit_identical(mode):
    """In one program the bucket's all-reduce and every replica's update are one node
    (fuse_reduce_update), with the bits of the two apart; with a thread per device (the
    default on CPU devices) each device runs its own update."""
    strategy = gd.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2", "cpu:3"])
    x, y = _data()
    batch = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
    trained = {}
    for fused in (True, False):
        gd.config.set_device_concurrency(mode)
        gd.config.set_fused_kernels(fused)
        try:
            step, ws = _model(strategy, OPTIMIZERS["adam"])
            for _ in range(3):
                step(batch)
        finally:
            gd.config.set_device_concurrency("auto")
            gd.config.set_fused_kernels(True)
        trained[fused] = ws
        placed = step.replicated_graph
        nodes = [e for e in placed.eqns if e.op.name == "host_reduce_update"]
        updates = [e for e in placed.eqns if e.op.name == "adam_multi_update"]
        if fused and mode == "sequential":
            (node,) = nodes
            assert dict(node.params)["update"] == "adam_multi_update"
            assert {v.device for v in node.outputs} == set(strategy.devices)
            assert not updates
        elif fused:
            assert not nodes and sorted(e.device for e in updates) == list(strategy.devices)
        for w in ws:
            assert all(np.array_equal(w.values[0], c) for c in w.values[1:])
    for a, b in zip(trained[True], trained[False]):
        np.testing.assert_array_equal(a.values[0], b.values[0])


def test_many_replicas_split_the_fused_update_into_nodes_of_at_most_16_tensors():
    """8 replicas x 4 tensors: two host_reduce_update nodes of 2 tensors each (the kernels
    take tuples of up to 16 arrays), with the same bits as the all-reduce and the updates
    apart (fused kernels off)."""
    from graphdist.passes.fuse import MAX_TENSORS_PER_NODE

    strategy = gd.MirroredStrategy([f"cpu:{i}" for i in range(8)])
    x, y = _data()
    batch = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
    results = {}
    for fused in (True, False):
        gd.config.set_fused_kernels(fused)
        gd.config.set_device_concurrency("sequential")      # one program: where it fuses
        try:
            step, ws = _model(strategy, OPTIMIZERS["adam"])
            for _ in range(3):
                step(batch)
        finally:
            gd.config.set_fused_kernels(True)
            gd.config.set_device_concurrency("auto")
        nodes = [e for e in step.replicated_graph.eqns if e.op.name == "host_reduce_update"]
        results[fused] = ([w.numpy() for w in ws], nodes)
    nodes = results[True][1]
    assert len(nodes) == 2 and not results[False][1]
    assert all(dict(e.params)["n"] * 8 <= MAX_TENSORS_PER_NODE for e in nodes)
    assert sorted(o for e in nodes for o in dict(e.params)["offsets"]) == sorted(
        set(o for e in nodes for o in dict(e.params)["offsets"]))      # disjoint tensors
    for a, b in zip(results[True][0], results[False][0]):
        np.testing.assert_array_equal(a, b)


def test_dtypes_and_hyperparameters_split_groups():
    with gd.OneDeviceStrategy("cpu:0").scope():
        vs = [gd.Variable(np.ones(4, dt)) for dt in ("float32", "float32", "float64", "float64")]
        a = gd.Variable(np.ones(4, np.float32))
        b = gd.Variable(np.ones(4, np.float32))
        opt, opt1, opt2 = gd.optimizers.SGD(0.5), gd.optimizers.SGD(0.1), gd.optimizers.SGD(0.2)

    @gd.function
    def step():
        opt.apply_gradients([(np.ones(4, v.dtype), v) for v in vs])
        opt1.apply_gradients([(np.ones(4, np.float32), a)])
        opt2.apply_gradients([(np.ones(4, np.float32), b)])
        return 0

    step()
    ops = [e.op.name for e in step.graph.eqns]
    assert ops.count("sgd_multi_update") == 2          # one per dtype
    assert ops.count("sgd_update") == 2                # different learning rates: not fused
    for v in vs:
        np.testing.assert_allclose(v.numpy(), 0.5)
    np.testing.assert_allclose(a.numpy(), 0.9)
    np.testing.assert_allclose(b.numpy(), 0.8)


def test_fuse_is_pure_and_detects_fixpoint():
    gd.config.set_fused_kernels(False)
    step, _ = _model(gd.OneDeviceStrategy("cpu:0"), OPTIMIZERS["adam"])
    x, y = _data()
    step((x, y))
    g = step.graph
    fused = fuse_optimizer(g)
    assert fused is not g and len(fused) == len(g) - 3
    assert fuse_optimizer(fused) is fused
    assert sum(e.op.name == "adam_update" for e in g.eqns) == 4   # the input is untouched
    from graphdist.ir import check

    check(fused)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("devices", [1, 2])
def test_dependent_updates_of_two_steps_get_one_node_each(name, devices):
    # two apply_gradients in one function: the second step's updates read the first's
    # results, so they cannot share its node (that was a cycle); each step stays one node
    strategy = gd.MirroredStrategy([f"cpu:{i}" for i in range(devices)])
    results = {}
    for fused in (True, False):
        gd.config.set_fused_kernels(fused)
        with strategy.scope():
            ws = [gd.Variable(np.full(s, 2.0, np.float32)) for s in [(3, 2), (2,)]]
            opt = OPTIMIZERS[name]()

        def replica_fn(opt=opt, ws=ws):
            for _ in range(2):
                opt.apply_gradients([(w * 1.0, w) for w in ws])

        step = gd.function(lambda: strategy.run(replica_fn))

        step()
        g = step.graph
        results[fused] = [w.numpy() for w in ws]
        multi = [e for e in g.eqns if "multi_update" in e.op.name]
        assert len(multi) == (2 if fused else 0)
        from graphdist.ir import check

        check(g)
    for a, b in zip(results[True], results[False]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_two_sgd_steps_in_one_function():
    with gd.OneDeviceStrategy("cpu:0").scope():
        w = gd.Variable(np.ones(3, np.float32))
        opt = gd.optimizers.SGD(0.5)

    @gd.function
    def step():
        for _ in range(2):
            opt.apply_gradients([(w * 1.0, w)])

    step()
    np.testing.assert_allclose(w.numpy(), 0.25)
