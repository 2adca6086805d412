"""Run under `mpiexec -n 2` (tests/distribute/test_collective_schedule.py): workers that run
different collectives. argv: OUT scenario, scenario one of
  extra_reduce  the chief calls one extra strategy.reduce between two steps
  other_step    worker 1's step all-reduces a metric of another width
  agree         both train as training.py does
  rendezvous    the chief alone calls Checkpoint.save (a collective outside compiled
                code) while worker 1 steps
  sync_read     the chief reads a sync-on-read variable (an all-reduce outside compiled
                code) while worker 1 steps
  two_reads     the chief reads a sync-on-read scalar, worker 1 one of 3 floats
  gather        an eager strategy.gather on both (its values), then one more on the chief
                while worker 1 steps
  timing        seconds per cached MLP step (GRAPHDIST_SCHEDULE_CHECK=first: the header
                exchanged at the first call only), for the report, not the tests
Each worker writes what it saw to OUT/rank<r>.json."""

import json
import os
import sys

import numpy as np

import graphdist as gd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from training import train  # noqa: E402

out_dir, scenario = sys.argv[1], sys.argv[2]
strategy = gd.MultiWorkerMirroredStrategy(["cpu:0", "cpu:1"])
rank, report = strategy.worker_index, {}


def mlp_step(width: int):
    """A small regression step whose replicas also all-reduce a metric of `width` floats."""
    with strategy.scope():
        w = gd.Variable(np.random.default_rng(3).standard_normal((4, 2)).astype(np.float32),
                        name="w")
        opt = gd.optimizers.SGD(0.1)
    x = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    y = np.random.default_rng(1).standard_normal((8, 2)).astype(np.float32)

    def replica_fn(x, y):
        with gd.GradientTape() as tape:
            loss = gd.reduce_mean((x @ w - y) ** 2)
        opt.apply_gradients([(tape.gradient(loss, w), w)])
        metric = gd.reduce_sum(x, axis=0)[:width]
        return gd.get_replica_context().all_reduce("sum", metric)

    step = gd.function(lambda x, y: strategy.run(replica_fn, args=(x, y)))
    batches = list(strategy.experimental_distribute_dataset([(x, y)] * 3))
    return w, step, batches


def attempt(fn):
    try:
        fn()
        return None
    except gd.WorkerError as e:
        return str(e)


if scenario == "extra_reduce":
    w, step, batches = mlp_step(2)
    step(*batches[0])
    report["before"] = w.numpy().tolist()
    per = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.full(5, ctx.replica_id_in_sync_group + 1.0, np.float32))
    if rank == 0:
        report["error"] = attempt(lambda: strategy.reduce("sum", per, axis=None))
    else:
        report["error"] = attempt(lambda: step(*batches[1]))
    report["after"] = w.numpy().tolist()
elif scenario == "other_step":
    w, step, batches = mlp_step(2 + rank)
    report["before"] = w.numpy().tolist()
    report["error"] = attempt(lambda: step(*batches[0]))
    report["after"] = w.numpy().tolist()
elif scenario == "rendezvous":
    w, step, batches = mlp_step(2)
    step(*batches[0])          # traced on both (its trace agrees on the variables)
    report["before"] = w.numpy().tolist()
    if rank == 0:
        ckpt = gd.Checkpoint(w=w)
        report["error"] = attempt(lambda: ckpt.save(os.path.join(out_dir, "ckpt")))
    else:
        report["error"] = attempt(lambda: step(*batches[1]))
    report["after"] = w.numpy().tolist()
elif scenario in ("sync_read", "two_reads"):
    w, step, batches = mlp_step(2)
    with strategy.scope():
        total = gd.Variable(np.float32(rank + 1), name="total",
                            synchronization=gd.VariableSynchronization.ON_READ,
                            aggregation=gd.VariableAggregation.SUM)
        counts = gd.Variable(np.ones(3, np.float32), name="counts",
                             synchronization=gd.VariableSynchronization.ON_READ,
                             aggregation=gd.VariableAggregation.SUM)
    step(*batches[0])
    report["before"] = w.numpy().tolist()
    report["total"] = float(total.numpy())         # both read: every replica's sum
    if rank == 0:
        report["error"] = attempt(lambda: total.numpy())
    elif scenario == "sync_read":
        report["error"] = attempt(lambda: step(*batches[1]))
    else:
        report["error"] = attempt(lambda: counts.numpy())
    report["after"] = w.numpy().tolist()
elif scenario == "gather":
    w, step, batches = mlp_step(2)
    step(*batches[0])
    per = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.full((1, 2), ctx.replica_id_in_sync_group, np.float32))
    report["gathered"] = strategy.gather(per, axis=0).tolist()
    report["before"] = w.numpy().tolist()
    if rank == 0:
        report["error"] = attempt(lambda: strategy.gather(per, axis=0))
    else:
        report["error"] = attempt(lambda: step(*batches[1]))
    report["after"] = w.numpy().tolist()
elif scenario == "timing":
    import time

    w, step, batches = mlp_step(2)
    for _ in range(20):
        step(*batches[0])
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(200):
            step(*batches[0])
        times.append((time.perf_counter() - start) / 200)
    report["seconds_per_step"] = min(times)
    from graphdist.runtime.schedule_check import agree, fingerprint

    start = time.perf_counter()
    for _ in range(1000):
        agree(strategy._group, [], fingerprint([]))
    report["seconds_per_header"] = (time.perf_counter() - start) / 1000
else:
    trained = train(strategy, seed=100)
    report["w"] = trained["w"].numpy().tolist()
    report["table"] = trained["table"].numpy().tolist()
    report["w_bytes"] = trained["w"].values[0].tobytes().hex()

with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(report, f)
