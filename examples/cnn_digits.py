"""Train a small CNN on the UCI handwritten digits (1,797 8x8 images) with graphdist: the
model of TensorFlow's "Custom training with tf.distribute.Strategy" tutorial, shaped for
8x8 inputs (SAME padding keeps two poolings possible).

    python examples/cnn_digits.py --devices 4 --steps 300

`graphdist demo --model cnn` runs this file's `train` and prints the graph of its step.
"""

from __future__ import annotations

import argparse
import functools

import numpy as np

import graphdist as gd
from graphdist.datasets import load_digits
from graphdist.examples.mlp_digits import make_strategy


def make_model(seed: int = 0, dropout: float = 0.0) -> gd.nn.Sequential:
    """Conv2D 32 3x3 relu, MaxPool, Conv2D 64 3x3 relu, MaxPool, Flatten, Dense 64 relu,
    (Dropout when `dropout` > 0), Dense 10. Seeded He-normal kernels: the same model on every
    replica count. Each replica draws its own dropout masks, so with dropout N replicas are
    no longer the same computation as one device on the global batch."""
    generator = gd.random.Generator(seed)
    he = functools.partial(gd.initializers.he_normal, generator=generator)
    return gd.nn.Sequential([
        gd.nn.Conv2D(32, 3, padding="same", activation="relu", kernel_initializer=he),
        gd.nn.MaxPool2D(2),
        gd.nn.Conv2D(64, 3, padding="same", activation="relu", kernel_initializer=he),
        gd.nn.MaxPool2D(2),
        gd.nn.Flatten(),
        gd.nn.Dense(64, activation="relu", kernel_initializer=he),
        *([gd.nn.Dropout(dropout, seed=seed)] if dropout else []),
        gd.nn.Dense(10, kernel_initializer=he),
    ])


def make_train_step(strategy, model, optimizer):
    """Each replica computes its shard's mean loss and gradients; the optimizer averages the
    gradients across replicas; the replicas' losses are averaged."""

    @gd.function
    def train_step(batch):
        def replica_fn(x, y):
            with gd.GradientTape() as tape:
                logits = model(x, training=True)
                loss = gd.reduce_mean(gd.nn.sparse_softmax_cross_entropy(y, logits))
            variables = model.trainable_variables
            optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
            return loss

        return strategy.reduce(gd.ReduceOp.MEAN, strategy.run(replica_fn, args=batch))

    return train_step


def images(x: np.ndarray) -> np.ndarray:
    """The digits' 64 features as NHWC 8x8x1 images."""
    return x.reshape(-1, 8, 8, 1)


def accuracy(model, x, y) -> float:
    predict = gd.function(lambda x: gd.argmax(model(x, training=False), axis=-1))
    return float(np.mean(predict(images(x)) == y))


def train(devices: int = 1, steps: int = 300, batch_size: int = 128, learning_rate=3e-3,
          seed: int = 0, on_step=None, kind: str = "cpu", dropout: float = 0.0, workers: bool | None = None) -> dict:
    """Train for `steps` steps on `devices` devices of `kind`; returns the final loss,
    held-out accuracy, the trained parameters and the step."""
    x_train, y_train = load_digits("train")
    x_test, y_test = load_digits("test")
    strategy = make_strategy(devices, kind, workers)
    with strategy.scope():
        model = make_model(seed, dropout)
        model(images(x_train[:1]))             # build: variables made under the strategy
        optimizer = gd.optimizers.Adam(learning_rate=learning_rate)
    train_step = make_train_step(strategy, model, optimizer)
    data = gd.data.batches((images(x_train), y_train), batch_size, shuffle=True, seed=seed,
                           repeat=True)
    losses = []
    for step, batch in zip(range(steps), strategy.experimental_distribute_dataset(data)):
        losses.append(float(train_step(batch)))
        if on_step is not None:
            on_step(step + 1, steps, losses[-1])
    return {"loss": losses[-1], "losses": losses, "accuracy": accuracy(model, x_test, y_test),
            "params": [v.numpy() for v in model.trainable_variables],
            "train_step": train_step, "strategy": strategy, "model": model}


def traced_step(devices: int = 1):
    """The example's compiled step, traced on one batch (for `graphdist show`):

        graphdist show graphdist.examples.cnn_digits:traced_step --devices 4
    """
    return train(devices, steps=1)["train_step"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--dropout", type=float, default=0.0)
    args = parser.parse_args(argv)
    result = train(args.devices, args.steps, dropout=args.dropout)
    print(f"loss {result['loss']:.4f}  held-out accuracy {result['accuracy']:.1%}")


if __name__ == "__main__":
    main()
