"""Ports of TF's input-distribution tests: experimental_distribute_dataset over global
batches (even, uneven, partial and empty shards), iteration inside and outside gd.function,
and strategy.run on the shards (custom_training_loop_input_test.py, mirrored_strategy_test.py,
strategy_common_test.py, distribute_lib_test.py). tf.data itself is out of scope: the
datasets are gd.data.batches over numpy arrays."""

from __future__ import annotations

import numpy as np
import pytest
from tf_helpers import flattened as _flattened
from tf_helpers import local_results as _local

import graphdist as gd

SUM, MEAN = gd.ReduceOp.SUM, gd.ReduceOp.MEAN
DATA = np.array([5.0, 6.0, 7.0, 8.0], np.float32)




def _dataset(data=DATA, batch_size=2, drop_remainder=True):
    return gd.data.batches(np.asarray(data), batch_size, drop_remainder=drop_remainder)


def test_constant_numpy_input(strategy):
    # TF: custom_training_loop_input_test.py InputIterationTest.testConstantNumpyInput
    @gd.function
    def run(x):
        return strategy.run(gd.square, args=(x,))

    np.testing.assert_array_equal(_local(run(np.float32(2.0))), [4.0, 4.0])


def test_stateful_run_always_executes(strategy):
    # TF: custom_training_loop_input_test.py testStatefulExperimentalRunAlwaysExecute
    with strategy.scope():
        v = gd.Variable(0.0, aggregation=gd.VariableAggregation.MEAN)

    @gd.function
    def train_step():
        def assign_add():
            v.assign_add(1.0)
        strategy.run(assign_add)
        return gd.zeros_like(np.float32(0.0))

    train_step()
    assert v.numpy() == 1.0


def test_full_eager(strategy):
    # TF: custom_training_loop_input_test.py testFullEager
    results = [strategy.run(gd.square, args=(x,))
               for x in strategy.experimental_distribute_dataset(_dataset())]
    assert _flattened(results) == [[25.0, 36.0], [49.0, 64.0]]


def test_step_in_function(strategy):
    # TF: custom_training_loop_input_test.py testStepInFunction
    train_step = gd.function(gd.square)
    results = [strategy.run(train_step, args=(x,))
               for x in strategy.experimental_distribute_dataset(_dataset())]
    assert _flattened(results) == [[25.0, 36.0], [49.0, 64.0]]


def test_run_in_function(strategy):
    # TF: custom_training_loop_input_test.py testRunInFunction /
    # testRunInFunctionAutoGraphApplication / testIterationOutsideFunction
    @gd.function
    def f_train_step(input_data):
        return strategy.run(gd.square, args=(input_data,))

    iterator = iter(strategy.experimental_distribute_dataset(_dataset()))
    results = [f_train_step(next(iterator)) for _ in range(2)]
    assert _flattened(results) == [[25.0, 36.0], [49.0, 64.0]]
    assert f_train_step.trace_count == 1


def test_nested_output(strategy):
    # TF: custom_training_loop_input_test.py testNestedOutput
    input_iterator = iter(strategy.experimental_distribute_dataset(
        _dataset(np.arange(4, dtype=np.int32))))

    @gd.function
    def run(inputs):
        return strategy.run(lambda x: [{"a": x - 1, "b": x + 1}], args=(inputs,))

    results = run(next(input_iterator))
    for replica in range(strategy.num_replicas_in_sync):
        assert _local(results[0]["a"])[replica].tolist() == [replica - 1]
        assert _local(results[0]["b"])[replica].tolist() == [replica + 1]


def test_dataset_iteration_in_function(strategy):
    # TF: custom_training_loop_input_test.py testDatasetIterationInFunction
    with strategy.scope():
        a = gd.Variable(1.0, aggregation=gd.VariableAggregation.ONLY_FIRST_REPLICA)
    dist_dataset = strategy.experimental_distribute_dataset(_dataset())

    def train_step(_):
        a.assign_add(1.0)

    @gd.function
    def f_train_step():
        number_of_steps = np.float32(0.0)
        product_of_means = np.float32(2.0)
        for x in dist_dataset:          # Python loop: unrolled at trace time
            number_of_steps = number_of_steps + 1.0
            product_of_means = product_of_means * strategy.reduce("MEAN", x, axis=0)
        for y in dist_dataset:
            strategy.run(train_step, args=(y,))
        return number_of_steps, product_of_means

    number_of_steps, product_of_means = f_train_step()
    assert number_of_steps == 2
    np.testing.assert_allclose(product_of_means, 2 * (5 + 6) / 2 * (7 + 8) / 2, atol=1e-3)
    assert a.numpy() == 3.0


def test_iteration_inside_function(strategy):
    # TF: custom_training_loop_input_test.py testIterationInsideFunction
    dist_dataset = strategy.experimental_distribute_dataset(_dataset())

    @gd.function
    def train():
        iterator = iter(dist_dataset)
        return [strategy.run(gd.square, args=(next(iterator),)) for _ in range(2)]

    assert _flattened(train()) == [[25.0, 36.0], [49.0, 64.0]]


def test_dataset_assert_with_dynamic_batch(strategy):
    # TF: custom_training_loop_input_test.py testDatasetAssertWithDynamicBatch: a partial
    # last batch of one row leaves replica 1 an empty shard
    dist = strategy.experimental_distribute_dataset(
        _dataset([5.0, 6.0, 7.0], drop_remainder=False))
    results = [strategy.run(gd.square, args=(x,)) for x in dist]
    assert _flattened(results) == [[25.0, 36.0], [49.0]]


def test_dynamic_shapes(strategy):
    # TF: custom_training_loop_input_test.py testDynamicShapes /
    # testDynamicShapesWithGetNextOutsideFunction: 3 rows on 2 replicas -> 2 and 1
    input_iterator = iter(strategy.experimental_distribute_dataset(
        _dataset([5.0, 6.0, 7.0], batch_size=4, drop_remainder=False)))

    @gd.function
    def run(inputs):
        return strategy.run(gd.reduce_mean, args=(inputs,))

    np.testing.assert_array_equal(_local(run(next(input_iterator))), [5.5, 7.0])


def test_dynamic_shapes_with_size_op(strategy):
    # TF: custom_training_loop_input_test.py testDynamicShapesWithSizeOp
    inputs = next(iter(strategy.experimental_distribute_dataset(
        _dataset([5.0, 6.0, 7.0], batch_size=4, drop_remainder=False))))

    @gd.function
    def run(inputs):
        return strategy.run(lambda x: gd.shape(x)[0], args=(inputs,))

    assert [int(v) for v in _local(run(inputs))] == [2, 1]


@pytest.mark.parametrize("data, expected", [([5.0, 6.0, 7.0], 6.0),
                                            ([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]], [1.0, 1.0])],
                         ids=["rank1", "rank2"])
def test_strategy_reduce_with_dynamic_shapes(strategy, data, expected):
    # TF: custom_training_loop_input_test.py testStrategyReduceWithDynamicShapes and
    # testStrategyReduceWithDynamicShapesRank2
    inputs = next(iter(strategy.experimental_distribute_dataset(
        _dataset(np.array(data, np.float32), batch_size=4, drop_remainder=False))))
    run = gd.function(lambda inputs: strategy.reduce(MEAN, inputs, axis=0))
    np.testing.assert_allclose(run(inputs), expected)


@pytest.mark.parametrize("batch_size, drop_remainder, expected", [
    (2, True, [5.0, 6.0]), (1, True, [5.0]), (2, False, [5.0, 6.0])],
    ids=["evenly_divisible_drop", "not_divisible_drop", "evenly_divisible_no_drop"])
def test_dataset_distribute(strategy, batch_size, drop_remainder, expected):
    # TF: custom_training_loop_input_test.py testDatasetDistributeEvenlyDivisibleDrop,
    # testDatasetDistributeNotDivisibleDrop, testDatasetDistributeEvenlyDivisibleNoDrop
    data = next(iter(strategy.experimental_distribute_dataset(
        _dataset([5.0, 6.0], batch_size, drop_remainder))))
    assert np.concatenate(_local(data)).tolist() == expected


def test_dataset_partial_batch_with_mixed_outputs(strategy):
    # TF: custom_training_loop_input_test.py testDatasetPartialBatchWithMixedOutputs
    inputs = next(iter(strategy.experimental_distribute_dataset(
        _dataset([5.0], batch_size=2, drop_remainder=False))))

    @gd.function
    def run(inputs):
        return strategy.run(lambda x: (gd.zeros_like(np.zeros(3, np.float32)), gd.square(x)),
                            args=(inputs,))

    fixed, dynamic = run(inputs)
    for replica in range(strategy.num_replicas_in_sync):
        assert _local(fixed)[replica].tolist() == [0.0, 0.0, 0.0]
    assert _local(dynamic)[0].tolist() == [25.0]
    assert _local(dynamic)[1].tolist() == []


def test_multi_device_data_captured_function(strategy):
    # TF: custom_training_loop_input_test.py testMultiDeviceDataCapturedFunction: replica i
    # gets element i of [2., 3.]; func = square + var; mean over replicas
    with strategy.scope():
        var = gd.Variable(1.0)

    @gd.function
    def train_step(inputs):
        per_replica_outputs = strategy.run(lambda x: gd.square(x) + var, args=(inputs,))
        return strategy.reduce(MEAN, per_replica_outputs, axis=None)

    inputs = gd.PerReplica((np.float32(2.0), np.float32(3.0)))
    with strategy.scope():
        assert train_step(inputs) == 7.5
        assert train_step(inputs) == 7.5


def test_dataset_out_of_range(strategy):
    # TF: custom_training_loop_input_test.py testDatasetOutOfRange (OutOfRangeError ->
    # StopIteration): a SUM variable accumulates the whole dataset
    with strategy.scope():
        a = gd.Variable(0.0, aggregation=gd.VariableAggregation.SUM)

    @gd.function
    def f_train_step(val):
        strategy.run(lambda v: a.assign_add(gd.reduce_sum(v)), args=(val,))
        return a.read_value()

    iterator = iter(strategy.experimental_distribute_dataset(_dataset()))
    with pytest.raises(StopIteration):
        for _ in range(100):
            f_train_step(next(iterator))
    assert a.numpy() == 26.0


def test_replicate_dataset(strategy):
    # TF: mirrored_strategy_test.py MirroredTwoDeviceDistributionTest.testReplicateDataset /
    # testMakeInputFnIteratorWithDataset: range(10), global batch 2 -> [i, i+1] per step
    dist = strategy.experimental_distribute_dataset(_dataset(np.arange(10, dtype=np.int64)))
    got = [[int(v[0]) for v in batch.values] for batch in dist]
    assert got == [[i, i + 1] for i in range(0, 10, 2)]
    assert [[int(v[0]) for v in batch.values] for batch in dist] == got   # re-iterable


def test_simple_input_last_partial_batch(strategy):
    # TF: strategy_common_test.py DistributedCollectiveAllReduceStrategyTest
    # testSimpleInputFromDatasetLastPartialBatch: range(14), global batch 8
    dist = strategy.experimental_distribute_dataset(
        _dataset(np.arange(14, dtype=np.int64), batch_size=8, drop_remainder=False))
    run = gd.function(lambda x: strategy.run(lambda v: v, args=(x,)))
    first, last = [run(x) for x in dist]
    assert [v.tolist() for v in _local(first)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [v.tolist() for v in _local(last)] == [[8, 9, 10], [11, 12, 13]]


def test_uneven_global_batch_on_four_replicas():
    # docs/api.md "Data" (TF's input_lib splits a partial batch the same way): 10 rows on 4 -> 3,3,2,2
    strategy = gd.MirroredStrategy([f"cpu:{i}" for i in range(4)])
    batch = next(iter(strategy.experimental_distribute_dataset(
        _dataset(np.arange(10, dtype=np.float32), batch_size=10))))
    assert [v.tolist() for v in batch.values] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert strategy.reduce(SUM, strategy.run(gd.reduce_sum, args=(batch,)), axis=None) == 45


def test_tuple_batches(strategy):
    # TF: custom_training_loop_input_test.py / strategy_test_lib._test_numpy_dataset: (x, y)
    # pairs split together, each replica's rows concatenating back to the global batch
    x = np.asarray([[1, 2], [6, 12], [2, 4], [5, 10], [3, 6], [4, 8]], np.float32)
    y = np.asarray([5, 4, 3, 2, 1, 0], np.int32)
    for bx, by in strategy.experimental_distribute_dataset(gd.data.batches((x, y), 6)):
        np.testing.assert_array_equal(np.concatenate(bx.values), x)
        np.testing.assert_array_equal(np.concatenate(by.values), y)
        out = strategy.run(lambda a, b: (a * 2.0, b + 1), args=(bx, by))
        np.testing.assert_array_equal(np.concatenate(out[0].values), x * 2)
        np.testing.assert_array_equal(np.concatenate(out[1].values), y + 1)


def test_default_strategy_distributed_dataset():
    # TF: distribute_lib_test.py DefaultDistributionStrategyTest.testDistributedDatasets
    default_strategy = gd.get_strategy()
    dist = default_strategy.experimental_distribute_dataset(
        _dataset(np.arange(10, dtype=np.int64)))
    assert np.asarray(next(iter(dist))).tolist() == [0, 1]
