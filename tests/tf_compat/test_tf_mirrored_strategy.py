"""Ports of TF's MirroredStrategy and OneDeviceStrategy tests that are about the strategy
itself: replica counts, one-device mirrored strategies, variables used in nested functions
inside replicas, and gradients of mirrored variables (mirrored_strategy_test.py,
mirrored_variable_test.py, one_device_strategy_test.py)."""

from __future__ import annotations

import numpy as np
import pytest
from tf_helpers import local_results as _local

import graphdist as gd

SUM, MEAN = gd.ReduceOp.SUM, gd.ReduceOp.MEAN



def test_num_replicas_in_sync(strategy):
    # TF: mirrored_strategy_test.py MirroredTwoDeviceDistributionTest.testNumReplicasInSync
    assert strategy.num_replicas_in_sync == 2
    assert strategy.devices == ("cpu:0", "cpu:1")


@pytest.mark.parametrize("make", [lambda: gd.MirroredStrategy(["cpu:0"]),
                                  lambda: gd.OneDeviceStrategy("cpu:0")],
                         ids=["mirrored_one_cpu", "one_device"])
def test_one_device_strategies(make):
    # TF: mirrored_strategy_test.py MirroredOneDeviceDistributionTest (testRun,
    # testReplicaId, testAllReduceSum/Mean) and one_device_strategy_test.py OneDeviceStrategyTest
    strategy = make()
    assert strategy.num_replicas_in_sync == 1
    assert int(strategy.run(lambda: gd.get_replica_context().replica_id_in_sync_group)) == 0
    out = strategy.run(lambda x: gd.get_replica_context().all_reduce(SUM, x),
                       args=(np.array([42.0, 43.0], np.float32),))
    np.testing.assert_array_equal(out, [42.0, 43.0])
    assert strategy.reduce(MEAN, np.float32(2.0), axis=None) == 2.0
    with strategy.scope():
        v = gd.Variable(1.0)
    assert len(v.values) == 1 and v.devices == ("cpu:0",)


def test_variable_components_live_on_the_strategy_devices():
    # TF: mirrored_variable_test.py MirroredVariableCreationTest._test_mv_properties /
    # testSingleVariable: one component per device, in device order
    strategy = gd.MirroredStrategy(["cpu:2", "cpu:0", "cpu:1"])
    with strategy.scope():
        v = gd.Variable(1.0, name="foo")
    assert v.name == "foo" and v.devices == ("cpu:2", "cpu:0", "cpu:1")
    assert [float(c) for c in v.values] == [1.0, 1.0, 1.0]


def test_variable_with_tensor_initial_value_equal_on_every_replica(strategy):
    # TF: vars_test.py OnWriteVariableSync.testInitializedToSameValueInsideEagerRun /
    # mirrored_variable_test.py testVariableWithTensorInitialValueInFunction: every
    # component starts from the first one's initial value
    rng = np.random.default_rng(0)
    with strategy.scope():
        v = gd.Variable(lambda: rng.standard_normal(3).astype(np.float32))
    np.testing.assert_array_equal(v.values[0], v.values[1])


class _MockModel:
    # TF: mirrored_strategy_test.py MockModel
    def __init__(self, two_variables=False):
        self.variables = [gd.Variable(1.25, name="dummy_var1")]
        if two_variables:
            self.variables.append(gd.Variable(2.0, name="dummy_var2"))

    def __call__(self, factor=2):
        x = factor * self.variables[0]
        if len(self.variables) > 1:
            x = x + self.variables[1]
        return x


@pytest.mark.parametrize("case, two_variables, expected", [
    ("defun", False, 2.5), ("nested_defun", False, 3.5), ("two_variables_nested", True, 5.5)])
def test_variable_in_defun(strategy, case, two_variables, expected):
    # TF: mirrored_strategy_test.py MirroredStrategyDefunTest.testVariableInDefun,
    # testVariableInNestedDefun, testTwoVariablesInNestedDefun
    with strategy.scope():
        mock_model = _MockModel(two_variables)

    times_two = gd.function(lambda: mock_model())
    two_x_plus_one = gd.function(lambda: times_two() + 1)
    model_fn = times_two if case == "defun" else two_x_plus_one
    np.testing.assert_allclose(_local(strategy.run(model_fn), 2), [expected] * 2)


def test_gradient_tape_over_nested_defuns(strategy):
    # TF: mirrored_strategy_test.py MirroredStrategyDefunTest.testGradientTapeOverNestedDefuns
    with strategy.scope():
        mock_model = _MockModel(two_variables=True)
    fn1 = gd.function(lambda: mock_model())
    fn2 = gd.function(lambda: fn1() + 1)

    def model_fn():
        with gd.GradientTape() as gtape:
            result = fn2()
        return gtape.gradient(result, mock_model.variables)

    grads = strategy.run(model_fn)
    for g, expected in zip(grads, [2.0, 1.0]):
        np.testing.assert_allclose(_local(g, 2), [expected] * 2)


def test_pass_per_replica(strategy):
    # TF: mirrored_strategy_test.py MirroredStrategyDefunTest.testPassPerReplica
    with strategy.scope():
        mock_model = _MockModel()
    fn1 = gd.function(lambda factor: mock_model(factor))
    factors = gd.PerReplica((np.float32(5.0), np.float32(3.0)))
    np.testing.assert_allclose(strategy.run(fn1, args=(factors,)).values,
                               [5.0 * 1.25, 3.0 * 1.25])


def test_backward_function_on_every_replica(strategy):
    # TF: mirrored_strategy_test.py FunctionTest.testBackwardFunctionDevicePlacement
    with strategy.scope():
        w = gd.Variable(np.array([1.5], np.float32), name="w")
        b = gd.Variable(np.array([0.5], np.float32), name="b")

    forward = gd.function(lambda x, w, b: x * w + b)

    def replica_fn():
        with gd.GradientTape() as t:
            x = np.array([1.0], np.float32)
            loss = forward(x, w, b) - 1.0
        return t.gradient(loss, [w, b])

    g1, g2 = gd.function(lambda: strategy.run(replica_fn))()
    for g in (g1, g2):
        np.testing.assert_allclose(np.stack(_local(g, 2)), [[1.0], [1.0]])


def test_mirrored_variable_stop_gradient(strategy):
    # TF: mirrored_strategy_test.py MirroredVariableStopGradientTest
    # testMirroredVariableAsStopGradient: no gradient flows through stop_gradient
    with strategy.scope():
        x = gd.Variable(1.0)

    def replica_fn():
        with gd.GradientTape() as tape:
            y = gd.stop_gradient(x) * 3.0
        return tape.gradient(y, x)

    assert all(g is None for g in _local(strategy.run(replica_fn), 2))


@pytest.mark.parametrize("count", [1, 5])
def test_variables_created_in_replica_function(strategy, count):
    # TF: mirrored_variable_test.py MirroredVariableCreationTest.testSingleVariable and
    # testMultipleVariables: a variable made in the replica function is made once, mirrored
    made = []

    def model_fn():
        vs = [gd.Variable(1.0, name=f"foo{i}") for i in range(count)]
        made.extend(vs)
        gd.get_replica_context().merge_call(lambda _: None)
        return vs[0] * 1.0

    with strategy.scope():
        result = strategy.run(model_fn)
    assert [v.name for v in made] == [f"foo{i}" for i in range(count)]
    for v in made:
        assert v.devices == strategy.devices and [float(c) for c in v.values] == [1.0, 1.0]
    np.testing.assert_array_equal(_local(result, 2), [1.0, 1.0])
