"""The training both the multi-worker script and its in-process references run: Adam on a
small softmax model with an embedding table (its gradient is sparse), 4 steps on the same
global batch, variables first made from `seed`."""

import numpy as np

import graphdist as gd


def train(strategy, seed: int, steps: int = 4):
    rng = np.random.default_rng(seed)
    x = np.random.default_rng(0).standard_normal((48, 8)).astype(np.float32)
    y = np.random.default_rng(1).integers(0, 3, 48).astype(np.int32)
    with strategy.scope():
        w = gd.Variable(rng.standard_normal((8, 3)).astype(np.float32), name="w")
        table = gd.Variable(np.random.default_rng(2).standard_normal((500, 3)).astype(
            np.float32), name="table")
        opt = gd.optimizers.Adam(0.05)
    initial = w.numpy()

    def replica_fn(x, y):
        with gd.GradientTape() as tape:
            ids = gd.cast(gd.abs(x[:, 0]) * 100.0, "int32")
            logits = x @ w + gd.nn.embedding_lookup(table, ids)
            loss = gd.reduce_mean(gd.nn.sparse_softmax_cross_entropy(y, logits))
        grads = tape.gradient(loss, [w, table])
        opt.apply_gradients(zip(grads, [w, table]))
        return loss, gd.get_replica_context().replica_id_in_sync_group

    step = gd.function(lambda x, y: strategy.run(replica_fn, args=(x, y)))
    if strategy.num_replicas_in_sync == 1:
        for _ in range(steps):
            step(x, y)
        rid = None
    else:
        for batch in strategy.experimental_distribute_dataset([(x, y)] * steps):
            _, rid = step(*batch)
    return {"initial": initial, "w": w, "table": table, "opt": opt, "step": step, "rid": rid}
