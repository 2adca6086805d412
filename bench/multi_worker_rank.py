"""One contender of bench/multi_worker.py, run in its own processes: under `mpiexec -n W`
(every rank runs this module; MultiWorkerMirroredStrategy) or alone (one process). Rank 0
prints one `RESULT {json}` line, as the peer scripts do.

    mpiexec -n 2 python -m bench.multi_worker_rank allreduce [--mib 16] [--repeat 30]
    mpiexec -n 2 python -m bench.multi_worker_rank mlp --strategy multi --devices 1
    python -m bench.multi_worker_rank mlp --strategy one      # or mirrored --devices 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

import graphdist as gd
from bench.peers.common import report


def _blas_threads() -> list:
    from threadpoolctl import threadpool_info

    return [i["num_threads"] for i in threadpool_info() if i.get("user_api") == "blas"]


def _per_sample_max(comm, samples: dict) -> dict:
    """{name: [seconds]}: per sample, the slower rank's time (every rank took part)."""
    every = comm.allgather(samples)
    return {k: [max(s[k][i] for s in every) for i in range(len(v))] for k, v in samples.items()}


def _summary(v: list) -> dict:
    return {"median_s": statistics.median(v), "min_s": min(v),
            "q25_s": float(np.percentile(v, 25)), "q75_s": float(np.percentile(v, 75)),
            "repeat": len(v)}


# ---------------------------------------------------------------- part 1: the all-reduce
STEP = "graphdist MultiWorkerMirrored all_reduce (gd.function)"
STEP_BUCKET = ("graphdist all_reduce, result kept in the step (as a gradient bucket: "
               "returns r[:1])")
BARE = "mpi4py comm.Allreduce(IN_PLACE, buf)"
BARE_OUT = "mpi4py comm.Allreduce(x, out), out = np.empty_like(x) each call"
BARE_SAME = ("mpi4py np.copyto(out, x); comm.Allreduce(IN_PLACE, out), the same out each "
             "call (the bucket step's work)")
BARE_ALONE = "mpi4py comm.Allreduce(IN_PLACE, buf), back to back (not interleaved)"


def allreduce(args) -> None:
    from mpi4py import MPI

    strategy = gd.MultiWorkerMirroredStrategy(["cpu:0"])
    comm = MPI.COMM_WORLD
    size = args.mib * 2**20 // 4
    x = np.random.default_rng(comm.rank).standard_normal(size).astype(np.float32)
    buf = x.copy()                           # the bare in-place all-reduce's own buffer
    same = np.empty_like(x)                  # the bare form of the bucket step's buffer

    @gd.function
    def step(x):
        return strategy.run(lambda v: gd.get_replica_context().all_reduce("sum", v),
                            args=(x,))

    @gd.function
    def bucket(x):               # the reduced buffer stays in the program, as a bucket does
        return strategy.run(lambda v: gd.get_replica_context().all_reduce("sum", v)[:1],
                            args=(x,))

    want = np.empty_like(x)
    comm.Allreduce(x, want)
    np.testing.assert_array_equal(step(x), want)     # compile, and check before timing

    def bare_out():
        out = np.empty_like(x)
        comm.Allreduce(x, out)
        return out

    head = bucket(x)                  # a per-replica value (one replica here)
    np.testing.assert_array_equal(getattr(head, "values", (head,))[0], want[:1])
    def bare_same():
        np.copyto(same, x)
        comm.Allreduce(MPI.IN_PLACE, same)

    contenders = {STEP: lambda: step(x), STEP_BUCKET: lambda: bucket(x),
                  BARE: lambda: comm.Allreduce(MPI.IN_PLACE, buf), BARE_OUT: bare_out,
                  BARE_SAME: bare_same}
    samples = {k: [] for k in contenders}
    for fn in contenders.values():
        for _ in range(args.warmup):
            comm.Barrier()
            fn()
    for _ in range(args.repeat):             # interleaved; every sample starts together
        for k, fn in contenders.items():
            comm.Barrier()
            t0 = time.perf_counter()
            fn()
            samples[k].append(time.perf_counter() - t0)
    samples[BARE_ALONE] = []               # the same, with nothing else between the calls
    for _ in range(args.repeat):
        comm.Barrier()
        t0 = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, buf)
        samples[BARE_ALONE].append(time.perf_counter() - t0)
    samples = _per_sample_max(comm, samples)
    if comm.rank == 0:
        report({"workers": comm.size, "mib": args.mib, "bytes": x.nbytes,
                "results": {k: {**_summary(v), "samples_s": v} for k, v in samples.items()}})


# ---------------------------------------------------------------- parts 2 and 3: the MLP
def _strategy(kind: str, devices: int):
    cpus = [f"cpu:{i}" for i in range(devices)]
    if kind == "multi":
        return gd.MultiWorkerMirroredStrategy(cpus)
    if kind == "mirrored":
        return gd.MirroredStrategy(cpus)
    return gd.OneDeviceStrategy("cpu:0")


def mlp(args) -> None:
    from bench.models import make_step
    from bench.peers.common import data

    strategy = _strategy(args.strategy, args.devices)
    x, y = data()
    step, _ = make_step(strategy, args.optimizer)
    batch = ((x, y) if args.strategy == "one"      # this worker's shards of the global batch
             else next(iter(strategy.experimental_distribute_dataset([(x, y)]))))
    losses = [float(step(batch)) for _ in range(3)]     # the same first 3 steps everywhere
    for _ in range(args.warmup):
        step(batch)
    samples = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        step(batch)
        samples.append(time.perf_counter() - t0)
    seen = {"blas_threads": _blas_threads(), "affinity": sorted(os.sched_getaffinity(0)),
            "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS")}
    rank = 0
    if args.strategy == "multi":
        from mpi4py import MPI

        rank, seen = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.gather(seen)
        samples = _per_sample_max(MPI.COMM_WORLD, {"s": samples})["s"]
    if rank == 0:
        workers = seen if isinstance(seen, list) else [seen]
        report({"strategy": args.strategy, "devices": args.devices, "workers": len(workers),
                "optimizer": args.optimizer, "losses": losses, "per_worker": workers,
                **_summary(samples), "samples_s": samples})


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("allreduce", "mlp"))
    ap.add_argument("--mib", type=int, default=16)
    ap.add_argument("--strategy", choices=("multi", "one", "mirrored"), default="multi")
    ap.add_argument("--devices", type=int, default=1, help="local devices per worker")
    ap.add_argument("--optimizer", default="adam")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args(argv)
    {"allreduce": allreduce, "mlp": mlp}[args.what](args)


if __name__ == "__main__":
    main()
