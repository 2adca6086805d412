"""An LSTM (batch 32, sequence 64, width 128) with gd.nn.LSTM on gd.scan against a
hand-written numpy loop of Keras's equations: the forward pass, and a training step
(forward, backward, SGD) on 1 device and on 4 replicas of the same global batch. The
numpy loop is forward only (it has no backward pass to compare with); PyTorch, TF and JAX
are not installed here, so the issue's comparison with them is left to a machine that has
them.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/lstm.py

The backward body's matmuls write into the program's buffers (`np.matmul(a, b.T, out=)`,
transposed operands included). An earlier note said that form ran ~12x slower than without
`out=`; on numpy 2.4.6 it does not: the same calls, shapes and strides timed alone take the
same time with and without `out=`, and the whole training step with matmul's `out=` forms
disabled (fresh arrays) is no faster (17.3 vs 17.0 ms on 1 device, 27.0 vs 26.6 ms on 4
replicas, interleaved in one process). numpy >= 2.0 hands transposed and strided operands to
BLAS (numpy PR 23752), so nothing in the lowering needs changing for it.
"""

import time

import numpy as np

import graphdist as gd

BATCH, STEPS, WIDTH = 32, 64, 128


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def lstm_numpy(x, kernel, recurrent, bias):
    units = recurrent.shape[0]
    h = c = np.zeros((x.shape[0], units), x.dtype)
    batch, steps, features = x.shape
    projected = (x.transpose(1, 0, 2).reshape(-1, features) @ kernel).reshape(
        steps, batch, -1) + bias
    for t in range(x.shape[1]):
        z = projected[t] + h @ recurrent
        i, f, g, o = np.split(z, 4, axis=1)
        c = sigmoid(f) * c + sigmoid(i) * np.tanh(g)
        h = sigmoid(o) * np.tanh(c)
    return h


def best(fn, *args, repeat=7):
    fn(*args)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return min(times)


def train_step(devices, x, y, seed=None):
    """A training step of gd.nn.LSTM; `seed` fixes its initial weights."""
    strategy = gd.MirroredStrategy(devices)
    with strategy.scope():
        if seed is not None:
            gd.random.set_global_generator(gd.random.Generator.from_seed(seed))
        layer = gd.nn.LSTM(WIDTH)
        opt = gd.optimizers.SGD(0.01)

    def replica_step(xb, yb):
        with gd.GradientTape() as tape:
            loss = gd.reduce_sum((layer(xb) - yb) ** 2.0) / float(xb.shape[0])
        grads = tape.gradient(loss, layer.trainable_variables)
        opt.apply_gradients(zip(grads, layer.trainable_variables))
        return loss

    @gd.function
    def step(xb, yb):
        return strategy.run(replica_step, args=(xb, yb))

    n = len(devices)
    if n == 1:
        return lambda: step(x, y)
    xs = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.array_split(x, n)[ctx.replica_id_in_sync_group])
    ys = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.array_split(y, n)[ctx.replica_id_in_sync_group])
    return lambda: step(xs, ys)


def main():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, STEPS, WIDTH)).astype(np.float32)
    y = rng.normal(size=(BATCH, WIDTH)).astype(np.float32)
    layer = gd.nn.LSTM(WIDTH)
    forward = gd.function(lambda x: layer(x))
    got = forward(x)
    weights = [v.numpy() for v in (layer.kernel, layer.recurrent_kernel, layer.bias)]
    np.testing.assert_allclose(got, lstm_numpy(x, *weights), rtol=1e-4, atol=1e-5)
    t_gd, t_np = best(forward, x), best(lstm_numpy, x, *weights)
    print(f"forward  gd.nn.LSTM {t_gd * 1e3:6.2f} ms   numpy loop {t_np * 1e3:6.2f} ms   "
          f"ratio {t_gd / t_np:.2f}x")
    for devices in (["cpu:0"], [f"cpu:{i}" for i in range(4)]):
        step = train_step(devices, x, y)
        print(f"training step on {len(devices)} device(s): {best(step) * 1e3:6.2f} ms "
              f"(forward + backward + SGD, global batch {BATCH})")


if __name__ == "__main__":
    main()
