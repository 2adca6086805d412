"""Run under `mpiexec -n 2`: `agreement.py OUT_DIR SCENARIO`; each rank writes
OUT_DIR/rank{r}.json with what it saw. Scenarios:

- shape: worker 1's variable 'w' is (4, 8) where the chief's is (8, 4);
- dtype: worker 1's 'w' is float64 where the chief's is float32;
- extra: the chief makes one more variable, 'extra', than worker 1, before its optimizer;
- extra_last: the same, last (worker 1 starts its first step while the chief makes it);
- layout: worker 1 has one local device, the chief two;
- train: the workers agree; they train two SGD steps, run check_mirrored, then tamper
  with one component of 'w' on worker 1 and run it again; then each worker restores a
  checkpoint: first the same file on both, then a different file on each (worker 1's
  "stale" file holds other values), then a file worker 1 does not have; then the chief
  calls check_mirrored while worker 1 restores.
"""

import json
import os
import sys
import time

import numpy as np

import graphdist as gd
from mpi4py import MPI

out_dir, scenario = sys.argv[1], sys.argv[2]
gd.config.set_collective_timeout(10.0)
report = {"trained": False}
start = time.perf_counter()


def error_of(call):
    """Run `call`; the error's type and message (None, None when it returns) and seconds."""
    start = time.perf_counter()
    try:
        call()
        return None, None, time.perf_counter() - start
    except Exception as e:  # noqa: BLE001 - recorded for the test
        return type(e).__name__, str(e), time.perf_counter() - start


def make_variables():
    shape = (4, 8) if scenario == "shape" and rank == 1 else (8, 4)
    dtype = np.float64 if scenario == "dtype" and rank == 1 else np.float32
    with strategy.scope():
        w = gd.Variable(np.full(shape, 0.5, dtype), name="w")
        b = gd.Variable(np.zeros(4, np.float32), name="b")
        if scenario == "extra" and rank == 0:
            gd.Variable(np.zeros(3, np.float32), name="extra")
        opt = gd.optimizers.SGD(0.1)
        if scenario == "extra_last" and rank == 0:
            gd.Variable(np.zeros(3, np.float32), name="extra")
    return w, b, opt


def train(w, b, opt, steps=2):
    def replica_fn(x):
        with gd.GradientTape() as tape:
            loss = gd.reduce_mean((x @ w + b) ** 2)
        opt.apply_gradients(zip(tape.gradient(loss, [w, b]), [w, b]))

    step = gd.function(lambda x: strategy.run(replica_fn, args=(x,)))
    x = np.arange(32, dtype=np.float32).reshape(4, 8) / 32
    for batch in strategy.experimental_distribute_dataset([x] * steps):
        step(batch)
    report["trained"] = True


def restore_scenarios(w, b):
    ckpt = gd.Checkpoint(w=w, b=b)
    chief_file = os.path.join(out_dir, "chief.ckpt")
    stale_file = os.path.join(out_dir, "stale.ckpt")
    if rank == 0:                 # written by one process, outside the workers' checkpoint
        for path, fill in ((chief_file, 1.0), (stale_file, 2.0)):
            one = gd.OneDeviceStrategy("cpu:0")
            with one.scope():
                gd.Checkpoint(w=gd.Variable(np.full((8, 4), fill, np.float32)),
                              b=gd.Variable(np.full(4, fill, np.float32))).save(path)
    strategy.reduce("sum", np.ones(1, np.float32))        # both files exist from here on
    report["same_files"] = error_of(lambda: ckpt.restore(chief_file))[:2]
    report["after_same"] = w.numpy().tolist()
    report["check_after_same"] = error_of(strategy.check_mirrored)[:2]
    before = w.numpy().tolist()
    mine = chief_file if rank == 0 else stale_file
    report["different_files"] = error_of(lambda: ckpt.restore(mine))[:2]
    report["unchanged"] = w.numpy().tolist() == before
    report["check_after_different"] = error_of(strategy.check_mirrored)[:2]
    missing = os.path.join(out_dir, "missing.ckpt")
    report["missing_on_one"] = error_of(lambda: ckpt.restore(chief_file if rank == 0
                                                              else missing))[:2]
    report["unchanged_after_missing"] = w.numpy().tolist() == before
    # out of step: the chief checks its replicas while worker 1 restores
    report["out_of_step"] = error_of(strategy.check_mirrored if rank == 0
                                     else lambda: ckpt.restore(chief_file))[:2]


try:
    local = 1 if scenario == "layout" and MPI.COMM_WORLD.Get_rank() == 1 else 2
    strategy = gd.MultiWorkerMirroredStrategy([f"cpu:{i}" for i in range(local)])
    rank = strategy.worker_index
    w, b, opt = make_variables()
    train(w, b, opt)
    report["w"] = w.numpy().tolist()
    report["check"] = error_of(strategy.check_mirrored)[:2]
    saved = np.array(w.values[1], copy=True)
    if rank == 1:
        w.values[1][2, 3] += 1.0            # one component of one worker, behind its back
    report["check_tampered"] = error_of(strategy.check_mirrored)[:2]
    w.values[1][...] = saved
    restore_scenarios(w, b)
except Exception as e:  # noqa: BLE001 - recorded for the test
    report["raised"] = type(e).__name__
    report["message"] = str(e)
    report["seconds_to_raise"] = time.perf_counter() - start

rank = MPI.COMM_WORLD.Get_rank()
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(report, f)
