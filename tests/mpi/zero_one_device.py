"""A worker of tests/distribute/test_zero.py: 1 device per worker under
MultiWorkerMirroredStrategy(zero_stage=1), Adam, 3 steps, twice: with the MPI reduce-scatter
and all-gather writing into the step's buffers (one Reduce_scatter_block from the gradient
bucket, posted early where the overlap stage splits it, one Allgather into the output) and
with their impls run inline (an all-reduce, copies); writes both runs' parameters, whole
slots and collectives as JSON to OUT/rank<R>.json.

    python zero_one_device.py OUT
"""

import json
import os
import sys

import numpy as np

import graphdist as gd
from graphdist.ops.mpi_collectives import mpi_all_gather_p, mpi_reduce_scatter_p

SHAPES = [(300, 200), (7, 3), (5,)]        # one solo bucket (240 KB), one of two, padded


def train():
    rng = np.random.default_rng(8)
    strategy = gd.MultiWorkerMirroredStrategy(["cpu:0"], zero_stage=1)
    strategy.bucket_bytes = 1024
    with strategy.scope():
        ws = [gd.Variable(rng.standard_normal(s).astype(np.float32), name=f"w{i}")
              for i, s in enumerate(SHAPES)]
        opt = gd.optimizers.Adam(0.05)

    def replica_fn(x):
        with gd.GradientTape() as tape:
            loss = sum(gd.reduce_mean(gd.tanh(w * x[0, 0])) for w in ws)
        opt.apply_gradients(zip(tape.gradient(loss, ws), ws))
        return loss

    step = gd.function(lambda x: strategy.run(replica_fn, args=(x,)))
    data = np.random.default_rng(9)
    batches = [data.standard_normal((2, 4)).astype(np.float32) for _ in range(3)]
    for batch in strategy.experimental_distribute_dataset(batches):
        step(batch)
    ops = sorted({e.op.name for e in step.replicated_graph.eqns if e.op.collective})
    return strategy.worker_index, {
        "w": [w.numpy().tolist() for w in ws], "ops": ops,
        "slots": {k: np.asarray(s.numpy()).tolist() for k, s in opt.slots().items()}}


if __name__ == "__main__":
    out = sys.argv[1]
    rank, first = train()
    mpi_reduce_scatter_p.out_impl = mpi_all_gather_p.out_impl = None     # the impls,
    gd.config.set_overlap(False)                                          # inline
    report = {"out": first, "impl": train()[1]}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
