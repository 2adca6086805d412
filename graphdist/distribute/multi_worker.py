"""MultiWorkerMirroredStrategy: MirroredStrategy across worker processes (one per MPI rank).

Each worker runs the replicas of its local devices; the replicas of all workers form one
synchronous group. The step's logical graph is the same as on one machine; what changes is
the lowering of its collectives ("mpi" in passes/collectives/lowerings.py): each worker sums its own
replicas, the workers' sums are all-reduced with MPI (graphdist/device/mpi.py), and every
local replica gets the result. Replica ids are global: worker w's replicas are
w * len(local devices) + 0, 1, .... Variables start from the chief's (rank 0's) values.

Before any data moves the workers agree (`exchange`): on the layout when the strategy is
made, on each variable's signature when it is made, and on the number of variables at the
first trace of a step; flat buffers of different shapes would otherwise line up silently.
"""

from __future__ import annotations

import hashlib
import json
import os
import weakref

from graphdist import eager
from graphdist.distribute.cross_device_ops import MpiAllReduce
from graphdist.distribute.strategy import MirroredStrategy
from graphdist.errors import WorkerError
from graphdist.ops.core import current_tracer
from graphdist.runtime.schedule_check import agree_on_collective


def exchange(group, payload, what: str, purpose: str = "agreement") -> list:
    """Every worker's `payload` (JSON-able data), in rank order, on every worker.

    Two all-gathers of fixed form (each worker's byte count, then the bytes padded to the
    longest), so workers that exchange different kinds of payload still meet in the same
    collectives, see the same list and take the same decision: workers whose `purpose`
    differs (one checks its variables, another restores) raise WorkerError together."""
    import numpy as np

    # first the header every collective outside compiled code carries: a worker that is
    # in a step, or in another kind of exchange, makes both raise naming each one's line
    agree_on_collective(group, f"the {purpose} exchange", (), "bytes")
    data = json.dumps({"purpose": purpose, "what": what, "payload": payload},
                      sort_keys=True).encode()
    counts = np.zeros(group.size, np.int64)
    group.allgather(np.array([len(data)], np.int64), counts, f"the sizes of {what}")
    width = int(counts.max())
    mine = np.zeros(width, np.uint8)
    mine[:len(data)] = np.frombuffer(data, np.uint8)
    every = np.zeros(group.size * width, np.uint8)
    group.allgather(mine, every, what)
    every = [json.loads(every[r * width:r * width + int(n)].tobytes().decode())
             for r, n in enumerate(counts)]
    for rank, theirs in enumerate(every):
        if theirs["purpose"] != purpose:
            raise WorkerError(f"workers out of step: worker {group.rank} was in {what} while "
                              f"worker {rank} was in {theirs['what']}")
    return [theirs["payload"] for theirs in every]


def digest(array) -> str:
    """A checksum of an array's bytes, dtype and shape (bit-identical arrays only match)."""
    import numpy as np

    array = np.require(array, requirements="C")      # (ascontiguousarray makes 0-d 1-d)
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{array.dtype.str}{array.shape}".encode())
    h.update(array.reshape(-1).view(np.uint8).data if array.size else b"")
    return h.hexdigest()


def _describe(signature: dict) -> str:
    """One worker's agreement payload in words."""
    if signature["kind"] == "layout":
        count = signature["local_devices"]
        return f"{count} local device{'s' if count != 1 else ''}"
    if signature["kind"] == "step":
        return (f"its first step after {signature['variables']} variables, without "
                "making another")
    return (f"variable #{signature['index']} {signature['name']!r} shape "
            f"{tuple(signature['shape'])} {signature['dtype']} synchronization "
            f"{signature['synchronization']} aggregation {signature['aggregation']}")


def agree(group, signature: dict, what: str) -> None:
    """Raise WorkerError on every worker unless every worker's `signature` equals the chief's,
    naming the first worker that differs and both signatures."""
    every = exchange(group, signature, what)
    for rank, theirs in enumerate(every):
        if theirs != every[0]:
            raise WorkerError(f"workers disagree on {what}: worker 0 has {_describe(every[0])}; "
                              f"worker {rank} has {_describe(theirs)} (every worker must make "
                              "the same strategy and the same variables in the same order "
                              "before its first step)")


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
                 bucket_bytes: int = 25 * 2**20, zero_stage: int = 0):
        from graphdist.device.mpi import install_failure_hooks, world

        if cross_device_ops is not None:
            raise ValueError("MultiWorkerMirroredStrategy: across workers the all-reduce runs "
                             "on MPI (each worker sums its replicas in order first); "
                             "cross_device_ops must be None")
        self._group = world()
        install_failure_hooks(self._group)   # any failure here is named on the others
        if local_devices is None and os.environ.get("GRAPHDIST_DEVICES_PER_WORKER"):
            count = int(os.environ["GRAPHDIST_DEVICES_PER_WORKER"])
            local_devices = [f"cpu:{i}" for i in range(count)]
        super().__init__(local_devices, None, bucket_bytes, zero_stage)
        self.cross_device_ops = MpiAllReduce(self._group, self.num_replicas_in_sync,
                                             self._first_replica)
        self.cross_device_ops_chosen = False     # never merged: the workers are processes
        self._variables_made = 0                  # under the scope, so far
        self._agreed_variables = 0                # how many a step has been checked against
        self._traced_steps = weakref.WeakSet()    # the step functions traced so far
        agree(self._group, {"kind": "layout", "local_devices": len(self._devices)},
              "the layout of MultiWorkerMirroredStrategy")

    @property
    def num_replicas_in_sync(self) -> int:
        return self._group.size * len(self._devices)

    num_workers = property(lambda self: self._group.size)
    worker_index = property(lambda self: self._group.rank, doc="this worker's MPI rank")
    is_chief = property(lambda self: self._group.rank == 0)
    _first_replica = property(lambda self: self._group.rank * len(self._devices))

    def _initial_value(self, value, variable=None):
        """Every worker's variables start from the chief's values, once every worker has
        shown that it makes the same variable (else the raw bytes would line up silently)."""
        import numpy as np

        value = np.array(value, copy=True)
        index = self._variables_made
        self._variables_made += 1
        if variable is not None:
            agree(self._group, {"kind": "variable", "index": index, "name": variable.name,
                                "shape": list(value.shape), "dtype": value.dtype.name,
                                "synchronization": variable.synchronization.name,
                                "aggregation": variable.aggregation.name},
                  f"variable #{index} {variable.name!r}")
        self._group.bcast(value.reshape(-1).view(np.uint8), 0, "the broadcast of a "
                          "variable's initial value from the chief")
        return value

    def run(self, fn, args=(), kwargs=None):
        if current_tracer() is None:
            return super().run(fn, args, kwargs)
        self._agree_before_step(fn)
        try:
            return super().run(fn, args, kwargs)
        finally:   # slots made in the trace were agreed one by one: every worker has them
            self._agreed_variables = self._variables_made

    def _agree_before_step(self, fn) -> None:
        """At the first trace of a step function, when variables were made since the last
        check: every worker has made as many (a worker with an extra variable is still
        making it, and meets this exchange with its own). Only first traces: a worker may
        retrace a step alone (its shards have other shapes)."""
        function = getattr(fn, "__func__", fn)
        try:
            first = function not in self._traced_steps
            self._traced_steps.add(function)
        except TypeError:                         # not weakly referable: treat as first
            first = True
        made = self._variables_made
        if first and made != self._agreed_variables:
            agree(self._group, {"kind": "step", "variables": made},
                  "the variables made before a step")
            self._agreed_variables = made

    def check_mirrored(self) -> None:
        """Every mirrored variable bit-identical on every replica of every worker, else
        gd.WorkerError on every worker naming the first variable that is not and the
        replicas (global ids) whose bytes differ. The workers compare checksums."""
        variables = self._mirrored_variables()
        mine = [[v.name, [digest(v._host(k)) for k in range(len(v.values))]]
                for v in variables]
        every = exchange(self._group, mine, "check_mirrored's checksums", "check_mirrored")
        for rank, theirs in enumerate(every):
            if len(theirs) != len(every[0]):
                raise WorkerError(f"check_mirrored: worker 0 has {len(every[0])} mirrored "
                                  f"variables, worker {rank} has {len(theirs)}")
        local = len(self._devices)
        for i, (name, reference) in enumerate(every[0]):
            differ = [rank * local + k for rank, theirs in enumerate(every)
                      for k, checksum in enumerate(theirs[i][1]) if checksum != reference[0]]
            if differ or any(theirs[i][0] != name for theirs in every):
                names = sorted({theirs[i][0] for theirs in every})
                raise WorkerError(f"check_mirrored: mirrored variable {name!r} (#{i}) differs "
                                  f"from replica 0 (worker 0) on replicas {differ}"
                                  + (f"; the workers' variable #{i} is named {names}"
                                     if len(names) > 1 else ""))

    def _sum_across_workers(self, value):
        """The sum of every worker's `value` (a sync-on-read variable's read, outside
        compiled code), after the header check: a worker elsewhere (in a step, reading
        another variable) makes every worker raise naming each one's line."""
        import numpy as np

        total = np.array(value, copy=True)
        agree_on_collective(self._group, "all_reduce (a sync-on-read read)", total.shape,
                            total.dtype.name, "sum")
        self._group.allreduce(total.reshape(-1), "an eager all-reduce (a sync-on-read read)")
        return total

    def _from_chief(self, value):
        """The chief's `value` on every worker, after the header check (as above)."""
        import numpy as np

        out = np.array(value, copy=True)
        agree_on_collective(self._group, "broadcast from the chief", out.shape,
                            out.dtype.name)
        self._group.bcast(out.reshape(-1).view(np.uint8), 0, "a broadcast from the chief")
        return out

    def _step_failed(self, error: BaseException) -> None:
        self._group.abort(error)

    def _eager_reduce(self, op, value, axis):
        """The reduce compiled, so that its all-reduce crosses the workers."""
        compiled = eager.compiled(self._reduce_functions, (op, axis),
                                  lambda v: self.reduce(op, v, axis), quiet=True)
        return compiled(value)

    def gather(self, value, axis=0):
        """As MirroredStrategy.gather; called eagerly on this worker's components it is
        compiled, as an eager reduce is, so that its all-gather crosses the workers (and
        carries the schedule check)."""
        if current_tracer() is None and self.num_workers > 1 \
                and not isinstance(value, (list, tuple, dict)):
            compiled = eager.compiled(self._reduce_functions, ("gather", axis),
                                      lambda v: self.gather(v, axis), quiet=True)
            return compiled(value)
        return super().gather(value, axis)

    def __repr__(self) -> str:
        return (f"MultiWorkerMirroredStrategy(worker {self.worker_index} of "
                f"{self.num_workers}, local_devices={list(self._devices)})")
