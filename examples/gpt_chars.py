"""Train a character-level GPT on the Python reference documentation with graphdist.

The text is the documentation every Python installation ships for `help()`
(`pydoc_data.topics`, about 465,000 characters); the last 10% is held out. The model is a
small GPT: token and position embeddings, pre-norm transformer blocks (causal multi-head
attention, a GELU MLP), a final layer norm and a dense head, trained with Adam, a warmup +
cosine learning-rate schedule and global-norm clipping. The held-out loss is compared with
a bigram model (the best one can do from the previous character alone).

    python examples/gpt_chars.py --devices 4 --steps 600

`graphdist demo --model gpt` runs this file's `train` and prints the graph of its step.
"""

from __future__ import annotations

import argparse
import math

import numpy as np

import graphdist as gd
from graphdist.examples.mlp_digits import make_strategy


def load_text() -> str:
    from pydoc_data.topics import topics

    return "\n".join(topics[key] for key in sorted(topics))


class CharData:
    """The text as integer ids over its sorted character set, split train/held-out."""

    def __init__(self, text: str, held_out: float = 0.1):
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}
        ids = np.array([self.index[c] for c in text], np.int32)
        cut = int(len(ids) * (1 - held_out))
        self.train, self.test = ids[:cut], ids[cut:]

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        return np.array([self.index.get(c, 0) for c in text], np.int32)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


def windows(ids: np.ndarray, starts: np.ndarray, context: int):
    """Inputs ids[s:s+context] and next-character targets ids[s+1:s+context+1] per start."""
    offsets = starts[:, None] + np.arange(context)
    return ids[offsets], ids[offsets + 1]


def batches(ids: np.ndarray, batch_size: int, context: int, seed: int = 0):
    """Endless batches of random windows (the same sequence for a given seed)."""
    rng = np.random.default_rng(seed)
    while True:
        yield windows(ids, rng.integers(0, len(ids) - context - 1, batch_size), context)


class Block(gd.nn.Layer):
    """Pre-norm transformer block: x + attention(norm(x)), then + mlp(norm(.))."""

    def __init__(self, width: int, heads: int, name=None):
        super().__init__(name)
        self.norm1, self.norm2 = gd.nn.LayerNorm(), gd.nn.LayerNorm()
        self.attention = gd.nn.MultiHeadAttention(heads, width // heads)
        self.fc = gd.nn.Dense(4 * width)
        self.proj = gd.nn.Dense(width)

    def call(self, x, training=False):
        h = self.norm1(x)
        x = x + self.attention(h, use_causal_mask=True, training=training)
        return x + self.proj(gd.nn.gelu(self.fc(self.norm2(x))))


class GPT(gd.nn.Layer):
    """ids [batch, time] -> next-character logits [batch, time, vocab]."""

    min_rank = 2

    def __init__(self, vocab_size: int, context: int, width: int = 128, layers: int = 2,
                 heads: int = 4, name=None):
        super().__init__(name)
        self.context = context
        self.tokens = gd.nn.Embedding(vocab_size, width)
        self.positions = gd.nn.Embedding(context, width)
        self.blocks = [Block(width, heads) for _ in range(layers)]
        self.norm = gd.nn.LayerNorm()
        self.head = gd.nn.Dense(vocab_size)

    def call(self, ids, training=False):
        time = ids.shape[1]
        if time > self.context:
            raise ValueError(f"GPT: a window of {time} characters is longer than the "
                             f"context of {self.context}")
        x = self.tokens(ids) + self.positions(gd.arange(time))
        for block in self.blocks:
            x = block(x, training=training)
        return self.head(self.norm(x))


def make_optimizer(steps: int, learning_rate: float = 3e-3):
    warmup = max(1, steps // 10)
    schedule = gd.optimizers.schedules.CosineDecay(
        learning_rate / 10, decay_steps=max(1, steps - warmup), alpha=0.1,
        warmup_target=learning_rate, warmup_steps=warmup)
    return gd.optimizers.Adam(schedule, global_clipnorm=1.0)


def loss_fn(model, x, y, training=True):
    logits = model(x, training=training)
    return gd.reduce_mean(gd.nn.sparse_softmax_cross_entropy(y, logits))


def make_train_step(strategy, model, optimizer):
    """Each replica's mean loss and gradients; the optimizer averages the gradients (the
    embedding tables' sparse ones as rows) and clips their global norm."""

    @gd.function
    def train_step(batch):
        def replica_fn(x, y):
            with gd.GradientTape() as tape:
                loss = loss_fn(model, x, y)
            variables = model.trainable_variables
            optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
            return loss

        return strategy.reduce(gd.ReduceOp.MEAN, strategy.run(replica_fn, args=batch))

    return train_step


def held_out_loss(model, data: CharData, context: int, windows_: int = 512,
                  batch_size: int = 64) -> float:
    """Mean next-character loss (nats) over evenly spaced held-out windows."""
    evaluate = gd.function(lambda x, y: loss_fn(model, x, y, training=False))
    starts = np.linspace(0, len(data.test) - context - 2, windows_).astype(np.int64)
    losses = [float(evaluate(*windows(data.test, starts[i:i + batch_size], context)))
              for i in range(0, windows_, batch_size)]
    return float(np.mean(losses))


def bigram_loss(data: CharData, alpha: float = 0.1) -> float:
    """Held-out loss (nats) of the bigram model fitted on the training text (add-alpha)."""
    v = data.vocab_size
    counts = np.full((v, v), alpha)
    np.add.at(counts, (data.train[:-1], data.train[1:]), 1.0)
    probs = counts / counts.sum(axis=1, keepdims=True)
    return float(-np.mean(np.log(probs[data.test[:-1], data.test[1:]])))


def sample(model, data: CharData, prompt: str, length: int = 200, temperature: float = 0.8,
           seed: int = 0) -> str:
    """Continue `prompt` character by character. The window is always `context` long:
    real characters first, padding after; with causal attention the logits at the last
    real position see only what precedes it."""
    context = model.context
    logits_of = gd.function(lambda x: model(x, training=False))
    rng = np.random.default_rng(seed)
    ids = list(data.encode(prompt)) or [0]
    for _ in range(length):
        window = ids[-context:]
        x = np.zeros((1, context), np.int32)
        x[0, :len(window)] = window
        logits = logits_of(x)[0, len(window) - 1].astype(np.float64) / temperature
        p = np.exp(logits - logits.max())
        ids.append(int(rng.choice(len(p), p=p / p.sum())))
    return data.decode(ids)


def train(devices: int = 1, steps: int = 600, batch_size: int = 32, context: int = 64,
          width: int = 128, layers: int = 2, heads: int = 4, learning_rate: float = 3e-3,
          seed: int = 0, on_step=None, kind: str = "cpu", evaluate: bool = True,
          text: str | None = None, workers: bool | None = None) -> dict:
    """Train for `steps` steps on `devices` devices of `kind`; returns the final loss, the
    held-out and bigram losses, the trained parameters, the model and the step."""
    data = CharData(load_text() if text is None else text)
    return train_model(make_strategy(devices, kind, workers), data,
                       lambda: GPT(data.vocab_size, context, width, layers, heads),
                       lambda: make_optimizer(steps, learning_rate), steps, batch_size,
                       context, seed, on_step, evaluate)


def train_model(strategy, data: CharData, make_model, make_optimizer_, steps: int,
                batch_size: int, context: int, seed: int = 0, on_step=None,
                evaluate: bool = True, held_out_windows: int = 512) -> dict:
    """Build a next-character model and its optimizer under `strategy` (initial weights
    from the seeded global generator: the same on any device count), train `steps` steps
    on batches of the training text, and return the losses, the held-out and bigram
    losses, the trained parameters, the model, the step and the strategy."""
    with strategy.scope():
        gd.random.set_global_generator(gd.random.Generator(seed))
        model = make_model()
        model(np.zeros((1, context), np.int32))      # build under the strategy
        optimizer = make_optimizer_()
    train_step = make_train_step(strategy, model, optimizer)
    source = strategy.experimental_distribute_dataset(
        batches(data.train, batch_size, context, seed))
    losses = []
    for step, batch in zip(range(steps), source):
        losses.append(float(train_step(batch)))
        if on_step is not None:
            on_step(step + 1, steps, losses[-1])
    result = {"loss": losses[-1], "losses": losses, "data": data, "model": model,
              "params": [v.numpy() for v in model.trainable_variables],
              "train_step": train_step, "strategy": strategy}
    if evaluate:
        result["held_out_loss"] = held_out_loss(model, data, context, held_out_windows)
        result["bigram_loss"] = bigram_loss(data)
    return result


def traced_step(devices: int = 1):
    """The example's compiled step, traced on one batch (for `graphdist show`):

        graphdist show graphdist.examples.gpt_chars:traced_step --devices 4
    """
    return train(devices, steps=1, evaluate=False)["train_step"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args(argv)
    result = train(args.devices, args.steps, width=args.width, layers=args.layers)
    bits = 1 / math.log(2)
    print(f"train loss {result['loss']:.3f}  held-out {result['held_out_loss']:.3f} nats "
          f"({result['held_out_loss'] * bits:.2f} bits/char); bigram baseline "
          f"{result['bigram_loss']:.3f} nats")
    print(sample(result["model"], result["data"], "The "))


if __name__ == "__main__":
    main()
