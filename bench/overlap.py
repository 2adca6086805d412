"""Overlap (issue 26): each gradient bucket's all-reduce started as soon as its gradients
exist and waited for at its first reader (gd.config.set_overlap(True), the default) against
every all-reduce inline where the step computed it (False), side by side in one run:

- 4 logical CPU devices in one process (the host all-reduce on the program's
  communication thread);
- 2 MPI workers x 1 device (`mpiexec -n 2`, the MPI all-reduce on that thread; each
  sample the slower rank's time, a barrier before each);

for the benchmark MLP (784-1024-1024-10, global batch 512, Adam) and the example GPT
(bench/peers/gpt_common.py's sizes). Buckets of --bucket-mib MiB (default 1, DDP's first
bucket; the default 25 MiB holds the whole MLP in one bucket, which only exists once the
backward pass is over, so nothing could overlap). Per row: the step's median time (on and off
interleaved, so drift hits both) and, from `gd.profile_report` of a profiled run of
--profile-steps steps, compute, collective and exposed collective ms per step and the
exposed fraction (exposed / collective).

    python -m bench.overlap [--steps 15] [--bucket-mib 1] [--no-mpi] [--json]

The machine is a shared 2-core VM: quote ratios from one run, and expect noise. Run with
`env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE` (as the other benchmarks).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

import graphdist as gd
from bench.common import ROOT, save, table

MODELS = ("mlp", "gpt")


def _data(model: str):
    if model == "mlp":
        from bench.peers.common import data
        return data()
    from bench.peers.gpt_common import gpt_data
    return gpt_data()


def _make(model: str, strategy):
    from bench.models import make_gpt_step, make_step
    return (make_step if model == "mlp" else make_gpt_step)(strategy)[0]


def _built(model: str, strategy, batch, overlap: bool):
    """The step compiled with overlap on or off (the setting is read when it compiles)."""
    gd.config.set_overlap(overlap)
    try:
        step = _make(model, strategy)
        step(batch)
    finally:
        gd.config.set_overlap(True)
    return step


def _profiled(step, batch, steps: int) -> dict:
    _, _, trace = step.call_many(lambda _: (batch,), steps, profile=True)
    report = gd.profile_report(trace)
    rows = report["steps"][1:] or report["steps"]     # the first profiled call pays pages
    mean = {k: statistics.mean(r[k] for r in rows) for k in ("compute_s", "collective_s",
                                                             "exposed_s")}
    mean["exposed_fraction"] = mean["exposed_s"] / mean["collective_s"] \
        if mean["collective_s"] else 0.0
    return mean


def _measure(model: str, strategy, batch, steps: int, profile_steps: int, barrier=None,
             slowest=lambda v: v) -> dict:
    """{"on": {...}, "off": {...}}: median step seconds (interleaved) and the profile."""
    made = {"on": _built(model, strategy, batch, True),
            "off": _built(model, strategy, batch, False)}
    for step in made.values():            # warm-up: pages, kernels
        for _ in range(3):
            step(batch)
    samples = {k: [] for k in made}
    for _ in range(steps):
        for k, step in made.items():
            if barrier:
                barrier()
            t0 = time.perf_counter()
            step(batch)
            samples[k].append(time.perf_counter() - t0)
    samples = slowest(samples)
    out = {}
    for k, step in made.items():
        out[k] = {"median_s": statistics.median(samples[k]), "min_s": min(samples[k]),
                  **_profiled(step, batch, profile_steps)}
    return out


def logical(model: str, args) -> dict:
    strategy = gd.MirroredStrategy([f"cpu:{i}" for i in range(4)])
    strategy.bucket_bytes = int(args.bucket_mib * 2**20)
    batch = next(iter(strategy.experimental_distribute_dataset([_data(model)])))
    return _measure(model, strategy, batch, args.steps, args.profile_steps)


def worker(args) -> None:
    """One MPI rank (under mpiexec): rank 0 prints `RESULT {json}`."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    strategy = gd.MultiWorkerMirroredStrategy(["cpu:0"])
    strategy.bucket_bytes = int(args.bucket_mib * 2**20)
    batch = next(iter(strategy.experimental_distribute_dataset([_data(args.worker)])))

    def slowest(samples):
        every = comm.allgather(samples)
        return {k: [max(s[k][i] for s in every) for i in range(len(v))]
                for k, v in samples.items()}

    result = _measure(args.worker, strategy, batch, args.steps, args.profile_steps,
                      barrier=comm.Barrier, slowest=slowest)
    if comm.rank == 0:
        print("RESULT " + json.dumps(result), flush=True)


def mpi(model: str, args) -> dict | None:
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(mpiexec):
        return None
    cmd = [mpiexec, "-n", "2", sys.executable, "-m", "bench.overlap", "--worker", model,
           "--steps", str(args.steps), "--profile-steps", str(args.profile_steps),
           "--bucket-mib", str(args.bucket_mib)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900,
                          env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"bench.overlap --worker {model} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def rows_of(results: dict) -> list:
    rows = []
    for (setup, model), r in results.items():
        for k in ("on", "off"):
            x = r[k]
            rows.append([setup, model, k, f"{x['median_s'] * 1e3:.1f}",
                         f"{x['compute_s'] * 1e3:.1f}", f"{x['collective_s'] * 1e3:.2f}",
                         f"{x['exposed_s'] * 1e3:.2f}", f"{x['exposed_fraction']:.0%}"])
        rows.append([setup, model, "on/off", f"{r['on']['median_s'] / r['off']['median_s']:.2f}x",
                     "", "", "", ""])
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--profile-steps", type=int, default=4)
    p.add_argument("--bucket-mib", type=float, default=1.0)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--no-mpi", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--worker", choices=MODELS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return
    results = {}
    for model in args.models.split(","):
        results[("4 logical devices", model)] = logical(model, args)
        if not args.no_mpi:
            got = mpi(model, args)
            if got is not None:
                results[("2 MPI workers", model)] = got
    header = ["setup", "model", "overlap", "step ms", "compute ms", "collective ms",
              "exposed ms", "exposed"]
    payload = {"bucket_mib": args.bucket_mib, "steps": args.steps,
               "results": [{"setup": s, "model": m, **r} for (s, m), r in results.items()]}
    if args.json:
        print(json.dumps(payload, indent=1))
    else:
        table(f"Overlap: buckets of {args.bucket_mib:g} MiB, median of {args.steps} "
              "interleaved steps; profile means per step", header, rows_of(results))
    save("overlap", payload)


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
