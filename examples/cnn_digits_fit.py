"""TensorFlow's tutorial "Custom training with tf.distribute.Strategy", re-created with
Model.fit: the tutorial's CNN (examples/cnn_digits.py's model, shaped for the 8x8 UCI
digits) made and compiled inside strategy.scope(), trained with fit (validation each epoch,
weights saved every epoch, a backup to resume from), then evaluated.

    python examples/cnn_digits_fit.py --devices 4 --epochs 12 --checkpoints /tmp/cnn

Where the tutorial's custom loop computes the loss with `reduction=NONE` and
`tf.nn.compute_average_loss`, builds train/test accuracy from metrics and reduces them by
hand, fit owns all of it: the loss of each step is the sum over every replica's examples
divided by the global batch size (the last, partial batch included), and the epoch's loss
and accuracy are means over its examples, read from sync-on-read metrics.
"""

from __future__ import annotations

import argparse
import os

import graphdist as gd
from graphdist.datasets import load_digits
from graphdist.examples.cnn_digits import images, make_model
from graphdist.examples.mlp_digits import make_strategy


def compiled_model(strategy, learning_rate=3e-3, seed: int = 0, steps_per_execution: int = 1):
    """The tutorial's model and optimizer, made and compiled under the strategy's scope."""
    with strategy.scope():
        model = make_model(seed)
        model.compile(optimizer=gd.optimizers.Adam(learning_rate=learning_rate),
                      loss=gd.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"], steps_per_execution=steps_per_execution)
        gd.random.set_global_generator(gd.random.Generator(seed))   # the shuffling's seed
    return model


def train(devices: int = 1, epochs: int = 12, batch_size: int = 128, learning_rate=3e-3,
          seed: int = 0, checkpoints: str | None = None, verbose: int = 0,
          workers: bool | None = None) -> dict:
    """fit for `epochs` epochs on `devices` devices; returns the history, the held-out loss
    and accuracy (evaluate) and the model."""
    x_train, y_train = load_digits("train")
    x_test, y_test = load_digits("test")
    strategy = make_strategy(devices, "cpu", workers)
    model = compiled_model(strategy, learning_rate, seed)
    callbacks = []
    if checkpoints:
        callbacks = [gd.callbacks.ModelCheckpoint(
                         os.path.join(checkpoints, "weights-{epoch:02d}.safetensors")),
                     gd.callbacks.BackupAndRestore(os.path.join(checkpoints, "backup"))]
    history = model.fit(images(x_train), y_train, batch_size=batch_size, epochs=epochs,
                        validation_data=(images(x_test), y_test), callbacks=callbacks,
                        verbose=verbose)
    loss, accuracy = model.evaluate(images(x_test), y_test, batch_size=256)
    return {"history": history.history, "loss": loss, "accuracy": accuracy, "model": model,
            "strategy": strategy}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--checkpoints", default=None,
                        help="a folder for per-epoch weights and the backup to resume from")
    args = parser.parse_args(argv)
    result = train(args.devices, args.epochs, checkpoints=args.checkpoints, verbose=1)
    print(f"held-out loss {result['loss']:.4f}  accuracy {result['accuracy']:.1%}")


if __name__ == "__main__":
    main()
