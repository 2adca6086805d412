"""What every peer script shares: the model sizes, data, and a JSON timing line."""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np

SIZES = (784, 1024, 1024, 10)
BATCH = 512
LR = 1e-3


def data(seed: int = 1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BATCH, SIZES[0])).astype(np.float32)
    y = rng.integers(0, SIZES[-1], BATCH).astype(np.int32)
    return x, y


def init(seed: int = 0, sizes=SIZES):
    """He-normal weights and zero biases of an MLP with these layer sizes."""
    rng = np.random.default_rng(seed)
    params = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        params += [(rng.standard_normal((a, b)) * np.sqrt(2 / a)).astype(np.float32),
                   np.zeros(b, np.float32)]
    return params


def digits():
    """The UCI digits as graphdist.datasets.load_digits() gives them (1,797 x 64 float32
    in [0, 1], int32 labels), read from its file without importing graphdist."""
    from pathlib import Path

    with np.load(Path(__file__).resolve().parents[2] / "graphdist/datasets/digits.npz") as d:
        images, labels = d["images"], d["labels"]
    return (images.reshape(len(images), 64).astype(np.float32) / np.float32(16.0),
            labels.astype(np.int32))


def time_steps(step, sync=lambda r: r, warmup: int = 5, repeat: int = 20,
               settle=lambda: None) -> dict:
    """Median and min of `repeat` steps after `warmup`; `first_call_s` is the first step,
    which traces and compiles (run it in a fresh process to include every cost). settle()
    runs untimed after the first step (graphdist: wait for the kernels loading behind it)."""
    t0 = time.perf_counter()
    sync(step())
    first = time.perf_counter() - t0
    settle()
    for _ in range(warmup - 1):
        sync(step())
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        sync(step())
        samples.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(samples), "min_s": min(samples), "repeat": repeat,
            "first_call_s": first}


def timed_with_losses(step) -> dict:
    """time_steps(step) with the first three losses the steps returned ("losses"), so the
    contenders can be checked to train alike."""
    losses = []
    result = time_steps(step, sync=lambda loss: losses.append(float(loss)))
    return {**result, "losses": losses[:3]}


def jax_step(loss_fn, update, params, state, x, y, n: int):
    """run() -> loss of one training step: jit on one device, or pmap over `n` host devices
    with the gradients and the loss averaged across them (x, y: the global batch)."""
    import jax
    import jax.numpy as jnp

    def one(params, state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        if n > 1:
            grads, loss = jax.lax.pmean(grads, "i"), jax.lax.pmean(loss, "i")
        params, state = update(params, state, grads)
        return params, state, loss

    if n == 1:
        step, carry, xs, ys = jax.jit(one), [params, state], jnp.asarray(x), jnp.asarray(y)
    else:
        step = jax.pmap(one, axis_name="i")
        rep = lambda t: jax.tree_util.tree_map(  # noqa: E731 - one copy per device
            lambda a: jnp.broadcast_to(a, (n,) + jnp.shape(a)), t)
        carry = [rep(params), rep(state)]
        xs, ys = (jnp.asarray(a.reshape((n, len(a) // n) + a.shape[1:])) for a in (x, y))

    def run():
        carry[0], carry[1], loss = step(carry[0], carry[1], xs, ys)
        return loss

    return run


def tf_strategy(n: int, cross_device_ops: str = "reduction_to_one_device"):
    """TF's OneDeviceStrategy, or MirroredStrategy over `n` logical CPU devices."""
    import tensorflow as tf

    if n == 1:
        return tf.distribute.OneDeviceStrategy("/cpu:0")
    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(
        cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(n)])
    ops = {"reduction_to_one_device": tf.distribute.ReductionToOneDevice(),
           "hierarchical_copy": tf.distribute.HierarchicalCopyAllReduce()}[cross_device_ops]
    return tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(n)],
                                          cross_device_ops=ops)


def tf_time_replica_fn(strategy, replica_fn, x, y, reduce_op: str = "MEAN") -> dict:
    """time_steps of `strategy.run(replica_fn)` on the global batch (x, y) as a tf.function
    whose per-replica losses are reduced by `reduce_op`; with the first three losses."""
    import tensorflow as tf

    @tf.function
    def step(batch):
        per_replica = strategy.run(replica_fn, args=batch)
        return strategy.reduce(getattr(tf.distribute.ReduceOp, reduce_op), per_replica,
                               axis=None)

    dataset = tf.data.Dataset.from_tensors((x, y)).repeat()
    batch = next(iter(strategy.experimental_distribute_dataset(dataset)))
    return timed_with_losses(lambda: step(batch))


def one_device_only(script: str, devices: int, why: str = "") -> None:
    """A peer script that runs on one device only refuses --devices N > 1, saying so."""
    if devices != 1:
        raise SystemExit(f"{script}: one device only{f' ({why})' if why else ''}")


def one_device_args(script: str, why: str = "") -> None:
    """The --devices option of a one-device peer script (the benchmarks pass it to every
    peer), refused above 1."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=1)
    one_device_only(script, ap.parse_args().devices, why)


def report(result: dict) -> None:
    print("RESULT " + json.dumps(result))
    sys.stdout.flush()


# ---------------------------------------------------------------- the tutorial CNN
# TF's "Custom training with tf.distribute.Strategy" model on 28x28x1 inputs: Conv2D 32 3x3
# relu, MaxPool 2, Conv2D 64 3x3 relu, MaxPool 2, Flatten, Dense 64 relu, Dense 10 (Keras
# padding "valid"). Parameters in TF's layouts: HWIO kernels, (in, out) dense kernels.
CNN_BATCH = 256
CNN_SHAPES = [(3, 3, 1, 32), (32,), (3, 3, 32, 64), (64,), (5 * 5 * 64, 64), (64,), (64, 10),
              (10,)]


def cnn_data(seed: int = 1):
    rng = np.random.default_rng(seed)
    x = rng.random((CNN_BATCH, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, CNN_BATCH).astype(np.int32)
    return x, y


def cnn_init(seed: int = 0):
    """He-normal kernels (fan in = H*W*I for a conv) and zero biases."""
    rng = np.random.default_rng(seed)
    params = []
    for shape in CNN_SHAPES:
        if len(shape) == 1:
            params.append(np.zeros(shape, np.float32))
        else:
            fan_in = int(np.prod(shape[:-1]))
            params.append((rng.standard_normal(shape) * np.sqrt(2 / fan_in)).astype(np.float32))
    return params


# ---------------------------------------------------------------- the LSTM (bench/lstm.py)
# One Keras LSTM layer (gates i, f, c, o; sigmoid gates, tanh) over (batch, time, width)
# inputs, its last output against a target: loss = sum((h_T - y)^2) / batch, plain SGD.
LSTM_BATCH, LSTM_STEPS, LSTM_WIDTH = 32, 64, 128
LSTM_LR = 0.01


def lstm_data(seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(LSTM_BATCH, LSTM_STEPS, LSTM_WIDTH)).astype(np.float32)
    y = rng.normal(size=(LSTM_BATCH, LSTM_WIDTH)).astype(np.float32)
    return x, y


def lstm_init(seed: int = 1):
    """(kernel (W, 4W), recurrent_kernel (W, 4W), bias (4W,)) in Keras's layout: Glorot-
    uniform kernels, an orthogonal recurrent kernel, the forget gate's bias at 1."""
    rng = np.random.default_rng(seed)
    w = LSTM_WIDTH
    limit = np.sqrt(6 / (w + 4 * w))
    kernel = rng.uniform(-limit, limit, (w, 4 * w)).astype(np.float32)
    q, r = np.linalg.qr(rng.normal(size=(4 * w, w)))
    recurrent = (q * np.sign(np.diag(r))).T.astype(np.float32)
    bias = np.zeros(4 * w, np.float32)
    bias[w:2 * w] = 1
    return kernel, recurrent, bias
