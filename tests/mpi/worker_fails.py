"""Run under `mpiexec -n 2`: worker 1's step fails (an out-of-range label) on the second
step; worker 0, waiting for it in the all-reduce, must raise gd.WorkerError naming it.
Each takes half a second over its report after the error: the first to leave (through MPI
Abort, which stops the whole job) must wait for the other's."""

import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sgd_worker import sgd_worker  # noqa: E402

out_dir = sys.argv[1]
strategy, w, step = sgd_worker(collective_timeout=20.0)
rank = strategy.worker_index
x = np.ones((4, 4), np.float32)
good = np.zeros(4, np.int32)
bad = np.full(4, 7 if rank == 1 else 0, np.int32)
report = {}
step(x, good)
start = time.perf_counter()
try:
    step(x, bad)
    report["raised"] = None
except Exception as e:  # noqa: BLE001 - recorded for the test
    report["raised"] = type(e).__name__
    report["message"] = str(e)
report["seconds"] = time.perf_counter() - start
time.sleep(0.5)              # a slow report: the other worker must not stop this one
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(report, f)
if report["raised"] and rank == 1:
    sys.exit(3)
