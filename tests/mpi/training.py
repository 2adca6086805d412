"""The training both the multi-worker script and its in-process references run: Adam on a
small softmax model with an embedding table (its gradient is sparse), 4 steps on the same
global batch of `rows` examples, variables first made from `seed`. `global_average`: the
loss averaged over the global batch and the gradients summed (TF's compute_average_loss
idiom), which equals one device whatever the shard sizes; else each replica's mean, the
gradients averaged (equal shards only)."""

import numpy as np

import graphdist as gd


def train(strategy, seed: int, steps: int = 4, rows: int = 48, global_average: bool = False):
    rng = np.random.default_rng(seed)
    x = np.random.default_rng(0).standard_normal((rows, 8)).astype(np.float32)
    y = np.random.default_rng(1).integers(0, 3, rows).astype(np.int32)
    with strategy.scope():
        w = gd.Variable(rng.standard_normal((8, 3)).astype(np.float32), name="w")
        table = gd.Variable(np.random.default_rng(2).standard_normal((500, 3)).astype(
            np.float32), name="table")
        opt = gd.optimizers.Adam(0.05, gradient_reduction="sum" if global_average else "mean")
    initial = w.numpy()

    def replica_fn(x, y):
        with gd.GradientTape() as tape:
            ids = gd.cast(gd.abs(x[:, 0]) * 100.0, "int32")
            logits = x @ w + gd.nn.embedding_lookup(table, ids)
            per_example = gd.nn.sparse_softmax_cross_entropy(y, logits)
            loss = (gd.nn.compute_average_loss(per_example, global_batch_size=rows)
                    if global_average else gd.reduce_mean(per_example))
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
