"""Ports of TF's tests of distributed values: experimental_distribute_values_from_function,
PerReplica through gd.function, strategy.reduce and strategy.gather (values_test.py,
strategy_common_test.py, strategy_gather_test.py, mirrored_strategy_test.py)."""

from __future__ import annotations

import numpy as np
import pytest
from tf_helpers import local_results as _local

import graphdist as gd

SUM, MEAN = gd.ReduceOp.SUM, gd.ReduceOp.MEAN



# ---------------------------------------------------------------- distribute_values_from_function


def test_make_distributed_value_from_tensor(strategy):
    # TF: values_test.py DistributedValuesTest.testMakeDistributedValueFromTensor
    values = strategy.experimental_distribute_values_from_function(lambda ctx: np.int32(1))
    np.testing.assert_array_equal(strategy.gather(
        strategy.run(lambda x: gd.expand_dims(x, 0), args=(values,)), axis=0), [1, 1])


def test_make_distributed_value_single_numpy_array_constant(strategy):
    # TF: values_test.py DistributedValuesTest.testMakeDistributedValueSingleNumpyArrayConstant
    array_value = np.array([1.0, 2.0, 3.0])
    values = strategy.experimental_distribute_values_from_function(lambda ctx: array_value)
    np.testing.assert_array_equal(np.stack(_local(values, 2)), [[1.0, 2.0, 3.0]] * 2)
    np.testing.assert_array_equal(strategy.gather(values, axis=0), [1.0, 2.0, 3.0] * 2)


def test_make_distributed_value_tuple_constant(strategy):
    # TF: values_test.py DistributedValuesTest.testMakeDistributedValueTupleConstant
    values = strategy.experimental_distribute_values_from_function(lambda ctx: (1.0, 2.0, 3.0))
    out = strategy.run(lambda t: (t[0] * 1.0, t[1] * 1.0, t[2] * 1.0), args=(values,))
    assert [list(_local(o, 2)) for o in out] == [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]


def test_make_distributed_value_nested_structure_per_replica(strategy):
    # TF: values_test.py DistributedValuesTest.testMakeDistributedValueNestedStructurePerReplica
    def value_fn(ctx):
        return tuple(val * ctx.replica_id_in_sync_group for val in (1.0, 2.0, 3.0))

    values = strategy.experimental_distribute_values_from_function(value_fn)
    out = strategy.run(lambda t: (t[0] * 1.0, t[1] * 1.0, t[2] * 1.0), args=(values,))
    assert [list(_local(o, 2)) for o in out] == [[0.0, 1.0], [0.0, 2.0], [0.0, 3.0]]


@pytest.mark.parametrize("where", ["eager", "argument", "made_inside", "captured"])
def test_python_numbers_at_any_depth_of_per_replica(strategy, where):
    # Python numbers in tuples, lists and dicts of a component are per-replica values too
    def value_fn(ctx):
        r = ctx.replica_id_in_sync_group
        return {"a": (1.0 * r, [2.0 * r, {"c": 3 * r}]), "b": [bool(r)], "s": "x"}

    def replica_fn(t):
        return (t["a"][0] * 1.0, t["a"][1][0] * 1.0, t["a"][1][1]["c"] * 1,
                gd.cast(t["b"][0], "int32") * 1)

    values = strategy.experimental_distribute_values_from_function(value_fn)
    if where == "eager":
        out = strategy.run(replica_fn, args=(values,))
    elif where == "argument":
        out = gd.function(lambda v: strategy.run(replica_fn, args=(v,)))(values)
    elif where == "made_inside":
        out = gd.function(lambda: strategy.run(
            replica_fn, args=(strategy.experimental_distribute_values_from_function(value_fn),)))()
    else:
        out = gd.function(lambda: strategy.run(replica_fn, args=(values,)))()
    assert [[float(x) for x in _local(o, 2)] for o in out] == [[0, 1], [0, 2], [0, 3], [0, 1]]


def test_per_replica_static_leaves_that_differ_raise(strategy):
    values = gd.PerReplica([(np.float32(1.0), "a"), (np.float32(2.0), "b")])
    with pytest.raises(ValueError, match=r"'a' on replica 0 but 'b' on replica 1"):
        gd.function(lambda v: strategy.run(lambda t: t[0] * 1.0, args=(v,)))(values)
    with pytest.raises(ValueError, match=r"component\[1\] differs between replicas"):
        gd.function(lambda: strategy.run(lambda t: t[0] * 1.0, args=(values,)))()


def test_make_distributed_value_extract_from_array(strategy):
    # TF: values_test.py DistributedValuesTest.testMakeDistributedValueExtractFromArray
    multiple_values = range(strategy.num_replicas_in_sync)
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: multiple_values[ctx.replica_id_in_sync_group])
    assert [int(v) for v in _local(values, 2)] == [0, 1]
    assert strategy.reduce(SUM, values, axis=None) == 1


def test_make_distributed_value_and_run(strategy):
    # TF: values_test.py DistributedValuesTest.testMakeDistributedValueAndRun
    @gd.function
    def run():
        multiple_values = range(strategy.num_replicas_in_sync)
        values = strategy.experimental_distribute_values_from_function(
            lambda ctx: np.float32(multiple_values[ctx.replica_id_in_sync_group]))
        outputs = strategy.run(lambda x: gd.expand_dims(gd.square(x), 0), args=(values,))
        return strategy.gather(outputs, axis=0)

    np.testing.assert_array_equal(run(), [0.0, 1.0])


def test_value_context_fields(strategy):
    # TF: distribute_lib_test.py InputContextTest.testProperties (ValueContext counterpart)
    seen = []
    strategy.experimental_distribute_values_from_function(
        lambda ctx: seen.append((ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync)))
    assert seen == [(0, 2), (1, 2)]


# ---------------------------------------------------------------- PerReplica through functions


def test_per_replica_does_not_trigger_function_tracing(strategy):
    # TF: values_test.py PerReplicaTest.testDoesNotTriggerFunctionTracing
    traces = []

    @gd.function
    def f(x):
        traces.append(None)
        return strategy.run(lambda v: v * 1.0, args=(x,))

    per_replica = gd.PerReplica((np.float32(1.0), np.float32(2.0)))
    f(per_replica)
    assert traces
    del traces[:]
    for _ in range(3):
        per_replica = gd.PerReplica(tuple(v * 2 for v in per_replica.values))
        output = f(per_replica)
        assert isinstance(output, gd.PerReplica)
        np.testing.assert_array_equal(output.values, per_replica.values)
    assert not traces


def test_function_can_return_per_replica(strategy):
    # TF: values_test.py PerReplicaTest.testFunctionCanReturnPerReplica
    f = gd.function(lambda x: strategy.run(lambda v: v, args=(x,)))
    x = gd.PerReplica((np.float32(1.0), np.float32(5.0)))
    y = f(x)
    assert y is not x and isinstance(y, gd.PerReplica)
    np.testing.assert_array_equal(y.values, x.values)


# ---------------------------------------------------------------- reduce


@pytest.mark.parametrize("in_scope", [False, True], ids=["no_scope", "scope"])
def test_reduce_basic_eager(strategy, in_scope):
    # TF: strategy_common_test.py ReduceTest.testBasic (fn_eager, in and out of scope)
    values = strategy.experimental_distribute_values_from_function(
        lambda _: np.ones((), np.float32))
    if in_scope:
        with strategy.scope():
            got = strategy.reduce(SUM, value=values, axis=None)
    else:
        got = strategy.reduce(SUM, value=values, axis=None)
    assert got == 1.0 * strategy.num_replicas_in_sync


@pytest.mark.parametrize("in_scope", [False, True], ids=["no_scope", "scope"])
def test_reduce_basic_function(strategy, in_scope):
    # TF: strategy_common_test.py ReduceTest.testBasic (fn_graph = def_function.function(...))
    values = strategy.experimental_distribute_values_from_function(
        lambda _: np.ones((), np.float32))
    fn_graph = gd.function(lambda: strategy.reduce(SUM, value=values, axis=None))
    if in_scope:
        with strategy.scope():
            got = fn_graph()
    else:
        got = fn_graph()
    assert got == 1.0 * strategy.num_replicas_in_sync


def test_reduce_distinct_values_in_function(strategy):
    # TF: strategy_common_test.py ReduceTest.testBasic, with values that differ per replica
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.float32(ctx.replica_id_in_sync_group + 1))
    fn_graph = gd.function(lambda: strategy.reduce(SUM, value=values, axis=None))
    assert fn_graph() == 3.0


def test_reduce_axis(strategy, tf_function):
    # TF: strategy_common_test.py ReduceTest.testAxis
    x = strategy.run(tf_function(lambda: np.array([1.0, 2.0], np.float32) + 0.0))
    assert strategy.reduce(MEAN, x, axis=0) == 1.5
    assert strategy.reduce(SUM, x, axis=0) == 3 * strategy.num_replicas_in_sync


def test_reduce_host_tensor(strategy):
    # TF: strategy_common_test.py DistributedCollectiveAllReduceStrategyTest.testReduceHostTensor
    assert strategy.reduce(SUM, np.float32(1.0), axis=None) == 2.0


def test_reduce_device_tensors(strategy):
    # TF: strategy_common_test.py DistributedCollectiveAllReduceStrategyTest
    # testReduceDeviceTensors
    value = strategy.run(lambda: gd.cast(
        gd.get_replica_context().replica_id_in_sync_group, "float32") * 0.0 + 1.0)
    assert strategy.reduce(SUM, value, axis=None) == 2.0


def test_reduce_to_cpu(strategy):
    # TF: mirrored_strategy_test.py MirroredTwoDeviceDistributionTest.testReduceToCpu
    with strategy.scope():
        result = strategy.run(lambda: gd.get_replica_context().replica_id_in_sync_group)
        reduced = strategy.reduce(SUM, result, axis=None)
    assert reduced == sum(range(strategy.num_replicas_in_sync))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_reduce_axis_to_cpu(strategy, dtype):
    # TF: mirrored_strategy_test.py MirroredTwoDeviceDistributionTest.testReduceAxisToCpu
    # (reduce_axis_helper): replica x holds x+1 copies of x
    result = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.full(ctx.replica_id_in_sync_group + 1, ctx.replica_id_in_sync_group,
                            dtype))
    n = strategy.num_replicas_in_sync
    expected = sum(x * (x + 1) for x in range(n))
    np.testing.assert_allclose(strategy.reduce(SUM, result, axis=0), expected, atol=1e-5)
    expected /= sum(x + 1 for x in range(n))
    np.testing.assert_allclose(strategy.reduce(MEAN, result, axis=0), expected, atol=1e-5)


def test_reduce_axis_int32_sum(strategy):
    # TF: mirrored_strategy_test.py testReduceAxisToCpu with dtypes.int32 (SUM part)
    result = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.full(ctx.replica_id_in_sync_group + 1, ctx.replica_id_in_sync_group,
                            np.int32))
    assert strategy.reduce(SUM, result, axis=0) == 2


def test_reduce_axis_uneven_shapes_in_function(strategy):
    # TF: mirrored_strategy_test.py testReduceAxisToCpuUnknownShape: shards of different sizes
    # passed into a function (each shard shape is part of the signature)
    @gd.function
    def fn(x):
        return strategy.reduce(SUM, x, axis=0), strategy.reduce(MEAN, x, axis=0)

    result = gd.PerReplica((np.zeros(1, np.float32), np.ones(2, np.float32)))
    total, mean = fn(result)
    np.testing.assert_allclose([total, mean], [2.0, 2.0 / 3.0], rtol=1e-6)


# ---------------------------------------------------------------- gather


@pytest.mark.parametrize("value, axis", [
    (np.array([1, 2, 3]), 0),
    (np.array([[1, 2, 3]]), 0),
    (np.array([[1, 2, 3]]), 1),
    (np.array([[[1, 2], [1, 2]]]), 0),
    (np.array([[[1, 2], [1, 2]]]), 1),
    (np.array([[[1, 2], [1, 2]]]), 2),
], ids=["1D0", "2D0", "2D1", "3D0", "3D1", "3D2"])
def test_gather_same_shape(strategy, tf_function, value, axis):
    # TF: strategy_gather_test.py GatherTest.testGatherPerReplicaDense{1D0,2D0,2D1,3D0,3D1,3D2}
    # Axis (pure_eager True/False)
    value = value.astype(np.int32)
    values = strategy.experimental_distribute_values_from_function(lambda _: value)
    run = tf_function(lambda: strategy.gather(values, axis=axis))
    np.testing.assert_array_equal(run(), np.concatenate([value, value], axis=axis))


@pytest.mark.parametrize("axis", [0, 1])
def test_gather_different_shape_at_axis(strategy, axis):
    # TF: strategy_gather_test.py GatherTest.testGatherDiffShapeAtAxis0 / 1 (pure eager)
    def value_fn(ctx):
        shape = [1, 1]
        shape[axis] = ctx.replica_id_in_sync_group + 1
        return np.ones(shape, np.int32)

    values = strategy.experimental_distribute_values_from_function(value_fn)
    expected_shape = [1, 1]
    expected_shape[axis] = sum(range(strategy.num_replicas_in_sync + 1))
    np.testing.assert_array_equal(strategy.gather(values, axis=axis), np.ones(expected_shape))


def test_gather_different_shape_at_axis0_in_function(strategy):
    # TF: strategy_gather_test.py GatherTest.testGatherDiffShapeAtAxis0 (pure_eager=False);
    # the same happens to the outputs of uneven shards (10 rows on 4 replicas, docs/api.md)
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.ones((ctx.replica_id_in_sync_group + 1, 1), np.int32))
    run = gd.function(lambda x: strategy.gather(x, axis=0))
    np.testing.assert_array_equal(run(values), np.ones((3, 1)))


@pytest.mark.parametrize("inside_function", [False, True], ids=["run", "function"])
def test_gather_outputs_of_uneven_shards(inside_function):
    # 10 rows on 4 replicas run as 3, 3, 2, 2 rows; gather puts them back in order, and the
    # merge_fn of a replica sees every replica's component with its own shape
    strategy = gd.MirroredStrategy([f"cpu:{i}" for i in range(4)])
    x = np.arange(20, dtype=np.float32).reshape(10, 2)
    batch = next(iter(strategy.experimental_distribute_dataset([x])))

    def replica_fn(t):
        rows = gd.get_replica_context().merge_call(
            lambda _, v: [gd.shape(c)[0] for c in v.values], args=(t,))
        return t * 2.0, rows

    def step(b):
        doubled, rows = strategy.run(replica_fn, args=(b,))
        return strategy.gather(doubled, axis=0), rows

    if inside_function:
        gathered, rows = gd.function(step)(batch)
    else:
        gathered = strategy.gather(strategy.run(lambda t: t * 2.0, args=(batch,)), axis=0)
        rows = strategy.run(replica_fn, args=(batch,))[1]
    np.testing.assert_array_equal(gathered, x * 2.0)
    assert [int(r) for r in _local(rows[0], 4)] == [3] * 4
    assert [[int(r) for r in _local(row, 4)] for row in rows] == [[3] * 4, [3] * 4, [2] * 4,
                                                                  [2] * 4]


def test_gather_raise_different_shape_at_non_axis(strategy, tf_function):
    # TF: strategy_gather_test.py GatherTest.testGatherRaiseDiffShapeAtNonAxis
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.ones((1, ctx.replica_id_in_sync_group + 1), np.int32))
    with pytest.raises(ValueError):
        tf_function(lambda: strategy.gather(values, axis=0))()


def test_gather_raise_different_rank(strategy, tf_function):
    # TF: strategy_gather_test.py GatherTest.testGatherRaiseDifferentRank
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.ones(range(1, ctx.replica_id_in_sync_group + 2), np.float32))
    with pytest.raises(ValueError):
        tf_function(lambda: strategy.gather(values, axis=0))()


@pytest.mark.parametrize("make", [lambda: gd.OneDeviceStrategy("cpu:0"), gd.get_strategy],
                         ids=["one_device", "default"])
def test_gather_one_replica(make, tf_function):
    # TF: strategy_gather_test.py GatherTest.testGatherPerReplicaDense1D0Axis
    # (one_device_strategy and default_strategy combinations)
    strategy = make()
    values = strategy.experimental_distribute_values_from_function(
        lambda _: np.array([1, 2, 3], np.int32))
    np.testing.assert_array_equal(tf_function(lambda: strategy.gather(values, axis=0))(),
                                  [1, 2, 3])


# ---------------------------------------------------------------- local results of run


@pytest.mark.parametrize("result, expected", [
    (lambda: {"a": np.float32(1.0) + 0.0, "b": np.float32(2.0) + 0.0}, {"a": 1.0, "b": 2.0}),
    (lambda: [np.float32(1.0) + 0.0, np.float32(2.0) + 0.0], [1.0, 2.0]),
    (lambda: (np.float32(1.0) + 0.0, np.float32(2.0) + 0.0, np.float32(3.0) + 0.0),
     (1.0, 2.0, 3.0)),
    (lambda: ({"a": np.float32(1.0) + 0.0, "b": np.float32(2.0) + 0.0},
              {"a": np.float32(4.0) + 0.0, "b": np.float32(6.0) + 0.0}),
     ({"a": 1.0, "b": 2.0}, {"a": 4.0, "b": 6.0})),
    (lambda: {"a": 1.0, "b": 2.0}, {"a": 1.0, "b": 2.0}),
], ids=["dictionary", "list", "tuple", "nested_struct", "nested_struct_without_tensor"])
def test_local_result_structures(strategy, tf_function, result, expected):
    # TF: strategy_common_test.py StrategyLocalResultTest.testLocalResultForDictionary,
    # ForList, ForTuple, ForNestedStruct, ForNestedStructWithoutTensor: every replica returns
    # the same structure of equal values
    with strategy.scope():
        got = strategy.run(tf_function(result))

    def check(g, e):
        if isinstance(e, dict):
            assert isinstance(g, dict) and set(g) == set(e)
            for k in e:
                check(g[k], e[k])
        elif isinstance(e, (list, tuple)):
            assert type(g) is type(e) and len(g) == len(e)
            for gi, ei in zip(g, e):
                check(gi, ei)
        else:
            assert [float(x) for x in _local(g, 2)] == [e, e]

    check(got, expected)


def test_local_result_for_tensor(strategy, tf_function):
    # TF: strategy_common_test.py StrategyLocalResultTest.testLocalResultForTensor
    with strategy.scope():
        got = strategy.run(tf_function(lambda: np.array([2.0, 3.0], np.float32) * 1.0))
    np.testing.assert_array_equal(np.stack(_local(got, 2)), [[2.0, 3.0], [2.0, 3.0]])


def test_local_result_for_scalar_value_and_dictionary_different_replicas(strategy, tf_function):
    # TF: strategy_common_test.py StrategyLocalResultTest.testLocalResultForScalarValue and
    # testLocalResultForDictionaryDifferentReplicas
    def model_fn():
        replica_id = gd.get_replica_context().replica_id_in_sync_group
        return replica_id, {"a": gd.cast(replica_id + 1, "float32"),
                            "b": gd.cast(replica_id + 2, "float32")}

    with strategy.scope():
        ids, got = strategy.run(tf_function(model_fn))
    assert isinstance(ids, gd.PerReplica) and [int(i) for i in ids.values] == [0, 1]
    assert [float(v) for v in got["a"].values] == [1.0, 2.0]
    assert [float(v) for v in got["b"].values] == [2.0, 3.0]
