"""gd.nn.LSTM and gd.nn.GRU against numpy references of Keras's equations (gate order,
reset_after GRU, return_sequences / return_state), their gradients against finite
differences, and a scan-based step under two replicas."""

import numpy as np
import pytest

import graphdist as gd


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def lstm_np(x, kernel, recurrent, bias):
    units = recurrent.shape[0]
    h = c = np.zeros((x.shape[0], units))
    hs = []
    for t in range(x.shape[1]):
        z = x[:, t] @ kernel + h @ recurrent + bias
        i, f, g, o = (z[:, k * units:(k + 1) * units] for k in range(4))
        c = sigmoid(f) * c + sigmoid(i) * np.tanh(g)
        h = sigmoid(o) * np.tanh(c)
        hs.append(h)
    return np.stack(hs, 1), h, c


def gru_np(x, kernel, recurrent, bias):
    units = recurrent.shape[0]
    h = np.zeros((x.shape[0], units))
    hs = []
    for t in range(x.shape[1]):
        xw = x[:, t] @ kernel + bias[0]
        hu = h @ recurrent + bias[1]
        part = [(a[:, k * units:(k + 1) * units]) for a in (xw, hu) for k in range(3)]
        z = sigmoid(part[0] + part[3])
        r = sigmoid(part[1] + part[4])
        cand = np.tanh(part[2] + r * part[5])
        h = z * h + (1 - z) * cand
        hs.append(h)
    return np.stack(hs, 1), h


def _weights(layer, rng):
    for v in layer.variables:
        v.assign(rng.normal(size=v.shape) * 0.4)
    return [v.numpy() for v in (layer.kernel, layer.recurrent_kernel, layer.bias)]


def test_lstm_matches_keras_equations():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 7, 5))
    layer = gd.nn.LSTM(4, return_sequences=True, return_state=True)
    step = gd.function(lambda x: layer(x))
    step(x)
    assert layer.kernel.shape == (5, 16) and layer.recurrent_kernel.shape == (4, 16)
    weights = _weights(layer, rng)
    seq, h, c = step(x)
    rseq, rh, rc = lstm_np(x, *weights)
    np.testing.assert_allclose(seq, rseq, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(h, rh, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(c, rc, rtol=1e-10, atol=1e-12)


def test_lstm_defaults_last_output_forget_bias_and_orthogonal_kernel():
    layer = gd.nn.LSTM(3)
    out = gd.function(lambda x: layer(x))(np.ones((2, 4, 2), np.float32))
    assert out.shape == (2, 3) and out.dtype == np.float32
    np.testing.assert_array_equal(layer.bias.numpy(), [0, 0, 0, 1, 1, 1] + [0] * 6)
    u = layer.recurrent_kernel.numpy()          # (3, 12): orthonormal rows
    np.testing.assert_allclose(u @ u.T, np.eye(3), atol=1e-5)
    assert u.flags.c_contiguous          # optimizers update variables in place


def test_gru_matches_keras_equations_reset_after():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, 6, 3))
    layer = gd.nn.GRU(5, return_sequences=True, return_state=True)
    step = gd.function(lambda x: layer(x))
    step(x)
    assert layer.bias.shape == (2, 15)
    weights = _weights(layer, rng)
    seq, h = step(x)
    rseq, rh = gru_np(x, *weights)
    np.testing.assert_allclose(seq, rseq, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(h, rh, rtol=1e-10, atol=1e-12)
    last = gd.nn.GRU(5)
    last(x)                                              # eager call
    for mine, theirs in zip(last.variables, layer.variables):
        mine.assign(theirs.numpy())
    np.testing.assert_allclose(last(x), rh, rtol=1e-10)


@pytest.mark.parametrize("cls", ["LSTM", "GRU"])
def test_recurrent_gradients_match_finite_differences(cls):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(2, 4, 3))
    layer = getattr(gd.nn, cls)(3)

    @gd.function
    def grads(x):
        with gd.GradientTape() as tape:
            loss = gd.reduce_sum(layer(x) ** 2.0)
        return tape.gradient(loss, layer.trainable_variables)

    grads(x)
    weights = _weights(layer, rng)
    ref = lstm_np if cls == "LSTM" else gru_np

    def loss(ws):
        return np.sum(ref(x, *ws)[1] ** 2)

    got = grads(x)
    for k, g in enumerate(got):
        num = np.zeros_like(weights[k])
        for i in np.ndindex(num.shape):
            plus = [w.copy() for w in weights]
            minus = [w.copy() for w in weights]
            plus[k][i] += 1e-6
            minus[k][i] -= 1e-6
            num[i] = (loss(plus) - loss(minus)) / 2e-6
        np.testing.assert_allclose(g, num, rtol=1e-5, atol=1e-8)


def test_lstm_training_step_on_two_replicas_matches_one_device():
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(4, 5, 3)), rng.normal(size=(4, 2))
    results = []
    for devices in (["cpu:0"], ["cpu:0", "cpu:1"]):
        strategy = gd.MirroredStrategy(devices)
        with strategy.scope():
            layer = gd.nn.LSTM(2, kernel_initializer=np.full((3, 8), 0.1),
                               recurrent_initializer=np.full((2, 8), -0.2))
            opt = gd.optimizers.SGD(0.1)

        def replica_step(xb, yb):
            with gd.GradientTape() as tape:
                # a mean over this replica's rows: the replicas' gradients are averaged
                loss = gd.reduce_sum((layer(xb) - yb) ** 2.0) / float(xb.shape[0])
            grads = tape.gradient(loss, layer.trainable_variables)
            opt.apply_gradients(zip(grads, layer.trainable_variables))
            return loss

        @gd.function
        def step(xb, yb):
            return strategy.run(replica_step, args=(xb, yb))

        for _ in range(3):
            if len(devices) == 1:
                step(x, y)
            else:
                step(*_split(strategy, x, y, len(devices)))
        results.append([v.numpy() for v in layer.variables])
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-15)


def _split(strategy, x, y, n):
    xs = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.array_split(x, n)[ctx.replica_id_in_sync_group])
    ys = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.array_split(y, n)[ctx.replica_id_in_sync_group])
    return xs, ys
