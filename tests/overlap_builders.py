"""The small MLP the overlap tests train (tests/runtime/test_overlap.py,
test_overlap_threads.py, tests/gpu/test_overlap_gpu.py): its layers' sizes give one bucket
per weight and one for the last three, so that some buckets have backward work behind
them to overlap with and the last one has none."""

from __future__ import annotations

import numpy as np

import graphdist as gd


def train_mlp(devices, sizes, *, bucket_bytes: int, optimizer, x, y, steps: int,
              scale: float = 0.2, seed: int = 0):
    """`steps` steps of a tanh MLP with weights of `sizes` (weight, bias, weight, bias, ...)
    on a MirroredStrategy over `devices`, from weights drawn with `seed`:
    (variables, losses, step, batch). `optimizer()` makes the optimizer under the scope."""
    rng = np.random.default_rng(seed)
    strategy = gd.MirroredStrategy(devices)
    strategy.bucket_bytes = bucket_bytes
    with strategy.scope():
        ws = [gd.Variable((rng.standard_normal(s) * scale).astype(np.float32), name=f"w{i}")
              for i, s in enumerate(sizes)]
        opt = optimizer()

    @gd.function
    def step(batch):
        def replica_fn(x, y):
            with gd.GradientTape() as tape:
                h = x
                for i in range(0, len(ws), 2):
                    h = h @ ws[i] + ws[i + 1]
                    if i + 2 < len(ws):
                        h = gd.tanh(h)
                loss = gd.reduce_mean(gd.nn.sparse_softmax_cross_entropy(y, h))
            opt.apply_gradients(zip(tape.gradient(loss, ws), ws))
            return loss
        return strategy.reduce("mean", strategy.run(replica_fn, args=batch))

    batch = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
    losses = [float(step(batch)) for _ in range(steps)]
    return ws, losses, step, batch
