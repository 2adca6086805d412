"""Run under `mpiexec -n 2` or `graphdist launch -n 2`: worker 1 fails outside a step
(argv[2]: "between" raises, "trace" traces a step that raises, "exit" calls
sys.exit(3), "kill" SIGKILLs itself, "hang" sleeps far past the 3 s collective timeout)
after one good step; worker 0 goes on stepping and must raise
gd.WorkerError naming it. Each worker writes what it saw to argv[1]/rank{r}.json; worker
1 writes when it failed (wall clock), so the test can measure detection time."""

import json
import os
import signal
import sys
import time

import numpy as np

import graphdist as gd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sgd_worker import sgd_worker  # noqa: E402

out_dir, kind = sys.argv[1], sys.argv[2]
strategy, w, step = sgd_worker(collective_timeout=3.0 if kind == "hang" else 20.0)
rank = strategy.worker_index
def write(report):
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


x, y = np.ones((4, 4), np.float32), np.zeros(4, np.int32)
step(x, y)
if rank == 1:
    write({"failed_at": time.time()})
    if kind == "between":
        raise ValueError("worker one broke between steps")
    if kind == "exit":
        sys.exit(3)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "trace":            # a step of its own that fails while being traced

        def bad_step(x):
            raise ValueError("worker one's step failed at trace time")

        gd.function(bad_step)(x)
    time.sleep(600)
try:
    for _ in range(3):
        step(x, y)
    write({"raised": None})
except gd.WorkerError as e:
    write({"raised": type(e).__name__, "message": str(e), "at": time.time()})
    raise
