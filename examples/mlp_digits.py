"""Train a 64-128-10 MLP on the UCI handwritten digits (1,797 8x8 images) with graphdist.

    python examples/mlp_digits.py --steps 300

`graphdist demo` runs this file's `train` and prints the graph of its step.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

import graphdist as gd
from graphdist.datasets import load_digits


def init_params(seed: int = 0, sizes=(64, 128, 10)) -> list[np.ndarray]:
    """He-normal weights and zero biases, as float32 numpy arrays."""
    rng = np.random.default_rng(seed)
    params = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        params.append((rng.standard_normal((fan_in, fan_out)) * np.sqrt(2 / fan_in)).astype(
            np.float32))
        params.append(np.zeros(fan_out, np.float32))
    return params


def forward(params, x):
    """Logits of the MLP; works traced (gd.Tensor) and eagerly (numpy)."""
    w1, b1, w2, b2 = params
    with gd.name_scope("dense1"):
        h = gd.relu(x @ w1 + b1)
    with gd.name_scope("dense2"):
        return h @ w2 + b2


def make_replica_fn(params, optimizer):
    """One replica's step: its shard's mean loss and gradients; the optimizer averages the
    gradients across replicas (its default gradient_reduction="mean")."""
    def replica_fn(x, y):
        with gd.GradientTape() as tape:
            logits = forward(params, x)
            loss = gd.reduce_mean(gd.nn.sparse_softmax_cross_entropy(y, logits))
        grads = tape.gradient(loss, params)
        optimizer.apply_gradients(zip(grads, params))
        return loss

    return replica_fn


def make_train_step(strategy, params, optimizer):
    """A compiled step, called once per batch: the replicas' losses are averaged, so with
    equal shards it is exactly the one-device step."""
    replica_fn = make_replica_fn(params, optimizer)

    @gd.function
    def train_step(batch):
        per_replica = strategy.run(replica_fn, args=batch)
        return strategy.reduce(gd.ReduceOp.MEAN, per_replica, axis=None)

    return train_step


def make_multi_step(strategy, params, optimizer):
    """fn for strategy.experimental_run_steps: the same step, the mean loss of the last one
    kept. The model is so small (a step computes in ~0.2 ms) that calling a compiled step
    per batch from Python would add a third; many steps per call take that away."""
    replica_fn = make_replica_fn(params, optimizer)

    def fn(ctx, x, y):
        ctx.set_last_step_output("loss", strategy.run(replica_fn, args=(x, y)),
                                 gd.ReduceOp.MEAN)

    return fn


def launched_workers() -> int:
    """How many worker processes `graphdist launch` (or mpiexec) started: MPICH's PMI_SIZE."""
    return int(os.environ.get("PMI_SIZE", "1"))


def make_strategy(devices: int, kind: str = "cpu", workers: bool | None = None):
    """`devices` logical CPU devices, or logical GPUs (splitting the physical ones when
    there are fewer). Started as several workers (`graphdist launch -n W`), and unless
    `workers` is False: a MultiWorkerMirroredStrategy with `devices` devices per worker."""
    if workers is None:
        workers = launched_workers() > 1
    if workers and kind == "cpu":
        return gd.MultiWorkerMirroredStrategy([f"cpu:{i}" for i in range(devices)])
    if kind == "gpu" and len(gd.devices("gpu")) < devices:
        gd.config.set_logical_device_count("gpu", devices)
    if devices == 1:
        return gd.OneDeviceStrategy(f"{kind}:0")
    return gd.MirroredStrategy([f"{kind}:{i}" for i in range(devices)])


def accuracy(params, x, y) -> float:
    logits = forward(params, x)          # eager: numpy in, numpy out
    return float(np.mean(np.argmax(logits, axis=1) == y))


def train(devices: int = 1, steps: int = 300, batch_size: int = 128, learning_rate=1e-2,
          seed: int = 0, on_step=None, kind: str = "cpu", steps_per_call: int = 10, workers: bool | None = None) -> dict:
    """Train for `steps` steps on `devices` devices of `kind` ("cpu" or "gpu"),
    `steps_per_call` steps per call of strategy.experimental_run_steps; returns the final
    loss, the loss after each call, the held-out accuracy and the compiled step."""
    x_train, y_train = load_digits("train")
    x_test, y_test = load_digits("test")
    strategy = make_strategy(devices, kind, workers)
    with strategy.scope():
        names = ["dense1/w", "dense1/b", "dense2/w", "dense2/b"]
        params = [gd.Variable(p, name=n) for p, n in zip(init_params(seed), names)]
        optimizer = gd.optimizers.Adam(learning_rate=learning_rate)
    fn = make_multi_step(strategy, params, optimizer)
    data = gd.data.batches((x_train, y_train), batch_size, shuffle=True, seed=seed, repeat=True)
    batches = iter(strategy.experimental_distribute_dataset(data))
    losses, done = [], 0
    while done < steps:
        ctx = strategy.experimental_run_steps(fn, batches, min(steps_per_call, steps - done))
        done += ctx.steps_run
        losses.append(float(ctx.last_step_outputs["loss"]))
        if on_step is not None:
            on_step(done, steps, losses[-1])
    return {"loss": losses[-1], "losses": losses, "accuracy": accuracy(params, x_test, y_test),
            "params": [p.numpy() for p in params], "train_step": ctx.step_function,
            "strategy": strategy}


def traced_step(devices: int = 1):
    """The example's compiled step, traced on one batch (for `graphdist show`):

        graphdist show graphdist.examples.mlp_digits:traced_step --devices 4
    """
    return train(devices, steps=1)["train_step"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args(argv)
    result = train(args.devices, args.steps)
    print(f"loss {result['loss']:.4f}  held-out accuracy {result['accuracy']:.1%}")


if __name__ == "__main__":
    main()
