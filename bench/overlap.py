"""Overlap (issue 26): each gradient bucket's all-reduce started as soon as its gradients
exist and waited for at its first reader (gd.config.set_overlap(True), the default) against
every all-reduce inline where the step computed it (False), side by side in one run:

- "logical": 4 logical CPU devices run as one program (`set_device_concurrency(
  "sequential")`: the host all-reduce on the program's communication thread);
- "threads": the same 4 devices with a thread each (the default: the all-reduce on the
  communication thread of the first device's program);
- "mpi": 2 MPI workers x 1 device (`mpiexec -n 2`, the MPI all-reduce posted early and
  waited for; each sample the slower rank's time, a barrier before each);
- "gpu" (`--gpu`): 4 logical GPUs (the NCCL all-reduce on each device's communication
  stream; every timed call ends with a device synchronize). Without a GPU it says so and
  measures nothing;

for the benchmark MLP (784-1024-1024-10, global batch 512, Adam), the example GPT
(bench/peers/gpt_common.py's sizes) and "tiny" (an MLP 32-32-32-10, batch 32: a check that
a setup runs, as on the simulated GPU). Buckets of --bucket-mib MiB (default 1, DDP's first
bucket; the default 25 MiB holds the whole MLP in one bucket, which only exists once the
backward pass is over, so nothing could overlap). Per row: the step's median time (on and off
interleaved, so drift hits both) and, from `gd.profile_report` of a profiled run of
--profile-steps steps, compute, collective and exposed collective ms per step and the
exposed fraction (exposed / collective); then the collectives started early alone (the
buckets with backward work behind them) and the share of them exposed: the rest is the
inline last bucket, which no schedule can hide (DDP and Horovod expose it too).

    python -m bench.overlap [--steps 15] [--bucket-mib 1] [--setups logical,threads,mpi]
                            [--models mlp,gpt] [--no-mpi] [--json]
    python -m bench.overlap --gpu [--models mlp]

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
from graphdist.runtime import warmup

MODELS = ("mlp", "gpt", "tiny")
SETUPS = ("logical", "threads", "mpi", "gpu")
TITLES = {"logical": "4 logical devices, one program",
          "threads": "4 logical devices, a thread each (default)",
          "mpi": "2 MPI workers", "gpu": "4 logical GPUs"}
TINY = (32, 32, 32, 10)


def _data(model: str):
    if model == "mlp":
        from bench.peers.common import data
        return data()
    if model == "tiny":
        rng = np.random.default_rng(1)
        return (rng.standard_normal((32, TINY[0])).astype(np.float32),
                rng.integers(0, TINY[-1], 32).astype(np.int32))
    from bench.peers.gpt_common import gpt_data
    return gpt_data()


def _make(model: str, strategy):
    from bench.models import make_gpt_step, make_step
    if model == "tiny":
        from bench.peers.common import init
        return make_step(strategy, params=init(sizes=TINY))[0]
    return (make_step if model == "mlp" else make_gpt_step)(strategy)[0]


def _built(model: str, strategy, batch, overlap: bool, concurrency: str = "auto"):
    """The step compiled with overlap on or off in `concurrency` (both settings are read
    when it compiles)."""
    gd.config.set_overlap(overlap)
    gd.config.set_device_concurrency(concurrency)
    try:
        step = _make(model, strategy)
        step(batch)
    finally:
        gd.config.set_overlap(True)
        gd.config.set_device_concurrency("auto")
    return step


def _profiled(step, batch, steps: int) -> dict:
    _, _, trace = step.call_many(lambda _: (batch,), steps, profile=True)
    report = gd.profile_report(trace)
    rows = report["steps"][1:] or report["steps"]     # the first profiled call pays pages
    mean = {k: statistics.mean(r[k] for r in rows) for k in (
        "compute_s", "collective_s", "exposed_s", "overlapped_s", "overlapped_exposed_s")}
    for part, whole in (("exposed", "collective"), ("overlapped_exposed", "overlapped")):
        mean[f"{part}_fraction"] = mean[f"{part}_s"] / mean[f"{whole}_s"] \
            if mean[f"{whole}_s"] else 0.0
    return mean


def _measure(model: str, strategy, batch, steps: int, profile_steps: int, barrier=None,
             slowest=lambda v: v, concurrency: str = "auto", sync=lambda: None) -> dict:
    """{"on": {...}, "off": {...}}: median step seconds (interleaved) and the profile.
    `sync` ends every timed call (a GPU's device synchronize)."""
    made = {"on": _built(model, strategy, batch, True, concurrency),
            "off": _built(model, strategy, batch, False, concurrency)}
    for step in made.values():            # warm-up: pages, kernels
        for _ in range(3):
            step(batch)
    warmup.wait()                         # the kernels still loading in the background
    for step in made.values():
        step(batch)
    sync()
    samples = {k: [] for k in made}
    for _ in range(steps):
        for k, step in made.items():
            if barrier:
                barrier()
            t0 = time.perf_counter()
            step(batch)
            sync()
            samples[k].append(time.perf_counter() - t0)
    samples = slowest(samples)
    out = {}
    for k, step in made.items():
        out[k] = {"median_s": statistics.median(samples[k]), "min_s": min(samples[k]),
                  **_profiled(step, batch, profile_steps)}
    return out


def logical(model: str, args, concurrency: str = "sequential") -> dict:
    strategy = gd.MirroredStrategy([f"cpu:{i}" for i in range(4)])
    strategy.bucket_bytes = int(args.bucket_mib * 2**20)
    batch = next(iter(strategy.experimental_distribute_dataset([_data(model)])))
    return _measure(model, strategy, batch, args.steps, args.profile_steps,
                    concurrency=concurrency)


def threads(model: str, args) -> dict:
    return logical(model, args, "threads")


def gpu(model: str, args) -> dict | None:
    """4 logical GPUs over the physical ones; None where there is no GPU."""
    if not gd.devices("gpu"):
        return None
    import cupy

    gd.config.set_logical_device_count("gpu", 4)
    strategy = gd.MirroredStrategy([f"gpu:{i}" for i in range(4)])
    strategy.bucket_bytes = int(args.bucket_mib * 2**20)
    batch = next(iter(strategy.experimental_distribute_dataset([_data(model)])))
    return _measure(model, strategy, batch, args.steps, args.profile_steps,
                    sync=cupy.cuda.runtime.deviceSynchronize)


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
                         f"{x['exposed_s'] * 1e3:.2f}", f"{x['exposed_fraction']:.0%}",
                         f"{x['overlapped_s'] * 1e3:.2f}",
                         f"{x['overlapped_exposed_fraction']:.0%}" if x["overlapped_s"]
                         else ""])
        rows.append([setup, model, "on/off", f"{r['on']['median_s'] / r['off']['median_s']:.2f}x",
                     "", "", "", "", "", ""])
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--profile-steps", type=int, default=4)
    p.add_argument("--bucket-mib", type=float, default=1.0)
    p.add_argument("--models", default="mlp,gpt")
    p.add_argument("--setups", default="logical,threads,mpi",
                   help=f"comma-separated, of {', '.join(SETUPS)}")
    p.add_argument("--gpu", action="store_true", help="the GPU setup only (--setups gpu)")
    p.add_argument("--no-mpi", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-save", action="store_true")
    p.add_argument("--worker", choices=MODELS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return None
    setups = ["gpu"] if args.gpu else [s for s in args.setups.split(",")
                                       if not (s == "mpi" and args.no_mpi)]
    if "gpu" in setups and not gd.devices("gpu"):
        print("bench.overlap: no GPU here (needs CuPy and a CUDA device); the GPU rows are "
              "skipped")
    run = {"logical": logical, "threads": threads, "mpi": mpi, "gpu": gpu}
    results = {}
    for model in args.models.split(","):
        for setup in setups:
            got = run[setup](model, args)
            if got is not None:
                results[(TITLES[setup], model)] = got
    if not results:
        return None
    header = ["setup", "model", "overlap", "step ms", "compute ms", "collective ms",
              "exposed ms", "exposed", "overlapped ms", "of it exposed"]
    payload = {"bucket_mib": args.bucket_mib, "steps": args.steps,
               "results": [{"setup": s, "model": m, **r} for (s, m), r in results.items()]}
    if args.json:
        print(json.dumps(payload, indent=1))
    else:
        table(f"Overlap: buckets of {args.bucket_mib:g} MiB, median of {args.steps} "
              "interleaved steps; profile means per step", header, rows_of(results))
    if not args.no_save:
        save("overlap", payload, tag="gpu" if setups == ["gpu"] else None)
    return payload


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
