"""The worker both fault scripts start from (worker_fails.py, faults.py): a
MultiWorkerMirroredStrategy with one local device, a (4, 3) weight and a compiled SGD step
on softmax cross-entropy, whose labels a worker can make out of range to fail it."""

import numpy as np

import graphdist as gd


def sgd_worker(collective_timeout: float):
    """(strategy, w, step): step(x, y) trains one SGD step on every worker."""
    gd.config.set_collective_timeout(collective_timeout)
    strategy = gd.MultiWorkerMirroredStrategy(["cpu:0"])
    with strategy.scope():
        w = gd.Variable(np.ones((4, 3), np.float32))
        opt = gd.optimizers.SGD(0.1)

    def replica_fn(x, y):
        with gd.GradientTape() as tape:
            loss = gd.reduce_mean(gd.nn.sparse_softmax_cross_entropy(y, x @ w))
        opt.apply_gradients([(tape.gradient(loss, w), w)])

    return strategy, w, gd.function(lambda x, y: strategy.run(replica_fn, args=(x, y)))
