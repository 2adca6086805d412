"""One rank of bench/zero.py's multi-worker part, under `mpiexec -n 2`: the MLP step
(bench/models.make_step, Adam, global batch 512) on MultiWorkerMirroredStrategy(["cpu:0"],
zero_stage=s) for s = 0, 1, 2 built in the same processes and timed interleaved (a barrier
before every sample; per sample the slower rank's time). Rank 0 prints one `RESULT {json}`
line, with each stage's first three losses (the same initial weights and batch).

    mpiexec -bind-to core -n 2 python -m bench.zero_rank [--repeat 20]
"""

from __future__ import annotations

import argparse
import time

import graphdist as gd
from bench.multi_worker_rank import _blas_threads, _per_sample_max, _summary
from bench.peers.common import report

STAGES = (0, 1, 2)


def main(argv=None) -> None:
    from mpi4py import MPI

    from bench.models import make_step
    from bench.peers.common import data

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    steps, losses = {}, {}
    for stage in STAGES:
        strategy = gd.MultiWorkerMirroredStrategy(["cpu:0"], zero_stage=stage)
        step, _ = make_step(strategy, "adam")
        batch = next(iter(strategy.experimental_distribute_dataset([data()])))
        name = f"stage {stage}"
        steps[name] = (lambda step=step, batch=batch: step(batch))
        losses[name] = [float(step(batch)) for _ in range(3)]
    for fn in steps.values():
        for _ in range(args.warmup):
            comm.Barrier()
            fn()
    samples = {k: [] for k in steps}
    for _ in range(args.repeat):
        for name, fn in steps.items():
            comm.Barrier()
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    samples = _per_sample_max(comm, samples)
    threads = comm.gather(_blas_threads())
    if comm.rank == 0:
        report({"workers": comm.size, "devices_per_worker": 1, "blas_threads": threads,
                "results": {k: {**_summary(v), "losses": losses[k], "samples_s": v}
                            for k, v in samples.items()}})


if __name__ == "__main__":
    main()
