"""Ports of TF's tests of replica and cross-replica contexts, ReplicaContext.all_reduce,
merge_call and the exceptions raised inside them (strategy_common_test.py,
strategy_test_lib.py, distribute_lib_test.py, mirrored_strategy_test.py)."""

from __future__ import annotations

import numpy as np
import pytest
from tf_helpers import local_results as _local

import graphdist as gd

SUM, MEAN = gd.ReduceOp.SUM, gd.ReduceOp.MEAN


def _rid_f32():
    return gd.cast(gd.get_replica_context().replica_id_in_sync_group, "float32")


def _per_replica(strategy, values):
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: values[ctx.replica_id_in_sync_group])



# ---------------------------------------------------------------- all_reduce


@pytest.mark.parametrize("value", [1.0, np.float32(1.0)], ids=["python", "numpy"])
def test_all_reduce_dense_constant(strategy, tf_function, value):
    # TF: strategy_common_test.py AllReduceTest.testDense (array_ops.identity(1.0)) and
    # ReplicaCtxAllReduceTest.testDense; a constant holds 1.0 on every replica, so SUM is n.
    @tf_function
    def fn():
        return strategy.run(lambda: gd.get_replica_context().all_reduce(SUM, value))

    got = _local(fn(), 2)
    np.testing.assert_allclose(got, [2.0, 2.0])


def test_all_reduce_dense_tensor(strategy, tf_function):
    # TF: strategy_common_test.py AllReduceTest.testDense, with a computed tensor of 1.0
    @tf_function
    def fn():
        return strategy.run(
            lambda: gd.get_replica_context().all_reduce(SUM, _rid_f32() * 0.0 + 1.0))

    np.testing.assert_allclose(_local(fn(), 2), [2.0, 2.0])


def test_all_reduce_nested_input(strategy, tf_function):
    # TF: strategy_common_test.py AllReduceTest.testNestedInput (dense leaves)
    @tf_function
    def fn():
        def replica_fn():
            one = _rid_f32() * 0.0 + 1.0
            return gd.get_replica_context().all_reduce(SUM, (one, one * 2.0))
        return strategy.run(replica_fn)

    a, b = fn()
    np.testing.assert_allclose(_local(a, 2), [2.0, 2.0])
    np.testing.assert_allclose(_local(b, 2), [4.0, 4.0])


def test_all_reduce_sync_on_read_variable_input(strategy, tf_function):
    # TF: strategy_common_test.py ReplicaCtxAllReduceTest.testSyncOnReadVariableInput
    with strategy.scope():
        var = gd.Variable(0.0, synchronization=gd.VariableSynchronization.ON_READ,
                          aggregation=gd.VariableAggregation.ONLY_FIRST_REPLICA)

    def replica_fn():
        ctx = gd.get_replica_context()
        var.assign(_rid_f32() * 3.0)
        return ctx.all_reduce(SUM, var)

    result = strategy.run(tf_function(replica_fn))
    np.testing.assert_allclose(_local(result, 2), [3.0, 3.0])   # sum(range(2)) * 3


def test_all_reduce_of_mirrored_variable_plus_replica_id(strategy, tf_function):
    # TF: vars_test.py OnReadVariableSyncTest.testAllReduce (ON_WRITE MEAN variable of 2.0)
    with strategy.scope():
        v = gd.Variable(2.0, synchronization=gd.VariableSynchronization.ON_WRITE,
                        aggregation=gd.VariableAggregation.MEAN)

    def all_reduce():
        return gd.get_replica_context().all_reduce("SUM", v) + _rid_f32()

    result = strategy.run(tf_function(all_reduce))
    np.testing.assert_allclose(_local(result, 2), [4.0, 5.0])


@pytest.mark.parametrize("op, expected", [(SUM, (4.0, [42.0, 43.0])),
                                          (MEAN, (2.0, [21.0, 21.5]))])
def test_all_reduce_two_devices(strategy, tf_function, op, expected):
    # TF: strategy_test_lib.py TwoDeviceDistributionTestBase._test_all_reduce_sum and
    # _test_all_reduce_mean (mirrored_strategy_test.py testAllReduceSum, testAllReduceMean)
    inputs = ([np.float32(1.0), np.float32(3.0)],
              [np.array([39.0, 2.0], np.float32), np.array([3.0, 41.0], np.float32)])
    a = _per_replica(strategy, inputs[0])
    b = _per_replica(strategy, inputs[1])

    def comm_fn(x, y):
        ctx = gd.get_replica_context()
        return ctx.all_reduce(op, x), ctx.all_reduce(op, y)

    run = tf_function(lambda x, y: strategy.run(comm_fn, args=(x, y)))
    out0, out1 = run(a, b)
    np.testing.assert_allclose(_local(out0, 2), [expected[0]] * 2)
    np.testing.assert_allclose(np.stack(_local(out1, 2)), [expected[1]] * 2)


@pytest.mark.parametrize("op, expected_grads", [(SUM, 4.0), (MEAN, 2.0)])
def test_all_reduce_gradient_tape(strategy, op, expected_grads):
    # TF: strategy_test_lib.py TwoDeviceDistributionTestBase._test_all_reduce_sum_gradient_tape
    # and _test_all_reduce_mean_gradient_tape: d(all_reduce(x) * c_i)/dx summed over replicas
    c = _per_replica(strategy, [np.float32(1.0), np.float32(3.0)])

    def step(c, x):
        with gd.GradientTape() as tape:
            tape.watch(x)
            y = gd.get_replica_context().all_reduce(op, x) * c
        return tape.gradient(y, x)

    grads = strategy.run(step, args=(c, np.float32(42.0)))
    np.testing.assert_allclose(_local(grads, 2), [expected_grads] * 2)


@pytest.mark.parametrize("op", [SUM, MEAN])
def test_all_reduce_one_device(op):
    # TF: strategy_test_lib.py OneDeviceDistributionTestBase._test_all_reduce_sum / _mean and
    # _test_all_reduce_sum_gradient_tape (one_device_strategy_test.py): identity on one replica
    strategy = gd.OneDeviceStrategy("cpu:0")

    def comm_fn(x, y):
        ctx = gd.get_replica_context()
        with gd.GradientTape() as tape:
            tape.watch(x)
            r = ctx.all_reduce(op, x)
            target = r * 4.0
        return r, ctx.all_reduce(op, y), tape.gradient(target, x)

    x, y, g = strategy.run(comm_fn, args=(np.float32(4.0), np.array([42.0, 43.0], np.float32)))
    np.testing.assert_allclose(x, 4.0)
    np.testing.assert_allclose(y, [42.0, 43.0])
    np.testing.assert_allclose(g, 4.0)


# ---------------------------------------------------------------- run


def test_run_two_devices(strategy, tf_function):
    # TF: strategy_test_lib.py TwoDeviceDistributionTestBase._test_run (both run_in_function)
    out1 = strategy.run(tf_function(
        lambda: gd.get_replica_context().replica_id_in_sync_group + 1))
    assert [int(v) for v in out1.values] == [1, 2]
    out2 = strategy.run(tf_function(lambda x: {"a": x * 2, "b": x * x}), args=(out1,))
    assert [int(v) for v in out2["a"].values] == [2, 4]
    assert [int(v) for v in out2["b"].values] == [1, 4]
    out3 = strategy.run(tf_function(lambda b, a: a + 2 * b + 2), kwargs=out2)
    assert [int(v) for v in out3.values] == [6, 14]


def test_run_one_device():
    # TF: strategy_test_lib.py OneDeviceDistributionTestBase._test_run
    strategy = gd.OneDeviceStrategy("cpu:0")
    out1 = strategy.run(lambda: np.float32(4.0) + 0.0)
    np.testing.assert_allclose(out1, 4.0)
    out2 = strategy.run(lambda x: {"a": x * 2, "b": x * x}, args=(out1,))
    np.testing.assert_allclose([out2["a"], out2["b"]], [8.0, 16.0])
    out3 = strategy.run(lambda b, a: a + 2 * b + 2, kwargs=out2)
    np.testing.assert_allclose(out3, 42.0)


def test_replica_id(strategy):
    # TF: strategy_test_lib.py DistributionTestBase._test_replica_id: every replica id once
    ids = strategy.run(lambda: gd.get_replica_context().replica_id_in_sync_group)
    assert sorted(int(i) for i in ids.values) == list(range(strategy.num_replicas_in_sync))


def test_capture_replica_id_in_nested_functions(strategy):
    # TF: strategy_common_test.py StrategyTest.testCaptureReplicaId
    made = {}

    @gd.function
    def f():
        return gd.get_replica_context().replica_id_in_sync_group

    @gd.function
    def g():
        if made.get("v") is None:
            made["v"] = gd.Variable(0.0)
        return strategy.run(f)

    assert [int(i) for i in g().values] == [0, 1]


def test_function_in_run(strategy):
    # TF: mirrored_strategy_test.py MirroredStrategyCallForEachReplicaTest
    # testFunctionInCallForEachReplica (the trace count differs: see the report)
    @gd.function
    def model_fn():
        return gd.get_replica_context().replica_id_in_sync_group

    with strategy.scope():
        assert [int(i) for i in strategy.run(model_fn).values] == [0, 1]


def test_function_in_run_inside_another_function(strategy):
    # TF: mirrored_strategy_test.py testFunctionInCallForEachReplicaInsideAnotherFunction
    @gd.function
    def model_fn():
        return gd.get_replica_context().replica_id_in_sync_group

    @gd.function
    def step():
        return strategy.run(model_fn)

    with strategy.scope():
        assert [int(i) for i in step().values] == [0, 1]


def test_function_in_run_cached(strategy):
    # TF: mirrored_strategy_test.py testFunctionInCallForEachReplicaCached: no retrace after
    # the first call
    traces = []

    def model_fn():
        traces.append(None)
        return gd.get_replica_context().replica_id_in_sync_group

    for i in range(5):
        strategy.run(model_fn)
        if i == 0:
            first = len(traces)
            assert first > 0
    assert len(traces) == first


# ---------------------------------------------------------------- merge_call


def test_merge_call_in_function_returns_none(strategy):
    # TF: mirrored_strategy_test.py testFunctionInCallForEachReplicaWithMergeCall
    @gd.function
    def model_fn():
        gd.get_replica_context().merge_call(lambda _: None)
        return 0.0

    with strategy.scope():
        np.testing.assert_allclose(strategy.run(model_fn), 0.0)


def test_merge_call_result_given_to_every_replica(strategy):
    # TF: strategy_common_test.py StrategyTest.testMergeCallInitScope
    with strategy.scope():
        @gd.function
        def fn():
            def replica_fn():
                y = gd.get_replica_context().merge_call(lambda _: np.int32(11))
                return y + 1
            return strategy.run(replica_fn)

        np.testing.assert_array_equal(_local(fn(), 2), [12, 12])


def test_merge_call_reduce_per_replica_value(strategy, tf_function):
    # TF: mirrored_strategy_test.py testControlFlowFunctionInCallForEachReplicaWithMergeCall's
    # merge_fn (strategy.reduce(SUM, value) in cross-replica context), without the while loop
    def merge_fn(strat, value):
        assert gd.get_replica_context() is None and gd.in_cross_replica_context()
        return strat.reduce(SUM, value, axis=None)

    def model_fn():
        return gd.get_replica_context().merge_call(merge_fn, args=(_rid_f32() + 1.0,))

    run = tf_function(lambda: strategy.run(model_fn))
    np.testing.assert_allclose(_local(run(), 2), [3.0, 3.0])


def test_merge_call_regroups_kwargs(strategy, tf_function):
    # TF: distribute_lib_test.py TestStrategyTest.testCallForEachReplica
    # (replica_context.merge_call(fn, test_arg=...)): keyword arguments are regrouped too
    def merge_fn(strat, *, value, scale):
        return strat.reduce(SUM, value, axis=None) * scale

    def model_fn():
        return gd.get_replica_context().merge_call(
            merge_fn, kwargs={"value": _rid_f32() + 1.0, "scale": 2.0})

    np.testing.assert_allclose(_local(tf_function(lambda: strategy.run(model_fn))(), 2),
                               [6.0, 6.0])


def test_merge_call_on_default_strategy():
    # TF: distribute_lib_test.py DefaultDistributionStrategyTest.testMergeCall
    seen = {}

    def merge_fn(dist, s):
        seen.update(strategy=dist, replica_context=gd.get_replica_context(),
                    cross=gd.in_cross_replica_context(), current=gd.get_strategy())
        return "foo_" + s

    replica_ctx = gd.get_replica_context()
    assert replica_ctx is not None
    assert replica_ctx.merge_call(merge_fn, args=("bar",)) == "foo_bar"
    assert seen["strategy"] is gd.get_strategy() and seen["current"] is seen["strategy"]
    assert seen["replica_context"] is None and seen["cross"]
    _assert_in_default_state()


def test_merge_call_on_default_strategy_has_no_strategy():
    # TF: distribute_lib_test.py DefaultDistributionStrategyTest.testMergeCall
    # (self.assertFalse(ds_context.has_strategy()) inside merge_fn)
    flags = []
    gd.get_replica_context().merge_call(
        lambda dist: flags.append((gd.has_strategy(), gd.in_cross_replica_context())))
    assert flags == [(False, True)]
    with gd.get_strategy().scope():
        assert not gd.has_strategy()


def test_merge_call_on_mirrored_strategy_has_strategy(strategy):
    flags = []
    strategy.run(lambda: gd.get_replica_context().merge_call(
        lambda dist: flags.append(gd.has_strategy())))
    assert flags and all(flags)


# ---------------------------------------------------------------- exceptions


class _TestException(Exception):
    pass


def _raise_exception_fn(_=None):
    raise _TestException()


def _merge_raises_fn():
    gd.get_replica_context().merge_call(_raise_exception_fn)


def _merge_call_raises_fn():
    gd.get_replica_context().merge_call(lambda dist: dist.run(_raise_exception_fn))


@pytest.mark.parametrize("fn", [_raise_exception_fn, _merge_raises_fn, _merge_call_raises_fn],
                         ids=["in_run", "in_merge_fn", "in_run_inside_merge_fn"])
@pytest.mark.parametrize("make", [lambda: gd.MirroredStrategy(["cpu:0", "cpu:1"]),
                                  lambda: gd.OneDeviceStrategy("cpu:0")],
                         ids=["mirrored", "one_device"])
def test_call_and_merge_exceptions(make, fn):
    # TF: strategy_test_lib.py DistributionTestBase._test_call_and_merge_exceptions
    # (mirrored_strategy_test.py / one_device_strategy_test.py testCallAndMergeExceptions)
    dist = make()
    with dist.scope():
        with pytest.raises(_TestException):
            dist.run(fn)
    _assert_in_default_state()


def test_reduce_in_replica_context_raises(strategy):
    # TF: distribute_lib.py Strategy.reduce requires cross-replica context
    # (_require_cross_replica_or_default_context_extended); exercised by
    # mirrored_strategy_test.py testControlFlowFunctionInCallForEachReplicaWithMergeCall
    with pytest.raises(RuntimeError):
        strategy.run(lambda: strategy.reduce(SUM, _rid_f32(), axis=None))


def test_nested_run_raises(strategy):
    # TF: distribute_lib.py Strategy.run / call_for_each_replica require cross-replica context
    with pytest.raises(RuntimeError):
        strategy.run(lambda: strategy.run(lambda: _rid_f32()))


# ---------------------------------------------------------------- contexts


def _assert_in_default_state():
    # TF: distribute_lib_test.py _assert_in_default_state
    ctx = gd.get_replica_context()
    assert isinstance(ctx, gd.ReplicaContext) and ctx.strategy is gd.get_strategy()
    assert not gd.in_cross_replica_context()
    assert not gd.has_strategy()


def test_call_for_each_replica_contexts(strategy, tf_function):
    # TF: distribute_lib_test.py TestStrategyTest.testCallForEachReplica
    _assert_in_default_state()
    seen = []

    def run_fn():
        ctx = gd.get_replica_context()
        seen.append((ctx is not None, gd.in_cross_replica_context(), gd.has_strategy(),
                     gd.get_strategy() is strategy, ctx.num_replicas_in_sync))
        return _rid_f32()

    tf_function(lambda: strategy.run(run_fn))()
    with strategy.scope():
        tf_function(lambda: strategy.run(run_fn))()
    assert seen and all(s == (True, False, True, True, 2) for s in seen)
    _assert_in_default_state()


def test_scope_is_cross_replica_context(strategy):
    # TF: distribute_lib_test.py TestStrategyTest.testScope
    _assert_in_default_state()
    with strategy.scope():
        assert gd.get_replica_context() is None
        assert gd.in_cross_replica_context()
        assert gd.has_strategy()
        assert gd.get_strategy() is strategy
    _assert_in_default_state()


def test_same_scope_nesting(strategy):
    # TF: distribute_lib_test.py TestStrategyTest.testSameScopeNesting (first part)
    with strategy.scope():
        with strategy.scope():
            assert gd.get_strategy() is strategy
            with strategy.scope():
                assert gd.get_strategy() is strategy
        assert gd.get_strategy() is strategy
    _assert_in_default_state()


def test_mixing_strategy_scopes_raises(strategy):
    # TF: distribute_lib_test.py TestStrategyTest.testSameScopeNesting (dist2 part)
    other = gd.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        with pytest.raises(RuntimeError, match="Mixing different"):
            with other.scope():
                pass
        with pytest.raises(RuntimeError, match="Mixing different"):
            other.run(lambda: None)
        assert gd.get_strategy() is strategy
    with gd.get_strategy().scope():      # the default strategy's scope mixes with any
        with other.scope():
            assert gd.get_strategy() is other
    _assert_in_default_state()


@pytest.mark.parametrize("op", ["mean", "MEAN", "sum", "SUM", gd.ReduceOp.MEAN])
def test_default_strategy_reduce_accepts_string_ops(op):
    # TF: distribute_lib_test.py TestStrategyTest.testReductions_acceptStringOps / testReduce
    dist = gd.get_strategy()
    np.testing.assert_allclose(dist.reduce(op, np.float32(1.0), axis=None), 1.0)


def test_default_strategy_run_twice():
    # TF: distribute_lib_test.py DefaultDistributionStrategyTest.testExperimentalRunV2
    dist = gd.get_strategy()
    for batch in list(gd.data.batches(np.arange(10, dtype=np.float32), 2))[:2]:
        np.testing.assert_allclose(dist.run(lambda x: x, args=(batch,)), batch)
