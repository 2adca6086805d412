"""Run under `mpiexec -n 2` (tests/distribute/test_mpi_allreduce_nocopy.py): the
MultiWorkerMirroredStrategy all-reduce of LOCAL replicas per worker, its result returned, kept
in the step (r[:1]), and of a value made inside the step, against a bare comm.Allreduce; each
worker records what MPI was handed (the caller's array itself, IN_PLACE on the step's own
buffer) and writes OUT/rank<r>.json."""

import json
import os
import sys

import numpy as np
from mpi4py import MPI

import graphdist as gd

gd.config.set_overlap(False)   # the inline node (tests/mpi/overlap.py checks the split one)
out_dir, local = sys.argv[1], int(sys.argv[2])
strategy = gd.MultiWorkerMirroredStrategy([f"cpu:{i}" for i in range(local)])
group = strategy.cross_device_ops.group
comm, rank = MPI.COMM_WORLD, strategy.worker_index
SIZE = 1 << 15                     # 128 KiB of float32: an arena buffer in the step


class Recording:
    """group.comm with each Iallreduce of SIZE elements remembered: its send and receive
    buffers."""

    def __init__(self, comm):
        self._comm, self.calls = comm, []

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def Iallreduce(self, send, recv, op):
        if np.asarray(recv).size == SIZE:
            self.calls.append((send, recv))
        return self._comm.Iallreduce(send, recv, op=op)


recording = group.comm = Recording(group.comm)
rng = np.random.default_rng(rank)
xs = [rng.standard_normal(SIZE).astype(np.float32) for _ in range(local)]
originals = [x.copy() for x in xs]
per = strategy.experimental_distribute_values_from_function(
    lambda ctx: xs[ctx.replica_id_in_sync_group - rank * local])


def reduce_in_step(how: str, make=lambda v: v, keep=lambda r: r):
    return gd.function(lambda x: strategy.run(
        lambda v: keep(gd.get_replica_context().all_reduce(how, make(v))), args=(x,)))


def values(result):
    return [np.asarray(v) for v in getattr(result, "values", (result,))]


def bare(how: str, scale: float = 1.0) -> np.ndarray:
    mine = xs[0] * np.float32(scale)
    for x in xs[1:]:
        mine = mine + x * np.float32(scale)
    want = np.empty_like(mine)
    comm.Allreduce(mine, want)
    return want / np.float32(strategy.num_replicas_in_sync) if how == "mean" else want


def handed(call) -> dict:
    """What MPI got: the caller's array itself, IN_PLACE, or another buffer."""
    send, recv = call
    return {"in_place": send is MPI.IN_PLACE,
            "send_is_callers": send is not MPI.IN_PLACE and any(
                np.shares_memory(send, x) for x in xs),
            "recv_is_callers": any(np.shares_memory(recv, x) for x in xs)}


report = {}
cases = {"returned": dict(how="sum"), "returned_mean": dict(how="mean"),
         "kept": dict(how="sum", keep=lambda r: r[:1] * 1.0),
         "made_inside": dict(how="sum", make=lambda v: v * 2.0, keep=lambda r: r[:1] * 1.0)}
for name, case in cases.items():
    step = reduce_in_step(**case)
    recording.calls.clear()
    got = [values(step(per)) for _ in range(2)]
    scale = 2.0 if name == "made_inside" else 1.0
    want = bare(case["how"], scale)
    if "keep" in case:
        want = want[:1] * np.float32(1.0)
    report[name] = {
        "bit_equal": all(np.array_equal(v, want) for run in got for v in run),
        "callers_unchanged": all(np.array_equal(x, o) for x, o in zip(xs, originals)),
        "results_fresh": not any(np.shares_memory(a, b) for a, b in zip(got[0], got[1])),
        "calls": [handed(c) for c in recording.calls]}

with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(report, f)
