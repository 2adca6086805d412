"""gd.nn.Model.fit / evaluate / predict against a numpy reference of the same updates: a
two-layer MLP trained with SGD (momentum) on 1, 2 and 4 replicas, over 22 examples in
batches of 8 (the last batch, 6, is partial and splits 2, 2, 1, 1 on 4 replicas), with the
loss reduction fit owns; evaluate counts each example once (empty shards included) and
predict returns the rows in order."""

import numpy as np
import pytest

import graphdist as gd

rng = np.random.default_rng(3)
N, D, H, C = 22, 5, 6, 3
X = rng.normal(size=(N, D)).astype(np.float32)
Y = rng.integers(0, C, N)
W1 = (rng.normal(size=(D, H)) * 0.5).astype(np.float32)
B1 = (rng.normal(size=H) * 0.1).astype(np.float32)
W2 = (rng.normal(size=(H, C)) * 0.5).astype(np.float32)
B2 = (rng.normal(size=C) * 0.1).astype(np.float32)
LR, MOMENTUM = 0.2, 0.9


@pytest.fixture(autouse=True)
def _float32_policy():
    yield
    gd.config.set_precision("float32")


def _strategy(n):
    return gd.MirroredStrategy([f"cpu:{i}" for i in range(n)])


def _sequential():
    return gd.nn.Sequential([
        gd.nn.Dense(H, activation="relu", kernel_initializer=W1, bias_initializer=B1),
        gd.nn.Dense(C, kernel_initializer=W2, bias_initializer=B2)])


class TwoLayers(gd.nn.Model):
    def __init__(self):
        super().__init__()
        self.hidden = gd.nn.Dense(H, activation="relu", kernel_initializer=W1,
                                  bias_initializer=B1)
        self.out = gd.nn.Dense(C, kernel_initializer=W2, bias_initializer=B2)

    def call(self, x, training=False):
        return self.out(self.hidden(x))


def _compiled(n, reduction="mean", steps_per_execution=1, make=_sequential, metrics=("accuracy",)):
    strategy = _strategy(n)
    with strategy.scope():
        model = make()
        model.compile(gd.optimizers.SGD(LR, momentum=MOMENTUM, gradient_reduction=reduction),
                      gd.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=list(metrics), steps_per_execution=steps_per_execution)
    return model


def _reference(epochs, batch_size, order=None):
    """float64 numpy: the same SGD-with-momentum updates on the mean loss of each global
    batch; per epoch the mean loss and accuracy over its examples (before each update)."""
    params = [W1.astype(np.float64), B1.astype(np.float64), W2.astype(np.float64),
              B2.astype(np.float64)]
    buffers = [np.zeros_like(p) for p in params]
    history = {"loss": [], "accuracy": []}
    for epoch in range(epochs):
        index = np.arange(N) if order is None else order(epoch)
        losses, hits = [], []
        for start in range(0, N, batch_size):
            rows = index[start:start + batch_size]
            x, y = X[rows].astype(np.float64), Y[rows]
            w1, b1, w2, b2 = params
            h = np.maximum(x @ w1 + b1, 0)
            z = h @ w2 + b2
            p = np.exp(z - z.max(1, keepdims=True))
            p /= p.sum(1, keepdims=True)
            losses += list(-np.log(p[np.arange(len(y)), y]))
            hits += list(np.argmax(z, 1) == y)
            dz = (p - np.eye(C)[y]) / len(y)
            dh = (dz @ w2.T) * (h > 0)
            grads = [x.T @ dh, dh.sum(0), h.T @ dz, dz.sum(0)]
            for k, g in enumerate(grads):
                buffers[k] = MOMENTUM * buffers[k] + g
                params[k] = params[k] - LR * buffers[k]
        history["loss"].append(np.mean(losses))
        history["accuracy"].append(np.mean(hits))
    return params, history


def _check(model, history, params, ref_history):
    for got, want in zip(model.get_weights(), params):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(history.history[key], ref_history[key], rtol=1e-5)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_fit_matches_numpy_on_replicas_with_a_partial_last_batch(n):
    model = _compiled(n)
    history = model.fit(X, Y, batch_size=8, epochs=3, shuffle=False, verbose=0)
    _check(model, history, *_reference(3, 8))
    assert history.epoch == [0, 1, 2]
    assert model.optimizer.iterations.numpy() == 9


@pytest.mark.parametrize("n", [2, 4])
def test_sum_reduction_and_steps_per_execution(n):
    model = _compiled(n, reduction="sum", steps_per_execution=2)
    history = model.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    _check(model, history, *_reference(2, 8))


def test_subclassed_model_on_uneven_batches():
    model = _compiled(4, make=TwoLayers)
    history = model.fit(X, Y, batch_size=7, epochs=2, shuffle=False, verbose=0)  # 7 7 7 1
    _check(model, history, *_reference(2, 7))


def test_fit_on_an_iterable_of_global_batches():
    model = _compiled(2)
    batches = [(X[i:i + 8], Y[i:i + 8]) for i in range(0, N, 8)]
    history = model.fit(batches, epochs=2, verbose=0)
    _check(model, history, *_reference(2, 8))


def test_shuffled_fit_is_one_device_on_any_replica_count():
    """The data order comes from the strategy's global generator: seeded, 1 and 4 replicas
    see the same batches and end with the same weights."""
    weights, orders = [], []
    for n in (1, 4):
        model = _compiled(n)
        with model.distribute_strategy.scope():
            gd.random.set_global_generator(gd.random.Generator(11))
        model.fit(X, Y, batch_size=8, epochs=2, verbose=0)
        weights.append(model.get_weights())
        orders.append(model._data_seed)
    assert orders[0] == orders[1]
    for a, b in zip(*weights):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
    seed = orders[0]
    params, _ = _reference(2, 8, lambda e: np.random.default_rng([seed, e]).permutation(N))
    for got, want in zip(weights[0], params):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def test_validation_values_are_evaluate_of_the_epochs_weights():
    model = _compiled(2)
    history = model.fit(X[:16], Y[:16], batch_size=8, epochs=2, verbose=0, shuffle=False,
                        validation_data=(X[16:], Y[16:]))
    loss, accuracy = model.evaluate(X[16:], Y[16:], batch_size=4)
    assert history.history["val_loss"][-1] == pytest.approx(loss, rel=1e-6)
    assert history.history["val_accuracy"][-1] == pytest.approx(accuracy)
    assert sorted(history.history) == ["accuracy", "loss", "val_accuracy", "val_loss"]


@pytest.mark.parametrize("n", [1, 2, 4])
def test_evaluate_counts_every_example_once(n):
    """10 rows in batches of 4 on 4 replicas: the last batch gives two replicas no row."""
    x = rng.normal(size=(10, 3)).astype(np.float32)
    y = rng.normal(size=(10, 3)).astype(np.float32)
    strategy = _strategy(n)
    with strategy.scope():
        model = gd.nn.Sequential([gd.nn.Dense(3, kernel_initializer=np.eye(3, dtype=np.float32))])
        model.compile(gd.optimizers.SGD(0.1), "mae", metrics=["mse"])
    result = model.evaluate(x, y, batch_size=4, return_dict=True)
    assert result["loss"] == pytest.approx(np.mean(np.abs(x - y)), rel=1e-6)
    assert result["mse"] == pytest.approx(np.mean((x - y) ** 2), rel=1e-6)
    assert model.metrics[0].count.numpy() == 10
    assert model.evaluate(x, y, batch_size=3) == pytest.approx([result["loss"], result["mse"]],
                                                               rel=1e-6)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_predict_returns_rows_in_order(n):
    x = rng.normal(size=(10, 3)).astype(np.float32)
    strategy = _strategy(n)
    with strategy.scope():
        model = gd.nn.Sequential([gd.nn.Dense(3, kernel_initializer=np.eye(3, dtype=np.float32))])
    np.testing.assert_array_equal(model.predict(x, batch_size=3), x)


def test_predict_on_an_iterable_of_batches_ignores_labels():
    strategy = _strategy(2)
    with strategy.scope():
        model = gd.nn.Sequential([gd.nn.Dense(3, kernel_initializer=np.eye(3, dtype=np.float32))])
    x = rng.normal(size=(7, 3)).astype(np.float32)
    np.testing.assert_array_equal(model.predict(iter([(x[:4], None), (x[4:], None)])), x)
    np.testing.assert_array_equal(model.predict([x[:3], x[3:]]), x)


def test_mixed_float16_compile_wraps_the_optimizer():
    gd.config.set_precision("mixed_float16")
    model = _compiled(2)
    assert isinstance(model.optimizer, gd.optimizers.LossScaleOptimizer)
    history = model.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    _, ref = _reference(2, 8)
    np.testing.assert_allclose(history.history["loss"], ref["loss"], rtol=2e-2)


def test_loss_scale_honours_gradient_accumulation():
    model = _compiled(4, reduction="sum")
    assert model._loss_scale(8) == np.float32(1 / 8)
    model.optimizer.gradient_accumulation_steps = 2       # as the optimizers will have it
    assert model._loss_scale(8) == np.float32(1 / 16)
    mean = _compiled(4)
    assert mean._loss_scale(6) == np.float32(4 / 6)


def test_a_loss_that_is_not_per_example_is_refused():
    strategy = _strategy(1)
    with strategy.scope():
        model = _sequential()
        model.compile(gd.optimizers.SGD(0.1), lambda y, p: gd.reduce_mean(p))
    with pytest.raises(gd.ShapeError, match="one value per example"):
        model.fit(X, Y, batch_size=8, verbose=0)


def test_compile_under_another_strategy_than_the_variables_says_so():
    model = _sequential()
    model(X[:1])                                   # built outside any strategy
    with _strategy(2).scope():
        with pytest.raises(ValueError, match="made its variables under .*same strategy.scope"):
            model.compile(gd.optimizers.SGD(0.1), "mse")


def test_fit_before_compile_says_so():
    with pytest.raises(RuntimeError, match="call compile"):
        _sequential().fit(X, Y)


def test_progress_bar_shows_running_loss_and_metrics(capsys):
    model = _compiled(2)
    model.fit(X, Y, batch_size=8, epochs=2, verbose=1, shuffle=False)
    out = capsys.readouterr().out
    assert "Epoch 1/2" in out and "Epoch 2/2" in out
    assert "3/3" in out and "loss" in out and "accuracy" in out
    model.fit(X, Y, batch_size=8, epochs=1, verbose=0)
    assert capsys.readouterr().out == ""


def test_losses_by_name_against_numpy():
    p = rng.dirichlet(np.ones(4), 6).astype(np.float32)
    y = rng.integers(0, 4, 6)
    np.testing.assert_allclose(gd.losses.sparse_categorical_crossentropy(y, p),
                               -np.log(p[np.arange(6), y]), rtol=1e-5)
    np.testing.assert_allclose(gd.losses.categorical_crossentropy(np.eye(4)[y], p),
                               -np.log(p[np.arange(6), y]), rtol=1e-5)
    q = rng.random((6, 1)).astype(np.float32)
    b = rng.integers(0, 2, (6, 1))
    np.testing.assert_allclose(gd.losses.binary_crossentropy(b, q),
                               -np.mean(b * np.log(q) + (1 - b) * np.log(1 - q), -1), rtol=1e-5)
    logits = rng.normal(size=(6, 1)).astype(np.float32)
    np.testing.assert_allclose(gd.losses.BinaryCrossentropy(from_logits=True).call(b, logits),
                               gd.losses.binary_crossentropy(b, 1 / (1 + np.exp(-logits))),
                               rtol=1e-5)


def test_sequence_losses_average_over_every_element_and_endless_input():
    """A (batch, time) loss: each example's mean over time, so the step's loss is the mean
    over every element (Keras's); an endless generator with steps_per_epoch is read on
    across epochs."""
    vocab, time_steps = 5, 4
    data = np.random.default_rng(1)
    ids = data.integers(0, vocab, (12, time_steps))
    targets = data.integers(0, vocab, (12, time_steps))

    def endless():
        while True:
            for start in range(0, 12, 4):
                yield ids[start:start + 4], targets[start:start + 4]

    strategy = _strategy(2)
    with strategy.scope():
        model = gd.nn.Sequential([gd.nn.Embedding(vocab, 3), gd.nn.Dense(vocab)])
        model.compile(gd.optimizers.SGD(0.0),
                      gd.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(endless(), epochs=2, steps_per_epoch=2, verbose=0)
    logits = model.predict(ids)
    logp = logits - np.log(np.sum(np.exp(logits), -1, keepdims=True))
    per_element = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    # epoch 0 saw batches 0 and 1, epoch 1 batches 2 and 0 (learning rate 0: fixed model)
    np.testing.assert_allclose(history.history["loss"],
                               [per_element[:8].mean(), np.r_[per_element[8:],
                                                              per_element[:4]].mean()],
                               rtol=1e-5)


def _accumulated_reference_16(epochs, batch_size, k, rows=16):
    """SGD with momentum applied every k batches with the mean of the k batch-mean
    gradients (the optimizer's gradient_accumulation_steps with the mean reduction)."""
    params = [W1.astype(np.float64), B1.astype(np.float64), W2.astype(np.float64),
              B2.astype(np.float64)]
    buffers = [np.zeros_like(p) for p in params]
    window, seen = [np.zeros_like(p) for p in params], 0
    for _ in range(epochs):
        for start in range(0, rows, batch_size):
            x, y = X[start:start + batch_size].astype(np.float64), Y[start:start + batch_size]
            w1, b1, w2, b2 = params
            h = np.maximum(x @ w1 + b1, 0)
            z = h @ w2 + b2
            p = np.exp(z - z.max(1, keepdims=True))
            p /= p.sum(1, keepdims=True)
            dz = (p - np.eye(C)[y]) / len(y)
            dh = (dz @ w2.T) * (h > 0)
            for j, g in enumerate([x.T @ dh, dh.sum(0), h.T @ dz, dz.sum(0)]):
                window[j] = window[j] + g
            seen += 1
            if seen == k:
                for j in range(4):
                    buffers[j] = MOMENTUM * buffers[j] + window[j] / k
                    params[j] = params[j] - LR * buffers[j]
                window, seen = [np.zeros_like(p) for p in params], 0
    return params


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("steps_per_execution", [1, 2])
def test_fit_honours_gradient_accumulation(steps_per_execution, reduction):
    """Either reduction: one update per 2 batches, as one step on the 2 batches together
    (fit's loss factor is 1 / (2 global batches) under the sum reduction)."""
    strategy = _strategy(2)
    with strategy.scope():
        model = _sequential()
        model.compile(gd.optimizers.SGD(LR, momentum=MOMENTUM, gradient_accumulation_steps=2,
                                        gradient_reduction=reduction),
                      gd.losses.SparseCategoricalCrossentropy(from_logits=True),
                      steps_per_execution=steps_per_execution)
    model.fit(X[:16], Y[:16], batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert model.optimizer.iterations.numpy() == 2
    for got, want in zip(model.get_weights(), _accumulated_reference_16(2, 8, 2)):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
