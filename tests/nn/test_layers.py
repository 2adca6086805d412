"""Tests for the gd.nn layers: numpy references, Keras names, variables made on first call
under a strategy (also mid-trace), training= behaviour, a small CNN on 4 replicas equal to one
device, checkpoints across replica counts, and the error messages."""

from __future__ import annotations

import re

import numpy as np
import pytest

import graphdist as gd

DEV4 = ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]


def _data(shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def _one_batch(strategy, *arrays):
    return next(iter(strategy.experimental_distribute_dataset([arrays])))


def _train(strategy, model, opt, loss_fn=None):
    """A compiled step: per-replica mean loss, gradients, the optimizer's update."""
    loss_fn = loss_fn or (lambda y, out: gd.nn.sparse_softmax_cross_entropy(y, out))

    @gd.function
    def step(batch):
        def replica_fn(x, y):
            with gd.GradientTape() as tape:
                loss = gd.reduce_mean(loss_fn(y, model(x, training=True)))
            variables = model.trainable_variables
            opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
            return loss

        return strategy.reduce("mean", strategy.run(replica_fn, args=batch))

    return step


# ---------------------------------------------------------------- single layers


def test_dense_matches_numpy_with_keras_names_and_initializers():
    x = _data((5, 3))
    dense = gd.nn.Dense(4, activation="relu")
    y = dense(x)
    assert re.fullmatch(r"dense(_\d+)?", dense.name)
    assert [v.name for v in dense.variables] == [f"{dense.name}/kernel", f"{dense.name}/bias"]
    kernel, bias = dense.kernel.numpy(), dense.bias.numpy()
    assert kernel.shape == (3, 4) and np.all(np.abs(kernel) <= np.sqrt(6 / 7)) and kernel.std()
    np.testing.assert_array_equal(bias, 0)
    np.testing.assert_allclose(y, np.maximum(x @ kernel + bias, 0), rtol=1e-6)
    np.testing.assert_allclose(dense(_data((2, 5, 3))),             # leading axes: as Keras
                               np.maximum(_data((2, 5, 3)) @ kernel, 0), rtol=1e-5, atol=1e-6)
    other = gd.nn.Dense(2, use_bias=False, kernel_initializer="zeros")
    assert other.name != dense.name and re.fullmatch(r"dense_\d+", other.name)
    np.testing.assert_array_equal(other(x), np.zeros((5, 2), np.float32))
    assert [v.name for v in other.variables] == [f"{other.name}/kernel"]


def test_flatten_pool_and_conv_names():
    assert gd.nn.Flatten()(np.ones((2, 3, 4), np.float32)).shape == (2, 12)
    assert re.fullmatch(r"conv2d(_\d+)?", gd.nn.Conv2D(2, 3).name)
    assert re.fullmatch(r"max_pooling2d(_\d+)?", gd.nn.MaxPool2D().name)
    assert re.fullmatch(r"average_pooling2d(_\d+)?", gd.nn.AvgPool2D().name)
    assert gd.nn.Dense(1, name="head").name == "head"


def test_conv_and_pool_layers_match_the_ops():
    x = _data((2, 6, 6, 3))
    conv = gd.nn.Conv2D(4, (3, 2), strides=2, padding="same", activation="tanh")
    y = conv(x)
    assert conv.kernel.shape == (3, 2, 3, 4) and conv.bias.shape == (4,)
    want = np.tanh(gd.nn.conv2d(x, conv.kernel.numpy(), strides=2, padding="SAME")
                   + conv.bias.numpy())
    np.testing.assert_allclose(y, want, rtol=1e-6)
    np.testing.assert_array_equal(gd.nn.MaxPool2D(3, 1, "same")(x),
                                  gd.nn.max_pool2d(x, 3, 1, "SAME"))
    np.testing.assert_array_equal(gd.nn.AvgPool2D()(x), gd.nn.avg_pool2d(x, 2, 2, "VALID"))
    assert gd.nn.MaxPool2D()(x).shape == (2, 3, 3, 3)


def test_training_flag_switches_dropout_and_batch_norm():
    x = _data((64, 8)) + 3.0
    drop = gd.nn.Dropout(0.5, seed=3)
    np.testing.assert_array_equal(drop(x), x)
    np.testing.assert_array_equal(drop(x, training=False), x)
    y = drop(x, training=True)
    kept = y != 0
    assert 0.3 < kept.mean() < 0.7
    np.testing.assert_allclose(y[kept], 2 * x[kept], rtol=1e-6)
    assert not np.array_equal(drop(x, training=True) != 0, kept)      # a new mask per call
    model = gd.nn.Sequential([gd.nn.BatchNorm(momentum=0.0), gd.nn.Dropout(0.5, seed=1)])
    step = gd.function(lambda x, training: model(x, training=training))
    out = step(x, True)                          # batch statistics, then dropout
    assert np.mean(out == 0) > 0.3 and abs(out[out != 0].mean()) < 0.5
    # momentum 0: the moving statistics are now the batch's; no dropout in inference
    np.testing.assert_allclose(step(x, False), (x - x.mean(0)) / np.sqrt(x.var(0) + 1e-3),
                               rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- under a strategy


def test_variables_made_mid_trace_are_mirrored_and_moving_stats_not_trainable():
    strategy = gd.MirroredStrategy(DEV4)
    model = gd.nn.Sequential([gd.nn.Conv2D(3, 3, padding="same"), gd.nn.BatchNorm(),
                              gd.nn.Flatten(), gd.nn.Dense(2)])
    with strategy.scope():
        opt = gd.optimizers.SGD(0.1)
    step = _train(strategy, model, opt)
    assert model.variables == []
    step(_one_batch(strategy, _data((8, 4, 4, 2)), np.arange(8) % 2))   # built in the trace
    conv, bn, _, dense = model.layers
    names = [v.name for v in model.variables]
    assert names == [f"{conv.name}/kernel", f"{conv.name}/bias", f"{bn.name}/gamma",
                     f"{bn.name}/beta", f"{bn.name}/moving_mean", f"{bn.name}/moving_variance",
                     f"{dense.name}/kernel", f"{dense.name}/bias"]
    assert all(len(v.values) == 4 for v in model.variables)
    assert model.trainable_variables == [v for v in model.variables if "moving" not in v.name]
    assert model.non_trainable_variables == [bn.moving_mean, bn.moving_variance]
    assert bn.moving_mean.synchronization == gd.VariableSynchronization.ON_READ
    assert bn.moving_mean.aggregation == gd.VariableAggregation.MEAN
    for v in model.trainable_variables:
        for component in v.values[1:]:
            np.testing.assert_array_equal(component, v.values[0])
    assert step.trace_count == 1
    step(_one_batch(strategy, _data((8, 4, 4, 2), 1), np.arange(8) % 2))
    assert step.trace_count == 1                 # the variables exist now: no retrace


def test_small_cnn_on_4_replicas_equals_one_device():
    x, y = _data((16, 6, 6, 2)), np.arange(16) % 3
    runs = []
    for strategy in (gd.MirroredStrategy(DEV4), gd.OneDeviceStrategy("cpu:0")):
        with strategy.scope():
            gd.random.set_global_generator(gd.random.Generator(7))   # the same weights each run
            model = gd.nn.Sequential([
                gd.nn.Conv2D(4, 3, padding="same", activation="relu"), gd.nn.MaxPool2D(),
                gd.nn.Flatten(), gd.nn.Dropout(0.0), gd.nn.Dense(3)])
            model(x[:1])                         # build eagerly, to give both the same weights
            opt = gd.optimizers.SGD(0.5, momentum=0.9)
        for v, w in zip(model.variables, runs[0][1].variables if runs else []):
            v.assign(w.numpy())
        runs.append((strategy, model, _train(strategy, model, opt)))
    losses = [[step(_one_batch(s, x, y)) for _ in range(3)] for s, _, step in runs]
    models = [model for _, model, _ in runs]
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
    assert losses[0][2] < losses[0][0]
    for v4, v1 in zip(models[0].variables, models[1].variables):
        assert len(v4.values) == 4
        np.testing.assert_allclose(v4.numpy(), v1.numpy(), rtol=1e-5, atol=1e-6)
        for component in v4.values[1:]:          # mirrored components stay bit-identical
            np.testing.assert_array_equal(component, v4.values[0])


def test_layer_checkpoint_restores_onto_2_and_1_replicas(tmp_path):
    def make(devices):
        strategy = gd.MirroredStrategy(devices)
        with strategy.scope():
            model = gd.nn.Sequential([gd.nn.Dense(4, activation="relu"), gd.nn.BatchNorm(),
                                      gd.nn.Dense(2)])
            opt = gd.optimizers.Adam(0.05)
        return strategy, model, opt

    x, y = _data((8, 3)), np.arange(8) % 2
    strategy, model, opt = make(DEV4)
    with pytest.raises(gd.CheckpointError, match=r"Dense '.*' has no variables yet \(a layer "
                                                 r"makes them on its first call\)"):
        gd.Checkpoint(model=model).save(tmp_path / "unbuilt.npz")
    step = _train(strategy, model, opt)
    for _ in range(2):
        step(_one_batch(strategy, x, y))
    bn = model.layers[1]
    assert not np.array_equal(bn.moving_mean.values[0], bn.moving_mean.values[1])
    saved = {i: v.numpy() for i, v in enumerate(model.variables)}
    path = gd.Checkpoint(model=model, opt=opt).save(tmp_path / "layers.npz")
    with np.load(path) as f:                     # structural keys: any instance restores
        assert {"model/layers/0/kernel", "model/layers/1/moving_mean",
                "opt/slots/model/layers/2/bias/m"} <= set(f.files)
    for devices in (DEV4[:2], DEV4[:1]):
        strategy2, model2, opt2 = make(devices)
        with strategy2.scope():
            model2(x[:1])                        # build (other names: dense_7, ...)
        gd.Checkpoint(model=model2, opt=opt2).restore(path)
        for i, v in enumerate(model2.variables):
            assert len(v.values) == len(devices)
            for component in v.values:           # moving stats: the 4 replicas' mean
                np.testing.assert_allclose(component, saved[i], rtol=1e-6, err_msg=v.name)
        assert int(opt2.iterations.numpy()) == 2 and len(opt2._slots) == 2 * 6
        _train(strategy2, model2, opt2)(_one_batch(strategy2, x, y))    # and trains on


# ---------------------------------------------------------------- errors


def test_clear_errors():
    conv = gd.nn.Conv2D(2, 3, name="c1")
    with pytest.raises(gd.ShapeError, match=r"Conv2D 'c1': expected a rank-4 input, got shape "
                                            r"\(2, 5, 5\)"):
        conv(np.ones((2, 5, 5), np.float32))
    conv(np.ones((1, 5, 5, 3), np.float32))
    with pytest.raises(gd.ShapeError, match=r"Conv2D 'c1': was built for inputs of shape "
                                            r"\(1, 5, 5, 3\) \(axis -1 of size 3\), got shape "
                                            r"\(1, 5, 5, 4\)"):
        conv(np.ones((1, 5, 5, 4), np.float32))
    dense = gd.nn.Dense(2, name="d1")
    dense(np.ones((1, 3), np.float32))
    with pytest.raises(gd.ShapeError, match=r"Dense 'd1': was built .* got shape \(1, 4\)"):
        gd.function(lambda x: dense(x))(np.ones((1, 4), np.float32))
    with pytest.raises(gd.ShapeError, match=r"Dense 'd1': expected an input of rank >= 2"):
        dense(np.ones(3, np.float32))
    with pytest.raises(ValueError, match=r"Conv2D '.*': padding must be 'valid' or 'same', "
                                         r"got 'full'"):
        gd.nn.Conv2D(2, 3, padding="full")
    with pytest.raises(ValueError, match=r"MaxPool2D '.*': padding must be"):
        gd.nn.MaxPool2D(padding="causal")
    with pytest.raises(ValueError, match="BatchNorm 'b1': axis -3 is out of range"):
        gd.nn.BatchNorm(axis=-3, name="b1")(np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match="unknown activation 'swishy'"):
        gd.nn.Dense(2, activation="swishy")
    with pytest.raises(ValueError, match="unknown initializer 'glorot'"):
        gd.nn.Dense(2, kernel_initializer="glorot")(np.ones((1, 3), np.float32))
    with pytest.raises(ValueError, match=r"Dropout '.*': rate must be in \[0, 1\)"):
        gd.nn.Dropout(1.0)
    with pytest.raises(TypeError, match="expected a gd.nn layer"):
        gd.nn.Sequential([lambda x: x])


@pytest.mark.parametrize("make, shape", [
    (lambda: gd.nn.Dense(3), (4, 5)),
    (lambda: gd.nn.LSTM(6), (2, 3, 5)),
    (lambda: gd.nn.LayerNorm(), (4, 5)),
])
def test_a_layer_built_by_hand_keeps_the_weights_assigned_to_it(make, shape):
    """Keras's `layer.build(shape)` then setting its weights: the first call uses those
    (it used to build again and drop them silently)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32)
    layer = make()
    layer.build(shape)
    assert layer.built and layer.input_shape == shape
    made = list(layer.variables)
    for v in made:
        v.assign(rng.standard_normal(v.shape).astype(np.float32))
    chosen = [v.numpy().copy() for v in made]
    eager = layer(x)
    assert [id(v) for v in layer.variables] == [id(v) for v in made]
    twin = make()                       # the same weights through the first-call build
    twin(x)
    for v, value in zip(twin.variables, chosen):
        v.assign(value)
    np.testing.assert_allclose(np.asarray(eager), np.asarray(twin(x)), rtol=1e-6, atol=1e-6)
    if isinstance(layer, gd.nn.Dense):  # and by hand: x @ kernel + bias
        np.testing.assert_allclose(np.asarray(eager), x @ chosen[0] + chosen[1], rtol=1e-5,
                                   atol=1e-5)
