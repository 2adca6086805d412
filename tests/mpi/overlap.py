"""Run as 2 workers (tests/runtime/test_overlap.py): the MLP and a CNN trained with overlap
on and off under MultiWorkerMirroredStrategy (one local device each, 8 KiB buckets, so
several all-reduces per step). Writes OUT/rank<r>.json: the variables' bytes per setting,
the step's op names with overlap on, and a profile_report of the overlapped MLP step."""

import json
import os
import sys

import numpy as np

import graphdist as gd

out_dir = sys.argv[1]
strategy = gd.MultiWorkerMirroredStrategy(["cpu:0"])
strategy.bucket_bytes = 8 * 1024
rank = strategy.worker_index


def mlp(rng):
    sizes = [(32, 64), (64,), (64, 64), (64,), (64, 10), (10,)]
    ws = [gd.Variable((rng.standard_normal(s) * 0.2).astype(np.float32), name=f"w{i}")
          for i, s in enumerate(sizes)]

    def forward(x):
        h = x
        for i in range(0, len(ws), 2):
            h = h @ ws[i] + ws[i + 1]
            if i + 2 < len(ws):
                h = gd.tanh(h)
        return h
    return ws, forward, (32,)


def cnn(rng):
    model = gd.nn.Sequential([gd.nn.Conv2D(4, 3, activation="relu"), gd.nn.MaxPool2D(2),
                              gd.nn.Flatten(), gd.nn.Dense(10)])
    model(np.zeros((1, 8, 8, 1), np.float32))
    for v in model.trainable_variables:
        v.assign((rng.standard_normal(v.shape) * 0.3).astype(np.float32))
    return model.trainable_variables, model, (8, 8, 1)


def train(make, overlap: bool, steps: int = 3):
    gd.config.set_overlap(overlap)
    rng = np.random.default_rng(0)
    with strategy.scope():
        variables, forward, shape = make(rng)
        opt = gd.optimizers.Adam(0.01)

    @gd.function
    def step(batch):
        def replica_fn(x, y):
            with gd.GradientTape() as tape:
                loss = gd.reduce_mean(gd.nn.sparse_softmax_cross_entropy(y, forward(x)))
            opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
            return loss
        return strategy.reduce("mean", strategy.run(replica_fn, args=batch))

    data = np.random.default_rng(1)
    x = data.standard_normal((16, *shape)).astype(np.float32)
    y = data.integers(0, 10, 16).astype(np.int32)
    batch = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
    losses = [float(step(batch)) for _ in range(steps)]
    return step, batch, {"losses": losses,
                         "bytes": [v.numpy().tobytes().hex() for v in variables]}


report = {}
for name, make in (("mlp", mlp), ("cnn", cnn)):
    step, batch, report[f"{name}_on"] = train(make, True)
    if name == "mlp":
        report["ops"] = sorted({e.op.name for e in step.replicated_graph.eqns})
        report["profile"] = gd.profile_report(step.profile(batch))
    _, _, report[f"{name}_off"] = train(make, False)
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(report, f)
