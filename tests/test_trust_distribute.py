"""Issue 21, strategies, variables and optimizers: sync-on-read variables read back exactly
what was assigned or restored on any replica count; mixed_float16 without loss scaling is
refused; skipped None gradients are reported; a PerReplica is not a number; and TF's
distribute semantics (each test cites the TF test it ports)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import graphdist as gd

Agg = gd.VariableAggregation
ON_READ = gd.VariableSynchronization.ON_READ
DEV4 = ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]


def _strategy(n: int):
    return gd.MirroredStrategy(DEV4[:n])


def _on_read(strategy, value, aggregation, name="v"):
    with strategy.scope():
        return gd.Variable(value, name=name, synchronization=ON_READ, aggregation=aggregation)


# values whose n-th part does not sum back exactly: random values, 0.1, 1/3, and signs,
# zeros, infinities and the extremes
def _hard(dtype=np.float32, size=997) -> np.ndarray:
    info = np.finfo(dtype)
    rng = np.random.default_rng(21)
    return np.concatenate([(rng.standard_normal(size) * 10).astype(dtype), np.array(
        [0.1, 1 / 3, -1 / 3, 0.0, -0.0, np.inf, -np.inf, info.max, info.tiny,
         info.smallest_subnormal], dtype)])


_HARD = _hard()


# ---------------------------------------------------------------- exact sync-on-read reads


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("aggregation", [Agg.SUM, Agg.MEAN, Agg.ONLY_FIRST_REPLICA])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_sync_on_read_reads_back_what_was_assigned(n, aggregation, dtype):
    value = _hard(dtype)
    v = _on_read(_strategy(n), np.zeros_like(value), aggregation)
    v.assign(value)                                          # eagerly
    np.testing.assert_array_equal(v.numpy(), value)
    traced_read = gd.function(lambda: v.read_value() * 1.0)
    np.testing.assert_array_equal(traced_read(), value)
    v.assign(np.zeros_like(value))
    gd.function(lambda x: v.assign(x))(value)                # in a compiled step
    np.testing.assert_array_equal(v.numpy(), value)
    np.testing.assert_array_equal(traced_read(), value)
    assert v.numpy().dtype == dtype


@pytest.mark.parametrize("aggregation", [Agg.SUM, Agg.MEAN, Agg.ONLY_FIRST_REPLICA])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_sync_on_read_restore_from_one_replica_is_exact(tmp_path, n, aggregation):
    one = gd.Variable(_HARD, name="v")
    path = gd.Checkpoint(v=one).save(tmp_path / "one.npz")
    v = _on_read(_strategy(n), np.zeros_like(_HARD), aggregation)
    gd.Checkpoint(v=v).restore(path)
    np.testing.assert_array_equal(v.numpy(), _HARD)
    np.testing.assert_array_equal(gd.function(lambda: v.read_value() * 1.0)(), _HARD)
    again = gd.Variable(np.zeros_like(_HARD), name="v")     # and back: n -> 1 replica
    gd.Checkpoint(v=again).restore(gd.Checkpoint(v=v).save(tmp_path / "n.npz"))
    np.testing.assert_array_equal(again.numpy(), _HARD)


def test_batch_norm_statistics_restore_exactly_onto_three_replicas(tmp_path):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(8, 64)).astype(np.float32)
    bn1 = gd.nn.BatchNorm()
    for _ in range(3):
        bn1(x * rng.uniform(0.5, 3.0), training=True)       # moving statistics of no
    saved = bn1.moving_mean.numpy(), bn1.moving_variance.numpy()   # simple binary form
    path = gd.Checkpoint(bn=bn1).save(tmp_path / "bn.npz")
    with _strategy(3).scope():
        bn3 = gd.nn.BatchNorm()
        bn3(x)
    gd.Checkpoint(bn=bn3).restore(path)
    for var, want in zip((bn3.moving_mean, bn3.moving_variance), saved):
        np.testing.assert_array_equal(var.numpy(), want)
        for component in var.values:
            np.testing.assert_array_equal(component, want)
    # inference in cross-replica context reads the statistics: the one-device result
    np.testing.assert_array_equal(gd.function(lambda t: bn3(t))(x), gd.function(
        lambda t: bn1(t))(x))


def test_sum_variable_semantics_hold():
    # docs/api.md "Variables": every component starts at the initial value, so a SUM
    # variable created at 1.0 on 4 replicas reads 4.0; per-replica updates add up
    strategy = _strategy(4)
    v = _on_read(strategy, 1.0, Agg.SUM)
    assert v.numpy() == 4.0
    strategy.run(lambda: v.assign_add(
        gd.cast(gd.get_replica_context().replica_id_in_sync_group, "float32") + 1.0))
    assert v.numpy() == 4.0 + (1 + 2 + 3 + 4)
    v.assign(0.1)                                # then each replica adds to its own part
    strategy.run(lambda: v.assign_add(np.float32(1.0)))
    assert v.numpy() == np.float32(np.float32(0.1) + 1 + 1 + 1 + 1)


@pytest.mark.parametrize("traced", [False, True])
def test_cross_replica_assign_add_on_sum_reads_old_total_plus_delta(traced):
    v = _on_read(_strategy(3), np.zeros_like(_HARD[:997]), Agg.SUM)
    start, delta = _HARD[:997], _HARD[:997][::-1].copy()
    v.assign(start)
    if traced:
        gd.function(lambda d: v.assign_add(d))(delta)
    else:
        v.assign_add(delta)
    np.testing.assert_array_equal(v.numpy(), start + delta)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_mean_of_differing_components_is_their_rounded_mean(dtype):
    strategy = _strategy(3)
    v = _on_read(strategy, np.zeros(997, dtype), Agg.MEAN)
    parts = [(_HARD[:997] * (k + 1) + k).astype(dtype) for k in range(3)]
    strategy.run(gd.function(lambda x: v.assign(x)), args=(gd.PerReplica(parts),))
    want = np.mean(np.array(parts, np.float64), axis=0)
    np.testing.assert_allclose(v.numpy(), want, rtol=np.finfo(dtype).eps)
    np.testing.assert_allclose(gd.function(lambda: v.read_value() * 1.0)(), want,
                               rtol=np.finfo(dtype).eps)


# ---------------------------------------------------------------- a PerReplica is no number


@pytest.mark.parametrize("convert", [float, int, bool, complex, lambda p: [0, 1, 2][p]],
                         ids=["float", "int", "bool", "complex", "index"])
def test_python_number_of_a_per_replica_says_how_to_reduce_it(convert):
    strategy = _strategy(3)
    losses = strategy.run(lambda: gd.cast(
        gd.get_replica_context().replica_id_in_sync_group, "float32"))
    assert isinstance(losses, gd.PerReplica)
    with pytest.raises(TypeError, match=r"of a PerReplica.*gd.PerReplica of 3 values.*"
                       r"strategy.reduce\(gd.ReduceOp.SUM or MEAN, value, axis=None\).*\.values"):
        convert(losses)

    @gd.function
    def step():                                   # in traced code: the same advice
        return convert(strategy.run(lambda: gd.cast(
            gd.get_replica_context().replica_id_in_sync_group, "float32")))

    with pytest.raises(TypeError, match=r"of a PerReplica.*strategy.reduce"):
        step()
    assert float(strategy.reduce(gd.ReduceOp.SUM, losses, axis=None)) == 0 + 1 + 2
