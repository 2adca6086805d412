"""gd.nn against numpy formulas: softmax, log_softmax, the two cross entropies (values,
stability at large logits, gradients) and compute_average_loss."""

from __future__ import annotations

import numpy as np
import pytest

import graphdist as gd
from graphdist.distribute import context
from graphdist.distribute.strategy import ReplicaContext, Strategy

F64 = np.float64


def np_log_softmax(x, axis=-1):
    # log-sum-exp with the max shifted out, written independently of graphdist
    m = np.max(x, axis=axis, keepdims=True)
    return x - m - np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True))


def np_softmax(x, axis=-1):
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


def logits_cases():
    rng = np.random.default_rng(0)
    return {
        "small": rng.standard_normal((4, 5)),
        "rank3": rng.standard_normal((2, 3, 4)) * 3,
        "large": np.array([[1000.0, 0.0, -1000.0], [1000.0, 1000.0, 999.0],
                           [-1000.0, -1000.0, -1000.0]]),
        "one_class": rng.standard_normal((3, 1)),
    }


LOGITS = logits_cases()


def fd_check(loss, x, rng, eps=1e-6, rtol=1e-6):
    """<t, grad> == (loss(x + eps t) - loss(x - eps t)) / (2 eps), grad from value_and_grad."""
    value, g = gd.value_and_grad(loss)(x)
    assert g.shape == x.shape and g.dtype == x.dtype
    t = rng.standard_normal(x.shape)
    lhs = float(np.vdot(t, g))
    rhs = (float(loss(x + eps * t)) - float(loss(x - eps * t))) / (2 * eps)
    assert abs(lhs - rhs) <= rtol * max(1.0, abs(lhs), abs(rhs)), (lhs, rhs)
    return value, g


# ---------------------------------------------------------------- softmax, log_softmax


@pytest.mark.parametrize("name", sorted(LOGITS))
def test_softmax_and_log_softmax_values(name):
    x = LOGITS[name]
    for axis in (-1, 0):
        sm, lsm = gd.nn.softmax(x, axis=axis), gd.nn.log_softmax(x, axis=axis)
        assert np.all(np.isfinite(sm)) and np.all(np.isfinite(lsm))
        np.testing.assert_allclose(sm, np_softmax(x, axis), rtol=1e-12, atol=1e-300)
        np.testing.assert_allclose(lsm, np_log_softmax(x, axis), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(np.sum(sm, axis=axis), 1.0, rtol=1e-12)
    # the same numbers when compiled
    f = gd.function(lambda x: (gd.nn.softmax(x), gd.nn.log_softmax(x)))
    sm, lsm = f(x)
    np.testing.assert_allclose(sm, np_softmax(x), rtol=1e-12, atol=1e-300)
    np.testing.assert_allclose(lsm, np_log_softmax(x), rtol=1e-12, atol=1e-12)


def test_softmax_large_logits_exact():
    x = np.array([[1000.0, 0.0], [0.0, 1000.0], [1000.0, 1000.0]], np.float32)
    np.testing.assert_array_equal(gd.nn.softmax(x), [[1, 0], [0, 1], [0.5, 0.5]])
    np.testing.assert_allclose(gd.nn.log_softmax(x), [[0, -1000], [-1000, 0],
                                                      [-np.log(2), -np.log(2)]], rtol=1e-6)
    assert gd.nn.softmax(x).dtype == np.float32 == gd.nn.log_softmax(x).dtype


@pytest.mark.parametrize("name", ["small", "rank3", "large"])
@pytest.mark.parametrize("which", ["softmax", "log_softmax"])
def test_softmax_gradients(name, which):
    x = LOGITS[name]
    rng = np.random.default_rng(1)
    w = rng.standard_normal(x.shape)
    fn = getattr(gd.nn, which)
    _, g = fd_check(lambda x: gd.reduce_sum(fn(x) * w), x, rng)
    # independent closed form: J^T w for softmax, w - softmax * sum(w) for log_softmax
    s = np_softmax(x)
    want = (s * (w - np.sum(w * s, -1, keepdims=True)) if which == "softmax"
            else w - s * np.sum(w, -1, keepdims=True))
    np.testing.assert_allclose(g, want, rtol=1e-9, atol=1e-12)


# ---------------------------------------------------------------- cross entropies


def _labels(logits, rng, one_hot):
    n = logits.shape[-1]
    if one_hot:
        return np.eye(n)[rng.integers(0, n, logits.shape[:-1])]
    p = rng.random(logits.shape)
    return p / p.sum(-1, keepdims=True)


@pytest.mark.parametrize("name", sorted(LOGITS))
@pytest.mark.parametrize("one_hot", [True, False], ids=["one_hot", "probs"])
def test_softmax_cross_entropy(name, one_hot):
    x = LOGITS[name]
    rng = np.random.default_rng(2)
    y = _labels(x, rng, one_hot)
    want = -np.sum(y * np_log_softmax(x), axis=-1)
    got = gd.nn.softmax_cross_entropy(y, x)
    assert got.shape == x.shape[:-1] and np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    if name != "one_class":
        _, g = fd_check(lambda l: gd.reduce_sum(gd.nn.softmax_cross_entropy(y, l)), x, rng)
        np.testing.assert_allclose(g, np_softmax(x) - y, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", sorted(LOGITS))
@pytest.mark.parametrize("label_dtype", [np.int32, np.int64])
def test_sparse_softmax_cross_entropy(name, label_dtype):
    x = LOGITS[name]
    rng = np.random.default_rng(3)
    y = rng.integers(0, x.shape[-1], x.shape[:-1]).astype(label_dtype)
    lsm = np_log_softmax(x)
    want = -np.take_along_axis(lsm, y[..., None].astype(np.intp), -1)[..., 0]
    got = gd.nn.sparse_softmax_cross_entropy(y, x)
    assert got.shape == y.shape and got.dtype == F64 and np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    if name != "one_class":
        _, g = fd_check(lambda l: gd.reduce_sum(gd.nn.sparse_softmax_cross_entropy(y, l)),
                        x, rng)
        np.testing.assert_allclose(g, np_softmax(x) - np.eye(x.shape[-1])[y],
                                   rtol=1e-9, atol=1e-12)


def test_cross_entropy_large_logits_exact():
    x = np.array([[1000.0, 0.0], [0.0, 1000.0], [-1000.0, 1000.0]], np.float32)
    y = np.array([0, 0, 1])
    got = gd.nn.sparse_softmax_cross_entropy(y, x)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, [0.0, 1000.0, 0.0], atol=1e-6)
    np.testing.assert_allclose(gd.nn.softmax_cross_entropy(np.eye(2, dtype=np.float32)[y], x),
                               [0.0, 1000.0, 0.0], atol=1e-6)
    _, g = gd.value_and_grad(lambda l: gd.reduce_sum(gd.nn.sparse_softmax_cross_entropy(y, l)))(x)
    assert g.dtype == np.float32
    np.testing.assert_allclose(g, [[0, 0], [-1, 1], [0, 0]], atol=1e-6)   # softmax - one_hot


def test_cross_entropy_in_a_training_step_float32():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((8, 5)).astype(np.float32)
    w = rng.standard_normal((5, 3)).astype(np.float32)
    y = rng.integers(0, 3, 8)

    def loss(w):
        return gd.reduce_mean(gd.nn.sparse_softmax_cross_entropy(y, x @ w))

    value, g = gd.value_and_grad(loss)(w)
    logits = x.astype(F64) @ w
    p = np_softmax(logits)
    np.testing.assert_allclose(value, np.mean(-np_log_softmax(logits)[np.arange(8), y]),
                               rtol=1e-5)
    np.testing.assert_allclose(g, x.T @ (p - np.eye(3)[y]) / 8, rtol=1e-4, atol=1e-6)
    assert g.dtype == np.float32


@pytest.mark.parametrize("bad", [-1, 3, 7])
def test_sparse_cross_entropy_out_of_range_labels_raise_eagerly(bad):
    y = np.array([0, 2, bad, 1], np.int32)
    with pytest.raises(ValueError, match=rf"sparse_softmax_cross_entropy: expected labels in "
                                         rf"\[0, 3\).* got {bad} at index 2"):
        gd.nn.sparse_softmax_cross_entropy(y, np.zeros((4, 3), np.float32))


@pytest.mark.parametrize("mode", ["sequential", "merged"])
def test_sparse_cross_entropy_out_of_range_labels_raise_when_a_step_runs(mode):
    # the labels are data: a traced step checks them on every run, not at trace time
    f = gd.function(lambda y, x: gd.reduce_mean(gd.nn.sparse_softmax_cross_entropy(y, x)))
    x = np.zeros((4, 3), np.float32)
    np.testing.assert_allclose(f(np.array([0, 1, 2, 2], np.int32), x), np.log(3.0), rtol=1e-6)
    for bad in (-2, 3):
        with pytest.raises(ValueError, match=rf"(?s)expected labels in \[0, 3\).* got {bad} "
                                             r"at index 1.*traced at  test_nn.py:\d+  f = "):
            f(np.array([0, bad, 2, 2], np.int32), x)
    assert f.trace_count == 1
    # under a strategy, with the bad label in replica 1's shard
    strategy = gd.MirroredStrategy(["cpu:0", "cpu:1"])
    gd.config.set_device_concurrency(mode)
    try:
        @gd.function
        def step(batch):
            per = strategy.run(lambda y, x: gd.nn.sparse_softmax_cross_entropy(y, x),
                               args=batch)
            return strategy.reduce("sum", per, axis=0)

        (good,) = strategy.experimental_distribute_dataset([(np.array([0, 1, 2, 0]), x)])
        np.testing.assert_allclose(step(good), 4 * np.log(3.0), rtol=1e-6)
        (bad,) = strategy.experimental_distribute_dataset([(np.array([0, 1, 2, 9]), x)])
        with pytest.raises(ValueError, match="sparse_softmax_cross_entropy.* got 9"):
            step(bad)
    finally:
        gd.config.set_device_concurrency("auto")


def test_cross_entropy_shape_errors():
    logits = np.zeros((2, 3))
    with pytest.raises(gd.ShapeError, match="softmax_cross_entropy"):
        gd.nn.softmax_cross_entropy(np.zeros((2, 4)), logits)
    with pytest.raises(gd.ShapeError, match=r"\(1, 3\)"):
        gd.nn.softmax_cross_entropy([[1.0, 0.0, 0.0]], logits)        # a list, too
    with pytest.raises(gd.ShapeError, match="sparse_softmax_cross_entropy"):
        gd.nn.sparse_softmax_cross_entropy(np.zeros((3,), np.int32), logits)
    with pytest.raises(TypeError):
        gd.nn.sparse_softmax_cross_entropy(np.zeros(2, np.float32), logits)


# ---------------------------------------------------------------- compute_average_loss


def test_compute_average_loss_explicit_global_batch():
    per_example = np.arange(1.0, 5.0, dtype=np.float32)
    got = gd.nn.compute_average_loss(per_example, global_batch_size=8)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, 10.0 / 8, rtol=1e-7)
    f = gd.function(lambda l: gd.nn.compute_average_loss(l, global_batch_size=16))
    np.testing.assert_allclose(f(per_example), 10.0 / 16, rtol=1e-7)
    np.testing.assert_allclose(gd.nn.compute_average_loss(per_example.astype(F64), 3),
                               10.0 / 3, rtol=1e-15)


def test_compute_average_loss_default_is_the_local_batch_on_one_device():
    per_example = np.array([1.0, 2.0, 3.0, 6.0, 8.0])
    np.testing.assert_allclose(gd.nn.compute_average_loss(per_example), 4.0, rtol=1e-15)
    f = gd.function(lambda l: gd.nn.compute_average_loss(l))
    np.testing.assert_allclose(f(per_example), 4.0, rtol=1e-15)
    s = gd.OneDeviceStrategy("cpu:0")
    np.testing.assert_allclose(s.run(gd.nn.compute_average_loss, args=(per_example,)), 4.0,
                               rtol=1e-15)
    # its gradient is 1 / global batch for every example
    _, g = gd.value_and_grad(gd.nn.compute_average_loss)(per_example)
    np.testing.assert_allclose(g, np.full(5, 0.2), rtol=1e-15)


def test_compute_average_loss_default_counts_every_replica():
    """Inside a replica of a 4-replica strategy the default global batch is local x 4."""
    strategy = Strategy(["cpu:0", "cpu:1", "cpu:2", "cpu:3"])
    per_example = np.array([1.0, 2.0, 3.0])
    with context.entered(strategy, ReplicaContext(strategy, 0)):
        np.testing.assert_allclose(gd.nn.compute_average_loss(per_example), 6.0 / 12,
                                   rtol=1e-15)
        np.testing.assert_allclose(gd.nn.compute_average_loss(per_example, 4), 6.0 / 4,
                                   rtol=1e-15)
    f = gd.function(lambda l: strategy.run(gd.nn.compute_average_loss, args=(l,)))
    result = f(per_example)                     # every replica computes its own copy
    assert isinstance(result, gd.PerReplica) and len(result.values) == 4
    for value in result.values:
        np.testing.assert_allclose(value, 6.0 / 12, rtol=1e-15)


def test_compute_average_loss_on_an_empty_shard_is_zero():
    # 3 rows on 4 replicas: the last shard is empty; TF's div_no_nan gives 0 there, and the
    # replicas' sum is the full batch's sum over the inferred sizes (1 x 4 on each)
    s = gd.MirroredStrategy([f"cpu:{i}" for i in range(4)])
    with s.scope():
        w = gd.Variable(np.ones(2, np.float32), name="w")

    @gd.function
    def step(batch):
        per_replica = s.run(lambda x: gd.nn.compute_average_loss(gd.reduce_sum(x * w, axis=1)),
                            args=(batch,))
        return per_replica

    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    losses = step(next(iter(s.experimental_distribute_dataset([x]))))
    np.testing.assert_allclose([float(v) for v in losses.values],
                               [x[0].sum() / 4, x[1].sum() / 4, x[2].sum() / 4, 0.0])
