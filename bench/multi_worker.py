"""MultiWorkerMirroredStrategy on this machine: worker processes under MPI (mpiexec, the mpi
extra), each part timed side by side in one run.

1. All-reduce (sum) of a 16 MiB float32 buffer across 2 MPI ranks through the strategy (a
   gd.function whose replica fn returns `all_reduce("sum", x)`, one local device per
   worker) against bare mpi4py `comm.Allreduce(MPI.IN_PLACE, buf)` of the same size,
   interleaved in the same processes (a barrier before every sample; the slower rank's
   time). Target: the strategy within 10% of the bare all-reduce. Algorithmic GB/s =
   buffer bytes / time. Also timed: the bare all-reduce into a new array each call (what
   the step does: its argument stays as it was, the result is a new array), and the bare
   in-place one back to back, with nothing between the calls (its buffer stays in the
   32 MiB L3 cache, and no other allocation disturbs MPI's own temporaries).
2. The MLP 784-1024-1024-10 step (global batch 512, bench/models.make_step) on 2 workers
   x 1 device with one BLAS thread each, against one process with one device and every
   core, and against PyTorch DDP (gloo, 2 processes x 1 thread, bench/peers/
   torch_ddp_mlp.py). Target: the 2 workers at least as fast as the one process, and
   ahead of DDP.
3. The same step on 2 workers x 2 devices against 1 worker x 4 devices.

"loss diff 3 steps": the largest difference from the one-process graphdist step in the
losses of the first three steps (the same initial weights and batch everywhere). PyTorch's
Adam adds eps after the bias correction (TF and graphdist before it), so its losses differ
by ~3e-3 from the second step on.

Each contender of parts 2 and 3 runs in fresh processes (bench/multi_worker_rank.py under
`mpiexec -n 2`, or alone); they take turns for --rounds rounds so that drift (other work on
the machine) hits all alike. Rows are ranked by the best round's median: on a shared
2-core machine another program's burst can slow a whole round several times over (a
process of 2 BLAS threads most: measured 132 ms for a 24 ms step), and the best round is
the one it spared. Every round's median, and the median of all steps, stand beside it.

Why the workers are pinned (`mpiexec -bind-to core`): graphdist sizes its BLAS pool from
the cores the process may run on, and a one-device step asks for all of them, so
OPENBLAS_NUM_THREADS=1 alone does not hold (each worker gets 2 BLAS threads: 4 on 2
cores; the "not pinned" rows show it). Pinned, each worker sees one core and uses one
BLAS thread (checked: the BLAS threads column is what threadpoolctl reports in every
worker after the steps).

    python -m bench.multi_worker [--rounds 3] [--repeat 15] [--optimizer adam] [--no-peers]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys

from bench.common import ROOT, peer_python, save, table
from bench.peers.common import BATCH, SIZES

RANK = [sys.executable, "-m", "bench.multi_worker_rank"]


def mpiexec() -> str | None:
    """The mpiexec beside this Python (mpich from PyPI) or on PATH, when mpi4py is here too;
    else None (the MPI benchmarks are skipped)."""
    if importlib.util.find_spec("mpi4py") is None:
        return None
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else shutil.which("mpiexec")


def _env(one_thread: bool = False, peer: bool = False) -> dict:
    env = dict(os.environ)
    if peer:                                 # peers get the user's environment
        from graphdist.device.threads import ENV_SET

        env = {k: v for k, v in env.items() if k not in ENV_SET}
    if one_thread:
        env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


def run(command: list, env: dict, timeout: int = 600) -> dict | None:
    """The `RESULT {json}` line the command's rank 0 prints (None when it fails)."""
    try:
        done = subprocess.run(command, check=False, cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        print(f"timed out: {' '.join(command)}", file=sys.stderr)
        return None
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    print(f"failed: {' '.join(command)}\n{done.stdout[-1000:]}\n{done.stderr[-2000:]}",
          file=sys.stderr)
    return None


def load() -> list:
    return [round(x, 2) for x in os.getloadavg()]


# ---------------------------------------------------------------- part 1
def part_allreduce(mpi: str, mib: int, repeat: int) -> tuple[dict, str]:
    from bench.multi_worker_rank import BARE, BARE_ALONE, BARE_OUT, BARE_SAME, STEP, STEP_BUCKET

    r = run([mpi, "-n", "2", *RANK, "allreduce", "--mib", str(mib), "--repeat", str(repeat)],
            _env())
    if r is None:
        return {}, ""
    res, nbytes = r["results"], r["bytes"]
    bare = res[BARE_SAME]["median_s"]
    rows = []
    for name in (STEP, STEP_BUCKET, BARE_SAME, BARE, BARE_OUT, BARE_ALONE):
        v = res[name]
        rows.append([name, v["median_s"] * 1e3, v["min_s"] * 1e3, nbytes / v["median_s"] / 1e9,
                     nbytes / v["min_s"] / 1e9, v["median_s"] / bare])
    # a gradient bucket's all-reduce stays in the step; returning the result hands the
    # caller a fresh 16 MiB array each call (the "Allreduce(x, out)" row's cost). The step
    # cannot write over its caller's x: it copies x into its buffer, as BARE_SAME does
    over = res[STEP_BUCKET]["median_s"] / bare - 1
    text = table(f"all-reduce sum of {mib} MiB float32 across 2 MPI ranks, 1 device each "
                 f"(median of {repeat}, interleaved, the slower rank per sample; target: "
                 f"graphdist's bucket all-reduce within 10% of bare mpi4py doing the same work "
                 f"(copy x, all-reduce in place); here "
                 f"{over:+.0%})",
                 ["contender", "median ms", "min ms", "GB/s", "GB/s at min", "time vs same work"],
                 rows)
    return {**r, "overhead_vs_bare": over}, text


# ---------------------------------------------------------------- parts 2 and 3
def mlp_contenders(mpi: str, optimizer: str, repeat: int, peers: bool) -> dict:
    """{name: (part, command, env)}"""
    common = ["--optimizer", optimizer, "--repeat", str(repeat)]
    mlp = [*RANK, "mlp", *common]
    two = [mpi, "-n", "2"]
    pinned = [mpi, "-bind-to", "core", "-n", "2"]
    out = {
        "graphdist 1 process, 1 device, 2 BLAS threads":
            (2, [*mlp, "--strategy", "one"], _env()),
        "graphdist 2 workers x 1 device, 1 BLAS thread each (pinned)":
            (2, [*pinned, *mlp, "--strategy", "multi", "--devices", "1"], _env(True)),
        "graphdist 2 workers x 1 device, OPENBLAS_NUM_THREADS=1, not pinned":
            (2, [*two, *mlp, "--strategy", "multi", "--devices", "1"], _env(True)),
        "graphdist 1 worker x 4 devices (MirroredStrategy)":
            (3, [*mlp, "--strategy", "mirrored", "--devices", "4"], _env()),
        "graphdist 2 workers x 2 devices (not pinned)":
            (3, [*two, *mlp, "--strategy", "multi", "--devices", "2"], _env()),
        "graphdist 2 workers x 2 devices (pinned)":
            (3, [*pinned, *mlp, "--strategy", "multi", "--devices", "2"], _env()),
    }
    python = peer_python() if peers else None
    if python:
        ddp = [python, "-m", "bench.peers.torch_ddp_mlp", *common]
        out["PyTorch DDP gloo, 2 procs x 1 thread"] = (2, ddp, _env(True, peer=True))
        out["PyTorch DDP gloo, 2 procs x 1 thread (pinned)"] = (2, [*ddp, "--pin"],
                                                               _env(True, peer=True))
        out["PyTorch 1 process x 2 threads"] = (2, [*ddp, "--procs", "1", "--threads", "2"],
                                                _env(peer=True))
    return out


def part_mlp(contenders: dict, rounds: int) -> dict:
    """Every contender once per round, in turn; {name: pooled result}."""
    got = {name: [] for name in contenders}
    for k in range(rounds):
        for name, (_, command, env) in contenders.items():
            r = run(command, env)
            if r is not None:
                got[name].append(r)
                print(f"  round {k + 1}/{rounds}: {name}: {r['median_s'] * 1e3:.1f} ms "
                      f"(load {load()[0]})", flush=True)
    out = {}
    for name, runs in got.items():
        if not runs:
            continue
        samples = [s for r in runs for s in r["samples_s"]]
        per = runs[-1].get("per_worker")
        threads = (sorted({t for w in per for t in w["blas_threads"]}) if per
                   else [runs[-1].get("threads")])
        rounds = [r["median_s"] for r in runs]
        out[name] = {"best_round_median_s": min(rounds),
                     "median_s": statistics.median(samples), "min_s": min(samples),
                     "round_medians_s": rounds,
                     "samples": len(samples), "losses": runs[-1]["losses"],
                     "threads_per_process": threads, "runs": runs}
    return out


def mlp_table(title: str, names: list, res: dict, base: str) -> str:
    rows = []
    b = res.get(base)
    for name in names:
        if name not in res:
            continue
        v = res[name]
        best = v["best_round_median_s"]
        diff = (max(abs(a - c) for a, c in zip(v["losses"], b["losses"])) if b else None)
        rows.append([name, best * 1e3, v["median_s"] * 1e3, v["min_s"] * 1e3,
                     " ".join(f"{r * 1e3:.1f}" for r in v["round_medians_s"]),
                     b["best_round_median_s"] / best if b else "",
                     ",".join(map(str, v["threads_per_process"])),
                     "" if diff is None else f"{diff:.1e}"])
    return table(title, ["contender", "best round ms", "all steps median ms", "min ms",
                         "round medians ms", "speed vs 1 process", "BLAS thr/proc",
                         "loss diff 3 steps"], rows)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=15, help="timed steps per run")
    ap.add_argument("--allreduce-repeat", type=int, default=30)
    ap.add_argument("--mib", type=int, default=16)
    ap.add_argument("--optimizer", default="adam", choices=("adam", "momentum"))
    ap.add_argument("--no-peers", action="store_true")
    args = ap.parse_args(argv if argv is not None else [])
    mpi = mpiexec()
    if mpi is None:
        print("bench.multi_worker: needs the mpi extra (mpi4py and mpich): "
              "pip install 'graphdist[mpi]'", file=sys.stderr)
        return {}
    load_before = load()
    print(f"load average before: {load_before} on {os.cpu_count()} cores\n")
    results, texts = {}, []
    results["allreduce"], text = part_allreduce(mpi, args.mib, args.allreduce_repeat)
    texts.append(text)
    contenders = mlp_contenders(mpi, args.optimizer, args.repeat, not args.no_peers)
    res = part_mlp(contenders, args.rounds)
    results["mlp"] = res
    base = "graphdist 1 process, 1 device, 2 BLAS threads"
    model = f"MLP {'-'.join(map(str, SIZES))} step ({args.optimizer}), global batch {BATCH}"
    texts.append(mlp_table(
        f"{model}: 2 workers x 1 device vs one process and PyTorch DDP (best of "
        f"{args.rounds} rounds' medians of {args.repeat} steps; target: 2 workers (pinned) at "
        "least as fast as 1 process, and ahead of DDP)",
        [n for n, c in contenders.items() if c[0] == 2], res, base))
    texts.append(mlp_table(
        f"{model}: 2 workers x 2 devices vs 1 worker x 4 devices (best of {args.rounds} "
        f"rounds' medians of {args.repeat} steps)",
        [base] + [n for n, c in contenders.items() if c[0] == 3], res, base))
    load_after = load()
    print(f"load average after: {load_after}")
    save("multi_worker", {"optimizer": args.optimizer, "rounds": args.rounds,
                          "repeat": args.repeat, "load_before": load_before,
                          "load_after": load_after, "results": results,
                          "table": "\n\n".join(texts)})
    return results


def plot(payload):
    """The all-reduce across 2 ranks (graphdist against bare mpi4py, the bound) and the MLP
    step per layout of workers and devices (ranked in the table by the best round)."""
    from bench.plots import GRAPHDIST, PEER, REFERENCE, bars, figure, rows_height, timings

    results = payload.get("results", {})
    reduce = (results.get("allreduce") or {}).get("results", {})
    parts = [(f"all-reduce of {results['allreduce'].get('mib', '?')} MiB, 2 ranks",
              *timings(reduce), "ms per all-reduce (bar: median, |: min)")] if reduce else []
    mlp = results.get("mlp") or {}
    if mlp:
        medians, _ = timings(mlp, "best_round_median_s")
        parts.append((f"MLP step ({payload.get('optimizer', 'adam')})", medians,
                      timings(mlp)[1], "ms per step (bar: best round's median, |: min)"))
    if not parts:
        return None
    fig, axes = figure("MultiWorkerMirroredStrategy on MPI", width=11,
                       height=rows_height(max(len(p[1]) for p in parts)) + 0.4,
                       ncols=len(parts))
    for ax, (title, medians, mins, xlabel) in zip(axes, parts):
        colors = {n: GRAPHDIST if n.startswith("graphdist") else
                  REFERENCE if n.startswith("mpi4py") else PEER for n in medians}
        bars(ax, medians, xlabel, mins=mins, colors=colors,
             highlight=["graphdist 2 workers x 1 device, 1 BLAS thread each (pinned)"])
        ax.set_title(title, fontsize=9)
    return fig


if __name__ == "__main__":
    main(sys.argv[1:])
