"""Builders for tests/test_check_equivalence.py (`graphdist check
equivalence_builders:NAME` from tests/): one per known cause of N devices not matching one,
and one that matches. Each takes the device count n (and dtype=, for --float64) and returns
(step, args) built from the same initial values and global batch for every n."""

import numpy as np

import graphdist as gd


def _strategy(n: int):
    return gd.MirroredStrategy([f"cpu:{i}" for i in range(n)])


def _data(rows: int, dtype, seed: int = 1):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, 3)).astype(dtype),
            rng.standard_normal((rows, 2)).astype(dtype))


def _linear(n, dtype, rows, loss_kind, reduction="mean", strategy=None):
    """A linear least-squares step: `loss_kind` "mean" (reduce_mean of the local batch) or
    "average" (compute_average_loss); on n local devices unless `strategy` is given."""
    strategy = _strategy(n) if strategy is None else strategy
    with strategy.scope():
        w = gd.Variable(np.linspace(-1, 1, 6).reshape(3, 2).astype(dtype), name="w")
        opt = gd.optimizers.SGD(0.1, gradient_reduction=reduction)

    @gd.function
    def step(batch):
        def replica_fn(x, y):
            with gd.GradientTape() as tape:
                per_example = gd.reduce_sum(gd.square(x @ w - y), axis=1)
                if loss_kind == "mean":
                    loss = gd.reduce_mean(per_example)
                else:
                    loss = gd.nn.compute_average_loss(per_example, global_batch_size=rows)
            opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))
            return loss
        per_replica = strategy.run(replica_fn, args=batch)
        return strategy.reduce("sum" if loss_kind == "average" else "mean", per_replica)

    return step, (next(iter(strategy.experimental_distribute_dataset([_data(rows, dtype)]))),)


def equivalent(n, dtype=np.float32):
    """compute_average_loss with gradient_reduction='sum': the recipe, on any split."""
    return _linear(n, dtype, 6, "average", reduction="sum")


def uneven_mean(n, dtype=np.float32):
    """A per-replica mean loss on 3 rows: 2 | 1 on two devices."""
    return _linear(n, dtype, 3, "mean")


def empty_shard(n, dtype=np.float32):
    """A per-replica mean loss on 1 row: 1 | 0 on two devices."""
    return _linear(n, dtype, 1, "mean")


def average_loss_mean(n, dtype=np.float32):
    """compute_average_loss with the default gradient_reduction='mean'."""
    return _linear(n, dtype, 4, "average")


def batch_norm(n, dtype=np.float32, synchronized=False):
    """A BatchNorm (unsynchronized unless `synchronized`) before the linear layer."""
    strategy = _strategy(n)
    with strategy.scope():
        bn = gd.nn.BatchNorm(synchronized=synchronized, dtype=dtype)
        w = gd.Variable(np.linspace(-1, 1, 6).reshape(3, 2).astype(dtype), name="w")
        opt = gd.optimizers.SGD(0.1)

    @gd.function
    def step(batch):
        def replica_fn(x, y):
            with gd.GradientTape() as tape:
                h = bn(x, training=True)
                loss = gd.reduce_mean(gd.reduce_sum(gd.square(h @ w - y), axis=1))
            opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))
            return loss
        return strategy.reduce("mean", strategy.run(replica_fn, args=batch))

    return step, (next(iter(strategy.experimental_distribute_dataset([_data(4, dtype)]))),)


def batch_norm_synchronized(n, dtype=np.float32):
    """BatchNorm(synchronized=True): the global batch's statistics on every replica."""
    return batch_norm(n, dtype, synchronized=True)


def dropout(n, dtype=np.float32):
    """Dropout inside strategy.run: each replica draws its own mask."""
    strategy = _strategy(n)
    with strategy.scope():
        w = gd.Variable(np.linspace(-1, 1, 6).reshape(3, 2).astype(dtype), name="w")
        generator = gd.random.Generator(seed=7)
        opt = gd.optimizers.SGD(0.1)

    @gd.function
    def step(batch):
        def replica_fn(x, y):
            with gd.GradientTape() as tape:
                h = gd.nn.dropout(x, 0.5, generator=generator)
                loss = gd.reduce_mean(gd.reduce_sum(gd.square(h @ w - y), axis=1))
            opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))
            return loss
        return strategy.reduce("mean", strategy.run(replica_fn, args=batch))

    return step, (next(iter(strategy.experimental_distribute_dataset([_data(4, dtype)]))),)


def kink(n, dtype=np.float32):
    """relu(s * w - 1) of s, the sum of the global batch [2**-24, 1, 2**-24, 2**-24]: in
    float32 one device sums to exactly 1 (each 2**-24 rounds away), two devices to
    1 + 2**-23 ((2**-24 + 1) + (2**-24 + 2**-24)); relu's gradient at 0 is 0, just above
    it 1. In float64 both are 1 + 3 * 2**-24."""
    strategy = _strategy(n)
    with strategy.scope():
        w = gd.Variable(np.ones((), dtype), name="w")
        opt = gd.optimizers.SGD(0.1, gradient_reduction="sum")
    x = np.array([[2.0 ** -24], [1.0], [2.0 ** -24], [2.0 ** -24]], dtype)

    @gd.function
    def step(batch):
        def replica_fn(x):
            ctx = gd.get_replica_context()
            with gd.GradientTape() as tape:
                s = ctx.all_reduce("sum", gd.reduce_sum(x))
                loss = gd.relu(s * w - 1.0) / ctx.num_replicas_in_sync
            opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))
            return loss
        return strategy.reduce("sum", strategy.run(replica_fn, args=(batch,)))

    return step, (next(iter(strategy.experimental_distribute_dataset([x]))),)


def _mlp(n, dtype, recipe: str):
    """A 8-16-5 relu MLP with softmax cross entropy and Adam on 10 rows (uneven on 3 and 4
    devices): "sum" is compute_average_loss with gradient_reduction='sum', "mean" a
    per-replica reduce_mean with the default mean (its gradients travel in one bucket)."""
    strategy = _strategy(n)
    rng = np.random.default_rng(0)
    shapes = [(8, 16), (16,), (16, 5), (5,)]
    with strategy.scope():
        ws = [gd.Variable((rng.standard_normal(s) * 0.3).astype(dtype), name=f"w{i}")
              for i, s in enumerate(shapes)]
        opt = gd.optimizers.Adam(0.01, gradient_reduction=recipe)
    x = rng.standard_normal((10, 8)).astype(dtype)
    y = rng.integers(0, 5, 10).astype(np.int32)

    @gd.function
    def step(batch):
        def replica_fn(x, y):
            with gd.GradientTape() as tape:
                logits = gd.relu(x @ ws[0] + ws[1]) @ ws[2] + ws[3]
                per_example = gd.nn.sparse_softmax_cross_entropy(y, logits)
                loss = (gd.nn.compute_average_loss(per_example, global_batch_size=10)
                        if recipe == "sum" else gd.reduce_mean(per_example))
            opt.apply_gradients(zip(tape.gradient(loss, ws), ws))
            return loss
        return strategy.reduce(recipe, strategy.run(replica_fn, args=batch))

    return step, (next(iter(strategy.experimental_distribute_dataset([(x, y)]))),)


def equivalent_mlp(n, dtype=np.float32):
    return _mlp(n, dtype, "sum")


def uneven_mean_mlp(n, dtype=np.float32):
    return _mlp(n, dtype, "mean")


def across_workers(n, dtype=np.float32, reduction="mean"):
    """Under graphdist launch: n devices as a MultiWorkerMirroredStrategy over the workers
    (n // workers each), one device locally; compute_average_loss on 4 rows, with the
    optimizer's `reduction`."""
    import os

    workers = int(os.environ.get("PMI_SIZE", "1"))
    strategy = (_strategy(1) if n == 1 else
                gd.MultiWorkerMirroredStrategy([f"cpu:{i}" for i in range(n // workers)]))
    return _linear(n, dtype, 4, "average", reduction, strategy)


def across_workers_sum(n, dtype=np.float32):
    return across_workers(n, dtype, reduction="sum")
