"""MultiWorkerMirroredStrategy: MirroredStrategy across worker processes (one per MPI rank).

Each worker runs the replicas of its local devices; the replicas of all workers form one
synchronous group. The step's logical graph is the same as on one machine; what changes is
the lowering of its collectives ("mpi" in passes/collectives/lowerings.py): each worker sums its own
replicas, the workers' sums are all-reduced with MPI (graphdist/device/mpi.py), and every
local replica gets the result. Replica ids are global: worker w's replicas are
w * len(local devices) + 0, 1, .... Variables start from the chief's (rank 0's) values.
"""

from __future__ import annotations

import os

from graphdist import eager
from graphdist.distribute.cross_device_ops import MpiAllReduce
from graphdist.distribute.strategy import MirroredStrategy


class MultiWorkerMirroredStrategy(MirroredStrategy):
    """Synchronous data parallelism over every replica of every worker process.

    Start one process per worker: `graphdist launch -n 2 train.py` (or `mpiexec -n 2 python
    train.py`); each makes the strategy with its local devices (default: cpu:0..K-1 with
    `graphdist launch --devices-per-worker K`, else as MirroredStrategy chooses).

    >>> strategy = gd.MultiWorkerMirroredStrategy(["cpu:0", "cpu:1"])   # doctest: +SKIP
    >>> strategy.num_replicas_in_sync, strategy.worker_index             # doctest: +SKIP
    (4, 0)
    """

    def __init__(self, local_devices=None, cross_device_ops=None,
                 bucket_bytes: int = 25 * 2**20):
        from graphdist.device.mpi import world

        if cross_device_ops is not None:
            raise ValueError("MultiWorkerMirroredStrategy: across workers the all-reduce runs "
                             "on MPI (each worker sums its replicas in order first); "
                             "cross_device_ops must be None")
        self._group = world()
        if local_devices is None and os.environ.get("GRAPHDIST_DEVICES_PER_WORKER"):
            count = int(os.environ["GRAPHDIST_DEVICES_PER_WORKER"])
            local_devices = [f"cpu:{i}" for i in range(count)]
        super().__init__(local_devices, None, bucket_bytes)
        self.cross_device_ops = MpiAllReduce(self._group, self.num_replicas_in_sync,
                                             self._first_replica)
        self.cross_device_ops_chosen = False     # never merged: the workers are processes

    @property
    def num_replicas_in_sync(self) -> int:
        return self._group.size * len(self._devices)

    num_workers = property(lambda self: self._group.size)
    worker_index = property(lambda self: self._group.rank, doc="this worker's MPI rank")
    is_chief = property(lambda self: self._group.rank == 0)
    _first_replica = property(lambda self: self._group.rank * len(self._devices))

    def _initial_value(self, value):
        """Every worker's variables start from the chief's values."""
        import numpy as np

        value = np.array(value, copy=True)
        self._group.bcast(value.reshape(-1).view(np.uint8), 0, "the broadcast of a "
                          "variable's initial value from the chief")
        return value

    def _sum_across_workers(self, value):
        import numpy as np

        total = np.array(value, copy=True)
        self._group.allreduce(total.reshape(-1), "an eager all-reduce")
        return total

    def _from_chief(self, value):
        import numpy as np

        out = np.array(value, copy=True)
        self._group.bcast(out.reshape(-1).view(np.uint8), 0, "a broadcast from the chief")
        return out

    def _step_failed(self, error: BaseException) -> None:
        self._group.abort(error)

    def _eager_reduce(self, op, value, axis):
        """The reduce compiled, so that its all-reduce crosses the workers."""
        compiled = eager.compiled(self._reduce_functions, (op, axis),
                                  lambda v: self.reduce(op, v, axis), quiet=True)
        return compiled(value)

    def __repr__(self) -> str:
        return (f"MultiWorkerMirroredStrategy(worker {self.worker_index} of "
                f"{self.num_workers}, local_devices={list(self._devices)})")
