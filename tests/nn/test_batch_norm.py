"""Tests for gd.nn.moments, gd.nn.batch_normalization and the BatchNorm layer: numpy formulas,
finite-difference gradients, synchronized statistics (one all-reduce, equal to one device on
the global batch) and per-replica sync-on-read moving statistics."""

from __future__ import annotations

import numpy as np
import pytest

import graphdist as gd

DEV4 = ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
EPS = 1e-3


def _data(shape, seed=0, dtype=np.float32):
    return (np.random.default_rng(seed).normal(size=shape) * 2 + 1).astype(dtype)


def _normalize(x, mean, var, gamma=1.0, beta=0.0, eps=EPS):
    return (x - mean) / np.sqrt(var + eps) * gamma + beta


def _one_batch(strategy, x):
    return next(iter(strategy.experimental_distribute_dataset([x])))


# ---------------------------------------------------------------- the functions


@pytest.mark.parametrize("axes,keepdims", [([0], False), ((0, 1, 2), True), (-1, False),
                                           ([1, 3], True)])
def test_moments_match_numpy_eagerly_and_traced(axes, keepdims):
    x = _data((4, 3, 5, 2), dtype=np.float64)
    ax = tuple(np.atleast_1d(axes))
    want = x.mean(ax, keepdims=keepdims), x.var(ax, keepdims=keepdims)
    for got in (gd.nn.moments(x, axes, keepdims=keepdims),
                gd.function(lambda t: gd.nn.moments(t, axes, keepdims=keepdims))(x)):
        np.testing.assert_allclose(got[0], want[0], rtol=1e-12)
        np.testing.assert_allclose(got[1], want[1], rtol=1e-12)


def test_moments_bad_axis():
    with pytest.raises(gd.ShapeError, match="moments: axis 4 is out of range for a rank-2"):
        gd.nn.moments(np.ones((2, 3), np.float32), [4])


def test_batch_normalization_matches_numpy():
    x = _data((6, 4))
    mean, var = _data((4,), 1), np.abs(_data((4,), 2))
    gamma, beta = _data((4,), 3), _data((4,), 4)
    np.testing.assert_allclose(gd.nn.batch_normalization(x, mean, var, beta, gamma, EPS),
                               _normalize(x, mean, var, gamma, beta), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gd.nn.batch_normalization(x, mean, var, None, None, 0.1),
                               _normalize(x, mean, var, eps=0.1), rtol=1e-5, atol=1e-5)
    traced = gd.function(lambda x, m, v: gd.nn.batch_normalization(x, m, v, beta, gamma, EPS))
    np.testing.assert_allclose(traced(x, mean, var), _normalize(x, mean, var, gamma, beta),
                               rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- the layer, one device


@pytest.mark.parametrize("axis", [-1, 1])
def test_batch_norm_forward_both_modes(axis):
    x = _data((8, 3, 4, 2))
    bn = gd.nn.BatchNorm(axis=axis, momentum=0.9)
    reduce_axes = tuple(a for a in range(4) if a != axis % 4)
    mean, var = x.mean(reduce_axes, keepdims=True), x.var(reduce_axes, keepdims=True)
    step = gd.function(lambda x, training: bn(x, training=training))
    np.testing.assert_allclose(step(x, True), _normalize(x, mean, var), rtol=1e-4, atol=1e-4)
    moving_mean, moving_var = 0.1 * mean.ravel(), 0.9 + 0.1 * var.ravel()
    np.testing.assert_allclose(bn.moving_mean.numpy(), moving_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(bn.moving_variance.numpy(), moving_var, rtol=1e-5)
    # inference: the moving statistics, which it leaves alone
    shape = [1, 1, 1, 1]
    shape[axis] = -1
    want = _normalize(x, moving_mean.reshape(shape), moving_var.reshape(shape))
    np.testing.assert_allclose(step(x, False), want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(bn(x), want, rtol=1e-4, atol=1e-4)       # eagerly too
    np.testing.assert_allclose(bn.moving_mean.numpy(), moving_mean, rtol=1e-5, atol=1e-6)
    assert [v.name for v in bn.trainable_variables] == [f"{bn.name}/gamma", f"{bn.name}/beta"]


def test_batch_norm_gradients_match_finite_differences():
    rng = np.random.default_rng(5)
    x, w = _data((6, 3), 1, np.float64), rng.normal(size=(6, 3))
    bn = gd.nn.BatchNorm()
    bn(x, training=True)                      # build (float64 weights for float64 inputs)
    bn.gamma.assign(rng.normal(size=3))
    bn.beta.assign(rng.normal(size=3))
    assert bn.gamma.dtype == np.float64

    @gd.function
    def grads(x):
        with gd.GradientTape() as tape:
            tape.watch(x)
            loss = gd.reduce_sum(bn(x, training=True) * w)
        return tape.gradient(loss, [x, bn.gamma, bn.beta])

    def loss(x):
        return float(np.sum(bn(x, training=True) * w))

    analytic = grads(x)
    h = 1e-6
    for k, target in enumerate([None, bn.gamma, bn.beta]):
        base = x if target is None else target.numpy()
        d = rng.normal(size=base.shape)
        if target is None:
            numeric = (loss(x + h * d) - loss(x - h * d)) / (2 * h)
        else:
            target.assign(base + h * d)
            up = loss(x)
            target.assign(base - h * d)
            numeric = (up - loss(x)) / (2 * h)
            target.assign(base)
        np.testing.assert_allclose(np.sum(analytic[k] * d), numeric, rtol=1e-6, atol=1e-8)


def test_batch_norm_errors():
    with pytest.raises(ValueError, match=r"BatchNorm 'bn_axis': axis 3 is out of range for "
                                         r"inputs of shape \(2, 3\) \(rank 2\)"):
        gd.nn.BatchNorm(axis=3, name="bn_axis")(np.ones((2, 3), np.float32))
    bn = gd.nn.BatchNorm(name="bn_c")
    bn(np.ones((2, 3), np.float32))
    with pytest.raises(gd.ShapeError, match=r"BatchNorm 'bn_c': was built for inputs of shape "
                                            r"\(2, 3\) \(axis -1 of size 3\), got shape \(2, 4\)"):
        bn(np.ones((2, 4), np.float32))
    with pytest.raises(gd.ShapeError, match=r"BatchNorm 'bn_c': expected a rank-2 input, got "
                                            r"shape \(2, 3, 3\)"):
        bn(np.ones((2, 3, 3), np.float32))


# ---------------------------------------------------------------- under a strategy


def _sync_step(strategy, bn, w):
    """One training forward + backward: outputs and dx gathered, dgamma/dbeta summed."""
    @gd.function
    def step(batch, w):
        def replica_fn(x, w):
            with gd.GradientTape() as tape:
                tape.watch(x)
                y = bn(x, training=True)
                loss = gd.reduce_sum(y * w)
            dx, dgamma, dbeta = tape.gradient(loss, [x, bn.gamma, bn.beta])
            return y, dx, dgamma, dbeta

        y, dx, dgamma, dbeta = strategy.run(replica_fn, args=(batch, w))
        return (strategy.gather(y, 0), strategy.gather(dx, 0),
                strategy.reduce("sum", dgamma), strategy.reduce("sum", dbeta))

    return step


@pytest.mark.parametrize("rows", [8, 10])        # 10 rows: uneven shards (3, 3, 2, 2)
def test_synchronized_batch_norm_equals_one_device_on_the_global_batch(rows):
    x, w = _data((rows, 3, 3, 2), 1), _data((rows, 3, 3, 2), 2)
    results = []
    for strategy in (gd.MirroredStrategy(DEV4), gd.OneDeviceStrategy("cpu:0")):
        with strategy.scope():
            bn = gd.nn.BatchNorm(synchronized=True, momentum=0.5)
            bn(x[:1])                               # build
            bn.gamma.assign(np.array([1.5, -0.5], np.float32))
        step = _sync_step(strategy, bn, w)
        results.append(step(_one_batch(strategy, x), _one_batch(strategy, w)) +
                       (bn.moving_mean.values, bn.moving_variance.values))
    (y4, dx4, dg4, db4, mm4, mv4), (y1, dx1, dg1, db1, mm1, mv1) = results
    for got, want in ((y4, y1), (dx4, dx1), (dg4, dg1), (db4, db1)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    mean, var = x.mean((0, 1, 2)), x.var((0, 1, 2))
    np.testing.assert_allclose(y1, _normalize(x, mean, var, [1.5, -0.5]), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(mm1[0], 0.5 * mean, rtol=1e-5)
    for comp_m, comp_v in zip(mm4, mv4):          # every replica moved by the global stats
        np.testing.assert_allclose(comp_m, mm1[0], rtol=1e-5)
        np.testing.assert_allclose(comp_v, mv1[0], rtol=1e-5)


def test_synchronized_statistics_are_one_all_reduce():
    strategy = gd.MirroredStrategy(DEV4)
    with strategy.scope():
        bn = gd.nn.BatchNorm(synchronized=True)

    @gd.function
    def forward(batch):
        return strategy.gather(strategy.run(lambda x: bn(x, training=True), args=(batch,)), 0)

    forward(_one_batch(strategy, _data((8, 2, 2, 3))))
    assert [e.op.name for e in forward.graph.nodes if e.op.collective].count("all_reduce") == 1
    reduces = [e for e in forward.replicated_graph.nodes
               if e.op.collective and "reduce" in e.op.name]
    assert len(reduces) == 1, [str(e.op) for e in reduces]
    assert {len(e.inputs) for e in reduces} == {4}    # one collective over the four replicas


def test_per_replica_moving_statistics():
    strategy = gd.MirroredStrategy(DEV4)
    with strategy.scope():
        bn = gd.nn.BatchNorm(momentum=0.8)

    @gd.function
    def step(batch):
        return strategy.gather(strategy.run(lambda x: bn(x, training=True), args=(batch,)), 0)

    batches = [_data((8, 3), seed) for seed in range(3)]
    for batch in batches:
        y = step(_one_batch(strategy, batch))
    mean, var = np.zeros((4, 3)), np.ones((4, 3))
    for batch in batches:                          # each replica: its own shard's statistics
        shards = batch.reshape(4, 2, 3)
        mean = 0.8 * mean + 0.2 * shards.mean(1)
        var = 0.8 * var + 0.2 * shards.var(1)
    np.testing.assert_allclose(np.stack(bn.moving_mean.values), mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.stack(bn.moving_variance.values), var, rtol=1e-5)
    np.testing.assert_allclose(bn.moving_mean.numpy(), mean.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(bn.moving_variance.numpy(), var.mean(0), rtol=1e-5)
    shards = batches[-1].reshape(4, 2, 3)         # outputs: normalized per shard
    want = _normalize(shards, shards.mean(1, keepdims=True), shards.var(1, keepdims=True))
    np.testing.assert_allclose(y, want.reshape(8, 3), rtol=1e-4, atol=1e-4)
    # and the cross-replica read inside a compiled function is the mean as well
    np.testing.assert_allclose(gd.function(lambda: bn.moving_mean.read_value())(),
                               mean.mean(0), rtol=1e-5, atol=1e-6)
