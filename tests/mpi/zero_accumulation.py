"""A worker of tests/distribute/test_zero.py's multi-worker cases: 2 devices per worker under
MultiWorkerMirroredStrategy(zero_stage=STAGE) with Adam accumulating 2 micro-batches, 4 calls
on fixed global batches; writes the parameters, whole slots and counters as JSON to
OUT/rank<R>.json, and a checkpoint (whole slots) to OUT/ckpt.npz.

    python zero_accumulation.py OUT STAGE
"""

import json
import os
import sys

import numpy as np

import graphdist as gd


def train(strategy, calls: int = 4):
    rng = np.random.default_rng(5)
    with strategy.scope():
        w = gd.Variable(rng.standard_normal((7, 3)).astype(np.float32), name="w")
        opt = gd.optimizers.Adam(0.05, gradient_accumulation_steps=2)

    def replica_fn(x, y):
        with gd.GradientTape() as tape:
            loss = gd.reduce_mean(gd.square(gd.tanh(x @ w) - y))
        opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))
        return loss

    step = gd.function(lambda x, y: strategy.run(replica_fn, args=(x, y)))
    data = np.random.default_rng(6)
    batches = [(data.standard_normal((8, 7)).astype(np.float32),
                data.standard_normal((8, 3)).astype(np.float32)) for _ in range(calls)]
    for batch in strategy.experimental_distribute_dataset(batches):
        step(*batch)
    return w, opt


if __name__ == "__main__":
    out, stage = sys.argv[1], int(sys.argv[2])
    strategy = gd.MultiWorkerMirroredStrategy(["cpu:0", "cpu:1"], zero_stage=stage)
    w, opt = train(strategy)
    report = {"w": w.numpy().tolist(), "iterations": int(opt.iterations.numpy()),
              "slots": {k: np.asarray(s.numpy()).tolist() for k, s in opt.slots().items()},
              "shard_shapes": [list(c.shape) for c in opt.slots()["w/m"].values]}
    gd.Checkpoint(w=w, opt=opt).save(os.path.join(out, "ckpt.npz"))
    with open(os.path.join(out, f"rank{strategy.worker_index}.json"), "w") as f:
        json.dump(report, f)
