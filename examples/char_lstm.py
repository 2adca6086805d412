"""Train a character-level LSTM on the bundled Shakespeare with graphdist.

The text is `graphdist.datasets.load_shakespeare()` (the opening of Coriolanus, about 60,000
characters, public domain); its last 10% is held out. The model reads a window of
characters (an embedding, `gd.nn.LSTM` with `return_sequences=True`, which runs as one
`gd.scan` node, and a dense head) and predicts each next character; it trains with Adam
and global-norm clipping under MirroredStrategy, on one device or several replicas of the
same global batch. The held-out loss is compared with a bigram model (the best one can do
from the previous character alone).

    python examples/char_lstm.py --devices 4 --steps 300
"""

from __future__ import annotations

import argparse
import math

import graphdist as gd
from graphdist.datasets import load_shakespeare
# the GPT example's data handling and training loop (each replica's mean loss, averaged
# gradients, the held-out loss) serve any next-character model
from graphdist.examples.gpt_chars import CharData, train_model


class CharLSTM(gd.nn.Layer):
    """ids [batch, time] -> next-character logits [batch, time, vocab]."""

    min_rank = 2

    def __init__(self, vocab_size: int, units: int = 128, embedding: int = 32, name=None):
        super().__init__(name)
        self.embed = gd.nn.Embedding(vocab_size, embedding)
        self.lstm = gd.nn.LSTM(units, return_sequences=True)
        self.head = gd.nn.Dense(vocab_size)

    def call(self, ids, training=False):
        return self.head(self.lstm(self.embed(ids)))


def train(devices: int = 1, steps: int = 300, batch_size: int = 32, context: int = 48,
          units: int = 128, embedding: int = 32, learning_rate: float = 1e-2, seed: int = 0,
          evaluate: bool = True, on_step=None) -> dict:
    """Train for `steps` steps on `devices` CPU devices; returns the losses, the held-out
    and bigram losses, the trained parameters and the model."""
    data = CharData(load_shakespeare())
    return train_model(gd.MirroredStrategy([f"cpu:{i}" for i in range(devices)]), data,
                       lambda: CharLSTM(data.vocab_size, units, embedding),
                       lambda: gd.optimizers.Adam(learning_rate, global_clipnorm=1.0), steps,
                       batch_size, context, seed, on_step, evaluate, held_out_windows=128)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--units", type=int, default=128)
    args = parser.parse_args(argv)
    result = train(args.devices, args.steps, units=args.units,
                   on_step=lambda k, n, loss: print(f"step {k}/{n}  loss {loss:.3f}")
                   if k % 50 == 0 or k == n else None)
    bits = 1 / math.log(2)
    print(f"train loss {result['loss']:.3f}  held-out {result['held_out_loss']:.3f} nats "
          f"({result['held_out_loss'] * bits:.2f} bits/char); bigram baseline "
          f"{result['bigram_loss']:.3f} nats")


if __name__ == "__main__":
    main()
