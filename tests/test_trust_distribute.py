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


# ---------------------------------------------------------------- optimizers


def _mixed_float16_step(opt, **apply_kwargs):
    model = gd.nn.Dense(3)
    x = np.full((4, 5), 300.0, np.float32)        # float16 gradients of 300**2 * 4 overflow

    @gd.function
    def step(x):
        with gd.GradientTape() as tape:
            loss = gd.reduce_sum(gd.square(gd.cast(model(x), "float32")))
        grads = tape.gradient(loss, model.trainable_variables)
        return opt.apply_gradients(zip(grads, model.trainable_variables), **apply_kwargs)

    return model, step, x


@pytest.fixture
def mixed_float16():
    gd.config.set_precision("mixed_float16")
    yield
    gd.config.set_precision("float32")


def test_plain_optimizer_under_mixed_float16_raises_naming_loss_scale_optimizer(
        mixed_float16):
    opt = gd.optimizers.SGD(0.1)
    model, step, x = _mixed_float16_step(opt)
    with pytest.raises(ValueError, match=r"(?s)SGD.apply_gradients under .*mixed_float16.*"
                       r"LossScaleOptimizer\(SGD\(...\)\).*skip_loss_scale_check=True.*"
                       r"at  test_trust_distribute.py:\d+ .*opt.apply_gradients"):
        step(x)
    before = [v.numpy() for v in model.trainable_variables]
    with pytest.raises(ValueError, match="LossScaleOptimizer"):          # eagerly too
        opt.apply_gradients([(np.ones(3, np.float32), model.trainable_variables[1])])
    assert opt.iterations.numpy() == 0                                    # nothing changed
    for v, b in zip(model.trainable_variables, before):
        np.testing.assert_array_equal(v.numpy(), b)


def test_loss_scale_optimizer_skips_the_overflowed_step_under_mixed_float16(mixed_float16):
    opt = gd.optimizers.LossScaleOptimizer(gd.optimizers.SGD(0.1))
    model, step, x = _mixed_float16_step(opt)
    step(x)
    assert opt.iterations.numpy() == 0 and opt.loss_scale.numpy() == 2.0**14   # skipped
    assert all(np.all(np.isfinite(v.numpy())) for v in model.trainable_variables)


def test_the_loss_scale_check_can_be_skipped_explicitly(mixed_float16):
    opt = gd.optimizers.SGD(0.1)
    model, step, x = _mixed_float16_step(opt, skip_loss_scale_check=True)
    with np.errstate(all="ignore"):
        step(x)                                  # the user's choice: the update is applied
    assert opt.iterations.numpy() == 1
    assert not np.all(np.isfinite(model.kernel.numpy()))    # what the check protects from
    opt.apply_gradients([(np.ones(3, np.float32), model.bias)], skip_loss_scale_check=True)
    assert opt.iterations.numpy() == 2


def test_skipped_none_gradient_warns_once_per_variable(caplog):
    used = gd.Variable(np.ones(2, np.float32), name="used")
    unused = gd.Variable(np.ones(2, np.float32), name="unused_head")
    plain = gd.optimizers.SGD(0.1)
    scaled = gd.optimizers.LossScaleOptimizer(gd.optimizers.SGD(0.1))
    for opt in (plain, scaled):
        @gd.function
        def step():
            with gd.GradientTape() as tape:
                loss = gd.reduce_sum(used * 2.0)
            grads = tape.gradient(loss, [used, unused])
            assert grads[1] is None
            return opt.apply_gradients(zip(grads, [used, unused]))

        with caplog.at_level(logging.WARNING, logger="graphdist"):
            caplog.clear()
            step()
            step()
            opt.apply_gradients([(np.ones(2, np.float32), used), (None, unused)])  # eagerly
        records = [r for r in caplog.records if "do not exist" in r.getMessage()]
        assert len(records) == 1, [r.getMessage() for r in records]
        message = records[0].getMessage()
        assert f"{opt.name}.apply_gradients" in message and "'unused_head'" in message
        assert "'used'" not in message
        np.testing.assert_array_equal(unused.numpy(), [1.0, 1.0])    # skipped, not updated
    with caplog.at_level(logging.WARNING, logger="graphdist"):   # another optimizer: again
        caplog.clear()
        gd.optimizers.SGD(0.1, name="other").apply_gradients(
            [(np.ones(2, np.float32), used), (None, unused)])
    assert "other.apply_gradients" in caplog.text and "'unused_head'" in caplog.text


def test_optimizer_made_outside_the_scope_takes_an_empty_list_inside_run():
    # TF: tensorflow/python/keras/distribute/minimize_loss_test.py
    # MinimizeLossStepTest.test_empty_var_list (the optimizer made outside the scope, then
    # opt.apply_gradients([]) inside distribution.run). Keras returns a no-op for an empty
    # list: nothing is applied and the iteration count does not move.
    strategy = _strategy(3)
    opt = gd.optimizers.SGD(0.1)
    with strategy.scope():
        assert strategy.run(lambda: opt.apply_gradients([])) is None   # not readable here
    assert opt.iterations.numpy() == 0
    assert opt.apply_gradients([]) == 0 and opt.iterations.numpy() == 0          # eagerly
    assert int(gd.function(lambda: opt.apply_gradients([]))()) == 0  # on its own device
    with strategy.scope():
        inside = gd.optimizers.Adam()
    assert int(strategy.run(lambda: inside.apply_gradients([]))) == 0
    scaled = gd.optimizers.LossScaleOptimizer(gd.optimizers.SGD(0.1))
    assert strategy.run(lambda: scaled.apply_gradients([])) is None
    assert scaled.iterations.numpy() == 0
