"""Ports of TF's custom-training-loop tests: gradients inside replica functions, optimizer
updates under a strategy (gradient aggregation), minimizing a loss with merge_call updates,
a global step, and the custom-loop correctness check against one device
(custom_training_loop_gradient_test.py, custom_training_loop_optimizer_test.py,
strategy_test_lib.py, ctl_correctness_test.py)."""

from __future__ import annotations

import numpy as np
import pytest
from tf_helpers import flattened as _flattened
from tf_helpers import local_results as _local

import graphdist as gd

SUM, MEAN = gd.ReduceOp.SUM, gd.ReduceOp.MEAN
DATA = np.array([5.0, 6.0, 7.0, 8.0], np.float32)




# ---------------------------------------------------------------- gradients


def _square_grad(x):
    with gd.GradientTape() as tape:
        tape.watch(x)           # manually watch non-variable tensors
        y = gd.square(x)
    return tape.gradient(y, x)


def test_step_in_function_gradient(strategy):
    # TF: custom_training_loop_gradient_test.py GradientTapeTest.testStepInFunctionGradient
    train_step = gd.function(_square_grad)
    dist = strategy.experimental_distribute_dataset(gd.data.batches(DATA, 2))
    results = [strategy.run(train_step, args=(x,)) for x in dist]
    assert _flattened(results) == [[10.0, 12.0], [14.0, 16.0]]


def test_run_in_function_gradient(strategy):
    # TF: custom_training_loop_gradient_test.py GradientTapeTest.testRunInFunctionGradient
    run = gd.function(lambda x: strategy.run(_square_grad, args=(x,)))
    dist = strategy.experimental_distribute_dataset(gd.data.batches(DATA, 2))
    assert _flattened([run(x) for x in dist]) == [[10.0, 12.0], [14.0, 16.0]]


@pytest.mark.parametrize("model_in_function", [True, False])
def test_nested_function_gradient(strategy, model_in_function):
    # TF: custom_training_loop_gradient_test.py GradientTapeTest.testNestedFunction
    def model(x):
        return x * x

    if model_in_function:
        model = gd.function(model)
    with strategy.scope():
        x = gd.Variable(1.0)

        @gd.function
        def train_step():
            def replica_step():
                with gd.GradientTape() as tape:
                    y = model(x)
                return tape.gradient(y, x)
            return strategy.run(replica_step)

        grads = _local(train_step())
    assert len(grads) == strategy.num_replicas_in_sync
    assert all(g is not None and float(g) == 2.0 for g in grads)


# ---------------------------------------------------------------- optimizer aggregation


@pytest.mark.parametrize("gradient_reduction, expected", [("sum", [-0.3, -0.3]),
                                                          ("mean", [-0.15, -0.15])])
def test_custom_aggregation(strategy, gradient_reduction, expected):
    # TF: custom_training_loop_optimizer_test.py OptimizerTest.test_custom_aggregation
    # (experimental_aggregate_gradients=True; Keras sums, graphdist's default is the mean)
    with strategy.scope():
        v = gd.Variable(np.zeros(2, np.float32))
        optimizer = gd.optimizers.SGD(0.1, gradient_reduction=gradient_reduction)
    grads = gd.PerReplica([np.array([1.0, 1.0], np.float32), np.array([2.0, 2.0], np.float32)])

    @gd.function
    def optimize(grads):
        def step_fn(grads):
            optimizer.apply_gradients([(grads, v)])
            return v.read_value()
        return strategy.run(step_fn, args=(grads,))

    for got in _local(optimize(grads)):
        np.testing.assert_allclose(got, expected, rtol=1e-6)
    for component in v.values:
        np.testing.assert_allclose(component, expected, rtol=1e-6)


def test_custom_aggregation_already_reduced(strategy):
    # TF: custom_training_loop_optimizer_test.py OptimizerTest.test_custom_aggregation
    # (experimental_aggregate_gradients=False); here every replica passes the same, already
    # reduced gradient, as docs/api.md's all_reduce=False expects
    with strategy.scope():
        v = gd.Variable(np.zeros(2, np.float32))
        optimizer = gd.optimizers.SGD(0.1)

    @gd.function
    def optimize():
        def step_fn():
            optimizer.apply_gradients([(np.array([1.0, 1.0], np.float32) + v * 0.0, v)],
                                      all_reduce=False)
            return v.read_value()
        return strategy.run(step_fn)

    np.testing.assert_allclose(optimize(), [-0.1, -0.1], rtol=1e-6)


def test_already_reduced_gradients_are_not_reduced_again(strategy):
    # all_reduce=False after the user's own all_reduce(SUM) equals gradient_reduction="sum"
    grads = gd.PerReplica([np.array([1.0, 3.0], np.float32), np.array([2.0, 5.0], np.float32)])
    results = []
    for all_reduce in (True, False):
        with strategy.scope():
            v = gd.Variable(np.zeros(2, np.float32))
            opt = gd.optimizers.SGD(0.1, gradient_reduction="sum")

        def step_fn(g, all_reduce=all_reduce, opt=opt, v=v):
            if not all_reduce:
                g = gd.get_replica_context().all_reduce(SUM, g)
            opt.apply_gradients([(g, v)], all_reduce=all_reduce)

        step = gd.function(lambda g, step_fn=step_fn: strategy.run(step_fn, args=(g,)))
        step(grads)
        assert sum(e.op.name == "all_reduce" for e in step.graph.eqns) == 1
        results.append(v.values)
    for got in results:
        for component in got:
            np.testing.assert_allclose(component, [-0.3, -0.8], rtol=1e-6)


@pytest.mark.parametrize("gradient_reduction", ["sum", "mean"])
def test_custom_aggregation_one_device(gradient_reduction):
    # TF: custom_training_loop_optimizer_test.py OptimizerTest.test_custom_aggregation_one_device
    distribution = gd.OneDeviceStrategy("cpu:0")
    with distribution.scope():
        v = gd.Variable(np.zeros(2, np.float32))
        optimizer = gd.optimizers.SGD(0.1, gradient_reduction=gradient_reduction)

    @gd.function
    def optimize():
        def step_fn(grads):
            optimizer.apply_gradients([(grads, v)])
            return v.read_value()
        return distribution.run(step_fn, args=(np.array([1.0, 1.0], np.float32),))

    np.testing.assert_allclose(optimize(), [-0.1, -0.1], rtol=1e-6)


# ---------------------------------------------------------------- minimize loss, global step


@pytest.mark.parametrize("n", [1, 2])
def test_minimize_loss_with_merge_call_update(n):
    # TF: strategy_test_lib.py DistributionTestBase._test_minimize_loss_eager
    # (mirrored_strategy_test.py / one_device_strategy_test.py testMinimizeLoss): gradients
    # summed across replicas (reduce_to SUM), then kernel -= 0.2 * g in cross-replica context
    d = gd.MirroredStrategy([f"cpu:{i}" for i in range(n)])
    init = np.array([[0.3]], np.float32)
    with d.scope():
        kernel = gd.Variable(init, name="kernel")

    def loss(x):
        y = gd.reshape(gd.matmul(x, kernel), ()) - 1.0
        return y * y

    def update(strategy, g):
        kernel.assign_sub(0.2 * strategy.reduce(SUM, g, axis=None))

    def replica_step(one):
        with gd.GradientTape() as tape:
            value = loss(one)
        g = tape.gradient(value, kernel)
        gd.get_replica_context().merge_call(update, args=(g,))
        return value

    step = gd.function(lambda one: d.run(replica_step, args=(one,)))
    one = np.array([[1.0]], np.float32)
    k = init.astype(np.float64)
    for _ in range(10):
        step(one)
        k = k - 0.2 * n * 2.0 * (k - 1.0)
    error_before = abs(init[0, 0] - 1.0)
    error_after = abs(kernel.numpy()[0, 0] - 1.0)
    assert error_after < error_before
    np.testing.assert_allclose(kernel.numpy(), k, atol=1e-5)
    assert all(np.array_equal(c, kernel.values[0]) for c in kernel.values)


def test_global_step_update(strategy):
    # TF: strategy_test_lib.py DistributionTestBase._test_global_step_update
    # (mirrored_strategy_test.py testGlobalStepUpdate)
    with strategy.scope():
        global_step = gd.Variable(np.int64(0), name="global_step", trainable=False,
                                  aggregation=gd.VariableAggregation.ONLY_FIRST_REPLICA)

    def model_fn():
        global_step.assign_add(1)
        return global_step.read_value()

    values = _local(strategy.run(model_fn))
    assert [int(v) for v in values] == [1] * strategy.num_replicas_in_sync
    assert global_step.dtype == np.int64 and global_step.numpy() == 1


@pytest.mark.parametrize("dtype, aggregation, sync", [
    (np.float64, "mean", "auto"), (np.float64, "only_first_replica", "auto"),
    (np.int64, "sum", "on_read"), (np.float64, "mean", "on_read"), (np.int64, "none", "on_read")])
def test_python_numbers_take_the_variable_dtype_in_replica_assigns(strategy, dtype,
                                                                   aggregation, sync):
    # docs/api.md weak typing: v.assign_add(1) / v.assign(v + 1.0) keep the variable's dtype
    with strategy.scope():
        v = gd.Variable(dtype(0), name="v", aggregation=aggregation, synchronization=sync)

    def model_fn():
        v.assign_add(1)
        v.assign_sub(1.0 if dtype == np.float64 else 1)
        v.assign(v + 1)
        v.assign_add(1)

    strategy.run(model_fn)
    assert v.dtype == dtype
    assert [float(c) for c in v.values] == [2.0, 2.0]
    if dtype == np.int64:
        with pytest.raises(TypeError, match="assign_add to variable 'v'.*float"):
            strategy.run(lambda: v.assign_add(1.5))


def test_optimizer_iterations_and_slots_are_mirrored(strategy):
    # TF: custom_training_loop_optimizer_test.py (optimizer state under a strategy): the
    # iteration count and Adam's slots are mirrored, so every component is identical
    with strategy.scope():
        v = gd.Variable(np.ones(3, np.float32))
        opt = gd.optimizers.Adam(learning_rate=0.1)
    grads = gd.PerReplica([np.array([1.0, 2.0, 3.0], np.float32),
                           np.array([3.0, 2.0, 1.0], np.float32)])
    step = gd.function(lambda g: strategy.run(lambda gg: opt.apply_gradients([(gg, v)]),
                                              args=(g,)))
    for _ in range(3):
        step(grads)
    assert [int(i) for i in opt.iterations.values] == [3, 3]
    # the mean gradient is [2, 2, 2] every step: Adam moves each weight by lr per step
    np.testing.assert_allclose(v.values[0], 1.0 - 0.3, rtol=1e-4)
    assert np.array_equal(v.values[0], v.values[1])


# ---------------------------------------------------------------- correctness vs one device


def _train(strategy, global_batch, steps, inside_function, reduction, average, optimizer="sgd"):
    rng = np.random.default_rng(1337)
    x = rng.random((global_batch * steps, 1)).astype(np.float32)
    y = 3.0 * x
    w0 = (rng.standard_normal((1, 4)) * 0.5).astype(np.float32)
    w1 = (rng.standard_normal((4, 1)) * 0.5).astype(np.float32)
    with strategy.scope():
        w = [gd.Variable(w0), gd.Variable(np.zeros(4, np.float32)), gd.Variable(w1)]
        opt = (gd.optimizers.SGD(0.1, gradient_reduction=reduction) if optimizer == "sgd" else
               gd.optimizers.Adam(0.01, gradient_reduction=reduction))

    def step_fn(inputs):
        samples, labels = inputs
        with gd.GradientTape() as tape:
            logits = gd.relu(samples @ w[0] + w[1]) @ w[2]
            per_example = gd.reduce_mean(gd.square(logits - labels), axis=1)
            if average == "global":
                loss = gd.nn.compute_average_loss(per_example, global_batch_size=global_batch)
            else:
                loss = gd.reduce_mean(per_example)
        grads = tape.gradient(loss, w)
        opt.apply_gradients(zip(grads, w))
        return loss

    dataset = strategy.experimental_distribute_dataset(gd.data.batches((x, y), global_batch))
    op = SUM if average == "global" else MEAN
    if inside_function:
        @gd.function
        def train_epoch():
            total = np.float32(0.0)
            for batch in dataset:
                total = total + strategy.reduce(op, strategy.run(step_fn, args=(batch,)))
            return total / steps
        loss = train_epoch()
    else:
        train_step = gd.function(lambda b: strategy.reduce(op, strategy.run(step_fn, args=(b,))))
        loss = sum(float(train_step(batch)) for batch in dataset) / steps
    return [v.numpy() for v in w], float(loss)


@pytest.mark.parametrize("inside_function", [False, True], ids=["outside", "inside"])
@pytest.mark.parametrize("reduction, average", [("sum", "global"), ("mean", "local")])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_dnn_correctness(inside_function, reduction, average, optimizer):
    # TF: ctl_correctness_test.py TestDistributionStrategyDnnCorrectness
    # test_dnn_correctness_minus_tpus (iteration inside/outside the function): the same
    # weights and loss on 2 replicas as on one device; TF's Keras recipe is
    # compute_average_loss(global_batch_size) with summed gradients
    two = gd.MirroredStrategy(["cpu:0", "cpu:1"])
    one = gd.OneDeviceStrategy("cpu:0")
    wts_dist, loss_dist = _train(two, 8, 2, inside_function, reduction, average, optimizer)
    wts, loss = _train(one, 8, 2, inside_function, reduction, average, optimizer)
    for a, b in zip(wts, wts_dist):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(loss, loss_dist, atol=1e-5, rtol=1e-5)
