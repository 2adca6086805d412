"""Both ways of running a replicated step: one sequential program and worker threads (the
default for logical CPU devices) with channels between them, one per device or, with more
devices than cores, one per core running its share of the devices. Same bits."""

from __future__ import annotations

import numpy as np
import pytest

import graphdist as gd
from graphdist.ops.core import OPS, Op, bind
from graphdist.runtime import executable
from graphdist.runtime.executable import device_groups


@pytest.fixture(params=["sequential", "threads"])
def mode(request):
    gd.config.set_device_concurrency(request.param)
    gd.config.set_collective_timeout(10)
    yield request.param
    gd.config.set_device_concurrency("auto")
    gd.config.set_collective_timeout(60)


def _train(devices, cross_device_ops=None, steps=3):
    rng = np.random.default_rng(0)
    strategy = gd.MirroredStrategy(devices, cross_device_ops=cross_device_ops)
    with strategy.scope():
        w = gd.Variable(rng.standard_normal((64, 128)).astype(np.float32) * 0.1, name="w")
        b = gd.Variable(np.zeros(128, np.float32), name="b")
        opt = gd.optimizers.Adam(0.01)

    @gd.function
    def step(batch):
        def replica_fn(x, y):
            with gd.GradientTape() as tape:
                loss = gd.reduce_mean((gd.tanh(x @ w + b) - y) ** 2.0)
            opt.apply_gradients(zip(tape.gradient(loss, [w, b]), [w, b]))
            return loss
        return strategy.reduce("mean", strategy.run(replica_fn, args=batch))

    x = rng.standard_normal((32, 64)).astype(np.float32)
    y = rng.standard_normal((32, 128)).astype(np.float32)
    batch = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
    losses = [float(step(batch)) for _ in range(steps)]
    return step, [w, b], losses


@pytest.mark.parametrize("ops", [None, gd.RingAllReduce(), gd.ReductionToOneDevice()],
                         ids=["host", "ring", "to_one"])
def test_modes_agree_with_one_device(mode, ops):
    _, ref, ref_losses = _train(["cpu:0"])
    step, got, losses = _train(["cpu:0", "cpu:1", "cpu:2", "cpu:3"], ops)
    kind = type(step._latest().executable).__name__
    assert kind == ("SequentialExecutable" if mode == "sequential" else "MultiDeviceExecutable")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)
        assert all(np.array_equal(a.values[0], c) for c in a.values[1:])


@pytest.fixture
def fails_on_negative():
    op = Op("test_fails_on_negative")
    op.def_shape(lambda x: x)
    op.def_vjp(lambda ct, x: (ct,))

    @op.def_impl
    def _impl(xp, x):
        if x.reshape(-1)[0] < 0:
            raise ArithmeticError("negative input")
        return x

    yield lambda x: bind(op, x)
    del OPS[op.name]


def test_failure_in_one_replica_reaches_the_caller_in_both_modes(mode, fails_on_negative):
    strategy = gd.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])
    with strategy.scope():
        w = gd.Variable(np.ones(4, np.float32), name="w")
        opt = gd.optimizers.SGD(0.1)

    @gd.function
    def step(batch):
        def replica_fn(x):
            with gd.GradientTape() as tape:
                loss = gd.reduce_sum(fails_on_negative(x) * w)
            opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))
            return loss
        return strategy.reduce("sum", strategy.run(replica_fn, args=(batch,)))

    good = gd.PerReplica([np.ones(4, np.float32)] * 3)
    bad = gd.PerReplica([np.ones(4, np.float32), np.ones(4, np.float32),
                         -np.ones(4, np.float32)])
    step(good)
    before = [c.copy() for c in w.values]
    with pytest.raises(ArithmeticError) as info:
        step(bad)
    assert "cpu:2" in str(info.value) and "test_fails_on_negative" in str(info.value)
    assert all(np.array_equal(a, b) for a, b in zip(w.values, before))
    step(good)                                   # still usable
    np.testing.assert_allclose(w.numpy(), before[0] - 0.1)   # mean gradient of ones


def test_device_groups_share_the_devices_out_among_the_cores():
    assert device_groups(4, 2) == [(0, 1), (2, 3)]
    assert device_groups(3, 2) == [(0,), (1, 2)]
    assert device_groups(4, 8) == [(0,), (1,), (2,), (3,)]
    assert device_groups(4, 1) == [(0, 1, 2, 3)]
    for n in range(1, 9):
        for cores in range(1, 10):
            groups = device_groups(n, cores)
            assert len(groups) == min(n, cores)
            assert [d for g in groups for d in g] == list(range(n))    # each once, in order
            assert max(map(len, groups)) - min(map(len, groups)) <= 1


GROUPINGS = {"per device": [(0,), (1,), (2,), (3,)], "pairs": [(0, 1), (2, 3)],
             "one and three": [(0,), (1, 2, 3)], "three and one": [(0, 1, 2), (3,)],
             "all in one": [(0, 1, 2, 3)]}


@pytest.fixture
def grouped(monkeypatch):
    """Run the device threads of the steps compiled afterwards in the given groups."""
    def use(groups):
        monkeypatch.setattr(executable, "device_groups", lambda devices, cores: groups)
    gd.config.set_device_concurrency("threads")
    gd.config.set_collective_timeout(10)          # a group waiting on another fails, not hangs
    yield use
    gd.config.set_device_concurrency("auto")
    gd.config.set_collective_timeout(60)


@pytest.mark.parametrize("ops", [None, gd.RingAllReduce(), gd.ReductionToOneDevice()],
                         ids=["host", "ring", "to_one"])
@pytest.mark.parametrize("grouping", [k for k in GROUPINGS if k != "per device"])
def test_devices_grouped_on_fewer_threads_give_the_bits_of_a_thread_each(grouped, grouping,
                                                                         ops):
    """A thread running several devices runs their nodes in the placed graph's order, which
    every thread follows: no two wait for each other (a deadlock would time out), and each
    device computes what it computes on a thread of its own."""
    devices = ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
    grouped(GROUPINGS["per device"])
    _, ref, ref_losses = _train(devices, ops)
    grouped(GROUPINGS[grouping])
    step, got, losses = _train(devices, ops)
    assert step._latest().executable.groups == GROUPINGS[grouping]
    assert len(step._latest().executable.programs) == len(GROUPINGS[grouping])
    assert losses == ref_losses
    for a, b in zip(got, ref):
        assert all(np.array_equal(x, y) for x, y in zip(a.values, b.values))


@pytest.mark.parametrize("groups", [[(0,), (1, 2)], [(0, 1), (2,)], [(0, 1, 2)]],
                         ids=["failing device shares a thread", "alone", "one thread"])
def test_failure_in_a_grouped_device_names_it_and_stops_the_others(grouped, groups,
                                                                   fails_on_negative):
    grouped(groups)
    test_failure_in_one_replica_reaches_the_caller_in_both_modes("threads", fails_on_negative)
