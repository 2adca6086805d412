"""Run under `mpiexec -n 2` (tests/distribute/test_multi_worker.py): every multi-worker behaviour the
tests check, each worker writing what it saw to OUT/rank<r>.json."""

import json
import os
import sys

import numpy as np

import graphdist as gd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from training import train  # noqa: E402

out_dir, local, single = sys.argv[1], int(sys.argv[2]), sys.argv[3]
strategy = gd.MultiWorkerMirroredStrategy([f"cpu:{i}" for i in range(local)])
rank, report = strategy.worker_index, {}

# ---- training: variables made from different values per worker (the chief's win)
trained = train(strategy, seed=100 + rank)
w, table, opt, step = trained["w"], trained["table"], trained["opt"], trained["step"]
report["initial_w"] = trained["initial"].tolist()
report["replica_ids"] = [int(r) for r in trained["rid"].values]
report["w"] = w.numpy().tolist()
report["table"] = table.numpy().tolist()
report["components_equal"] = all(np.array_equal(w.values[0], c) for c in w.values[1:])
report["w_bytes"] = w.values[0].tobytes().hex()
ops = {e.op.name for e in step.replicated_graph.eqns}
report["collective_ops"] = sorted(op for op in ops if op.startswith("mpi_"))

# ---- shards of different sizes on the workers: 11 rows on 4 replicas (3, 3 | 3, 2), and 3
# rows (1, 1 | 1, 0: a replica with no example)
for rows in (11, 3):
    uneven = train(strategy, seed=7, rows=rows, global_average=True)
    report[f"uneven_{rows}"] = {"w": uneven["w"].numpy().tolist(),
                                "table": uneven["table"].numpy().tolist()}

# ---- reductions: eager and traced, SUM and MEAN
per = strategy.experimental_distribute_values_from_function(
    lambda ctx: np.float32(ctx.replica_id_in_sync_group + 1))
report["eager_sum"] = float(strategy.reduce("sum", per, axis=None))
report["eager_mean"] = float(strategy.reduce("mean", per, axis=None))
traced = gd.function(lambda v: strategy.reduce("sum", strategy.run(lambda a: a * 2.0,
                                                                   args=(v,)), axis=None))
report["traced_sum"] = float(traced(per))
# cross-replica code reading one replica's value: a broadcast from worker 1's replica 3
last = gd.function(lambda v: strategy.run(lambda a: a * 1.0, args=(v,)).values[3] * 1.0)
report["value_of_replica_3"] = float(last(per))

# ---- sync-on-read variables aggregate across workers
with strategy.scope():
    total = gd.Variable(0.0, synchronization=gd.VariableSynchronization.ON_READ,
                        aggregation=gd.VariableAggregation.SUM)
    mean = gd.Variable(0.0, synchronization=gd.VariableSynchronization.ON_READ,
                       aggregation=gd.VariableAggregation.MEAN)


def count(_):
    r = gd.cast(gd.get_replica_context().replica_id_in_sync_group, "float32") + 1.0
    total.assign(r)
    mean.assign(r)


gd.function(lambda v: strategy.run(count, args=(v,)))(per)
report["on_read_sum"] = float(total.numpy())
report["on_read_mean"] = float(mean.numpy())

# ---- a checkpoint: every worker saves, the chief writes
path = gd.Checkpoint(w=w, table=table, opt=opt).save(os.path.join(out_dir, "ckpt.npz"))
report["checkpoint"] = path
report["checkpoint_exists"] = os.path.exists(path)

# ---- a checkpoint written by one process restores onto the workers
with strategy.scope():
    w2 = gd.Variable(np.zeros((8, 3), np.float32))
gd.Checkpoint(w=w2).restore(single)
report["restored_from_single"] = w2.numpy().tolist()
report["restored_components_equal"] = all(np.array_equal(w2.values[0], c) for c in w2.values)

with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(report, f)
