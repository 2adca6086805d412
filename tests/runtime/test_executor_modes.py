"""Both ways of running a replicated step: one sequential program (the default for logical
CPU devices) and one worker thread per device with channels between them. Same bits."""

from __future__ import annotations

import numpy as np
import pytest

import graphdist as gd
from graphdist.ops.core import OPS, Op, bind


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
