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


_WORKER = """
import json, sys
import numpy as np
import graphdist as gd
strategy = gd.MultiWorkerMirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])
rng, report = np.random.default_rng(5), {}          # the same values on every worker
for dtype in ("float32", "float64"):
    x = (rng.standard_normal(500) * 10).astype(dtype)
    for aggregation in ("sum", "mean"):
        with strategy.scope():
            v = gd.Variable(np.zeros_like(x), synchronization="on_read",
                            aggregation=aggregation)
        v.assign(x)
        traced = np.asarray(gd.function(lambda: v.read_value() * 1.0)())
        report[dtype + "_" + aggregation] = [int(np.sum(v.numpy() != x)),
                                             int(np.sum(traced != x))]
with open(sys.argv[1] + "/rank%d.json" % strategy.worker_index, "w") as f:
    json.dump(report, f)
"""


def test_sync_on_read_reads_are_exact_across_workers(tmp_path):
    # 2 workers of 3 devices: the eager read sums across workers, the traced one lowers to
    # MPI; 6 replicas holding x each sum to 6x inexactly in float32 and float64
    import importlib.util
    import json
    import os
    import shutil
    import subprocess
    import sys

    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    mpiexec = mpiexec if os.path.exists(mpiexec) else shutil.which("mpiexec")
    if importlib.util.find_spec("mpi4py") is None or mpiexec is None:
        pytest.skip("the mpi extra (mpi4py and mpich) is not installed")
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    done = subprocess.run([mpiexec, "-n", "2", sys.executable, str(script), str(tmp_path)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report == {f"{d}_{a}": [0, 0] for d in ("float32", "float64")
                          for a in ("sum", "mean")}, (rank, report)


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


# ---------------------------------------------------------------- TF semantics left over


def _assert_in_default_state():
    # TF: distribute_lib_test.py _assert_in_default_state
    default = gd.get_strategy()
    assert gd.get_replica_context() is default.default_replica_context
    assert not gd.in_cross_replica_context() and not gd.has_strategy()


def test_scope_can_be_nested_in_itself_and_reused_after_exit():
    # TF: tensorflow/python/distribute/distribute_lib_test.py
    # TestStrategyTest.testSameScopeNesting
    _assert_in_default_state()
    dist = _strategy(2)
    scope_a = dist.scope()
    with scope_a:
        assert gd.get_strategy() is dist
        scope_b = dist.scope()
        with scope_b:
            assert gd.get_strategy() is dist
            with scope_a:                        # a scope object inside itself
                assert gd.get_strategy() is dist and gd.in_cross_replica_context()
            assert gd.get_strategy() is dist
        assert gd.get_strategy() is dist
        dist2 = _strategy(2)
        with pytest.raises(RuntimeError, match="Mixing different gd.distribute strategies"):
            with dist2.scope():
                pass
        assert gd.get_strategy() is dist         # the failed enter left nothing behind
    _assert_in_default_state()
    with scope_b:                                # reused after its exit
        assert gd.get_strategy() is dist
        with dist.scope() as entered:
            assert entered is dist
    _assert_in_default_state()


def test_one_strategys_reduce_and_variables_inside_another_strategys_scope_raise():
    # TF: distribute_lib_test.py _run_in_and_out_of_scope / testReduce (reduce under
    # another strategy's scope: "Mixing different .*Strategy objects"), and values.py's
    # DistributedVariable, whose reads and writes call enter_or_assert_strategy
    dist, other = _strategy(2), _strategy(2)
    with dist.scope():
        v = gd.Variable(np.float32(1.0), name="w")
    values = dist.experimental_distribute_values_from_function(
        lambda ctx: np.float32(ctx.replica_id_in_sync_group + 1))
    assert float(dist.reduce(gd.ReduceOp.SUM, values, axis=None)) == 3.0   # out of scope
    with dist.scope():
        assert float(dist.reduce(gd.ReduceOp.MEAN, values, axis=None)) == 1.5
        v.assign(2.0)
        assert v.numpy() == 2.0
    mixing = r"Mixing different gd.distribute strategies: {} .* used inside the scope or run " \
             r"of another strategy object.*\n  at  test_trust_distribute.py:\d+"
    with other.scope():
        for use in (lambda: dist.reduce(gd.ReduceOp.SUM, values, axis=None),
                    lambda: dist.gather(values, axis=0)):
            with pytest.raises(RuntimeError, match=mixing.format("strategy.(reduce|gather)")):
                use()
        for use in (v.numpy, v.read_value, lambda: v.assign(3.0), lambda: v.assign_add(1.0),
                    lambda: gd.function(lambda: v * 2.0)(),
                    lambda: gd.function(lambda: v.assign_sub(1.0))()):
            with pytest.raises(RuntimeError, match=mixing.format("variable 'w'")):
                use()
        assert "numpy=array(2." in repr(v)             # printing it is no use of it
    with pytest.raises(RuntimeError, match=mixing.format("variable 'w'")):
        other.run(lambda: v * 2.0)                       # in another strategy's run
    assert v.numpy() == 2.0                              # nothing was written
    plain = gd.Variable(np.float32(5.0))                 # the default strategy's: usable
    with other.scope():
        assert plain.numpy() == 5.0


def test_default_strategy_scope_keeps_the_default_replica_context():
    # TF: distribute_lib_test.py DefaultDistributionStrategyTest.testScopeMostlyNoOp (its
    # variable-creator part, a TF-internal detail, is not ported)
    _assert_in_default_state()
    default = gd.get_strategy()
    scope = default.scope()
    with scope:
        _assert_in_default_state()
        assert gd.get_replica_context() is not None
        with scope:
            _assert_in_default_state()
        _assert_in_default_state()
        with _strategy(2).scope():                 # a strategy's scope inside it is fine
            assert gd.has_strategy()
            assert gd.Variable(1.0, name="inner").name == "inner"
    _assert_in_default_state()


def test_default_replica_contexts_merge_fn_has_no_strategy():
    # TF: distribute_lib_test.py DefaultDistributionStrategyTest.testMergeCall
    _assert_in_default_state()
    default = gd.get_strategy()

    def merge_fn(dist, s):
        assert dist is default and gd.get_strategy() is default
        assert gd.get_replica_context() is None and gd.in_cross_replica_context()
        assert not gd.has_strategy()
        return "foo_" + s

    replica_ctx = gd.get_replica_context()
    assert replica_ctx is default.default_replica_context
    assert replica_ctx.merge_call(merge_fn, args=("bar",)) == "foo_bar"
    with default.scope():                        # the same inside the default scope
        assert gd.get_replica_context().merge_call(merge_fn, args=("baz",)) == "foo_baz"
    _assert_in_default_state()


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("traced", [False, True])
def test_reduce_mean_of_integers_divides_as_tf(dtype, traced):
    # TF: cross_device_ops.py _simple_reduce and the all-reduces divide the replicas' sum
    # with `value / n` (cross_device_utils.divide_by_n_tensors_or_indexed_slices), and
    # Strategy.reduce(axis=k) with math_ops.truediv: a true division, int32 and int64 into
    # float64 (TF's _TRUEDIV_TABLE), not tf.reduce_mean's truncation
    strategy = _strategy(3)
    values = gd.PerReplica([np.array([-7, 5, 2], dtype), np.array([2, 0, 2], dtype),
                            np.array([0, 1, 2], dtype)])
    reduce = (gd.function(lambda op, v, axis: strategy.reduce(op, v, axis=axis))
              if traced else lambda op, v, axis: strategy.reduce(op, v, axis=axis))
    stacked = np.array(values.values, np.int64)
    for axis, want in ((None, stacked.sum(0) / 3.0), (0, stacked.sum() / stacked.size)):
        got = np.asarray(reduce(gd.ReduceOp.MEAN, values, axis))
        assert got.dtype == np.float64
        np.testing.assert_array_equal(got, want)          # [-5/3, 2, 2], 7/9: not truncated
        total = np.asarray(reduce(gd.ReduceOp.SUM, values, axis))
        assert total.dtype == dtype                        # SUM keeps the integer dtype
        np.testing.assert_array_equal(total, stacked.sum(0) if axis is None else stacked.sum())


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_replica_context_all_reduce_mean_of_integers_divides_as_reduce_does(dtype):
    # the same division as strategy.reduce above (TF's cross-device ops divide_by_n): it
    # raised TypeError inside a replica while strategy.reduce divided
    strategy = _strategy(3)
    values = gd.PerReplica([np.array([-7, 5, 2], dtype), np.array([2, 0, 2], dtype),
                            np.array([0, 1, 2], dtype)])
    ctx = lambda: gd.get_replica_context()                              # noqa: E731
    step = gd.function(lambda v: strategy.run(lambda x: (
        ctx().all_reduce(gd.ReduceOp.MEAN, x), ctx().all_reduce(gd.ReduceOp.MEAN, 3),
        ctx().all_reduce(gd.ReduceOp.SUM, x)), args=(v,)))
    means, constant, sums = (v.values if isinstance(v, gd.PerReplica) else (v,) * 3
                             for v in step(values))                 # mirrored: one value
    want = np.array(values.values, np.int64).sum(0) / 3.0
    for k in range(3):
        assert np.asarray(means[k]).dtype == np.float64
        np.testing.assert_array_equal(means[k], want)     # [-5/3, 2, 2]: not truncated
        np.testing.assert_array_equal(sums[k], np.array(values.values).sum(0))
        assert np.asarray(constant[k]).dtype == np.float64 and float(constant[k]) == 3.0
    np.testing.assert_array_equal(strategy.reduce(gd.ReduceOp.MEAN, values, axis=None), want)


def test_unnamed_variable_is_named_variable():
    # TF: tensorflow/python/distribute/mirrored_variable_test.py
    # MirroredVariableCreationTest.testUnnamedVariable ("Variable:0"; graphdist has no ":0")
    strategy = _strategy(2)
    with strategy.scope():
        v = gd.Variable(1.0)
        w = gd.Variable(np.ones(2, np.float32))
    assert v.name == "Variable" and w.name == "Variable"
    assert [float(c) for c in v.values] == [1.0, 1.0]
    assert gd.Variable(1.0).name == "Variable"            # outside any scope too
    with strategy.scope():
        opt = gd.optimizers.Adam(0.1)
    opt.apply_gradients([(np.float32(1.0), v), (np.ones(2, np.float32), w)])
    slots = opt.slots()                                   # same names hide no slot
    assert sorted(slots) == ["Variable/m", "Variable/v", "Variable_1/m", "Variable_1/v"]
    assert slots["Variable/m"].shape == () and slots["Variable_1/m"].shape == (2,)


def test_gather_of_shards_of_different_sizes_inside_a_function():
    # TF: tensorflow/python/distribute/strategy_gather_test.py
    # GatherTest.testGatherDiffShapeAtAxis0 (values made per replica, captured by the
    # tf.function) and testGatherDiffShapeAtAxis1
    strategy = _strategy(3)
    captured = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.ones((ctx.replica_id_in_sync_group + 1, 1), np.int32))
    np.testing.assert_array_equal(gd.function(lambda: strategy.gather(captured, axis=0))(),
                                  np.ones((1 + 2 + 3, 1), np.int32))
    wide = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.ones((1, ctx.replica_id_in_sync_group + 1), np.int32))
    np.testing.assert_array_equal(gd.function(lambda: strategy.gather(wide, axis=1))(),
                                  np.ones((1, 6), np.int32))
    # shards of 3, 3 and 2 rows, as arguments and as what the replicas return
    x = np.arange(16, dtype=np.float32).reshape(8, 2)
    shards = next(iter(strategy.experimental_distribute_dataset([x])))
    assert [np.shape(s) for s in shards.values] == [(3, 2), (3, 2), (2, 2)]

    @gd.function
    def gathered(batch):
        doubled = strategy.run(lambda t: t * 2.0, args=(batch,))
        return strategy.gather(batch, axis=0), strategy.gather(doubled, axis=0)

    got, doubled = gathered(shards)
    np.testing.assert_array_equal(got, x)
    np.testing.assert_array_equal(doubled, x * 2.0)
