"""Sharded optimizer state and gradient accumulation (issue 25) on the benchmark MLP
(784-1024-1024-10, Adam, global batch 512) over 4 logical CPU devices, in one run:

- memory per replica at zero_stage 0, 1, 2: the planner's figure (g.summary()'s memory
  table: parameters, reduced gradients, slots, peak activations of the replicated graph),
  the process's peak RSS (each stage in a fresh subprocess, so one stage's arrays do not
  hide another's), and the formula (float32 Adam: 4 + 4 + 8 bytes per parameter; stage 1
  4 + 4 + 8/N, stage 2 4 + 12/N; plus the activations, which data parallelism keeps);
- step time at stages 0, 1, 2, interleaved (target: stage 1 within 10% of stage 0);
- gradient accumulation: a micro-step (accumulating, k large enough that no call applies)
  against the plain step and against the step's compute alone (loss and gradients written
  to per-replica variables, no update, no collective; target: micro-step within 5%).

PyTorch's ZeroRedundancyOptimizer, the peer the issue names, is not run: torch is not
installed in this environment (the script says so in its output when it is missing).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python -m bench.zero [--repeat 15]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import resource
import subprocess
import sys

import numpy as np

import graphdist as gd
from bench.common import interleaved, save, table
from bench.models import mlp_loss
from bench.peers.common import BATCH, SIZES, data, init

N = 4
DEVICES = [f"cpu:{i}" for i in range(N)]


def make(stage: int = 0, accumulation: int = 1, update: bool = True):
    """(step, batch) of the MLP on N logical devices at `stage`. update=False: compute
    alone, the gradients written to per-replica variables."""
    strategy = gd.MirroredStrategy(DEVICES, zero_stage=stage)
    with strategy.scope():
        ws = [gd.Variable(p, name=f"p{i}") for i, p in enumerate(init())]
        opt = gd.optimizers.Adam(1e-3, gradient_accumulation_steps=accumulation)
        sinks = [gd.Variable(np.zeros_like(p), name=f"g{i}", trainable=False,
                             synchronization=gd.VariableSynchronization.ON_READ)
                 for i, p in enumerate(init())] if not update else []

    @gd.function
    def step(x, y):
        def replica_fn(x, y):
            with gd.GradientTape() as tape:
                loss = mlp_loss(ws, x, y)
            grads = tape.gradient(loss, ws)
            if update:
                opt.apply_gradients(zip(grads, ws))
            else:
                for sink, g in zip(sinks, grads):
                    sink.assign(g)
            return loss
        return strategy.run(replica_fn, args=(x, y))

    batch = next(iter(strategy.experimental_distribute_dataset([data()])))
    return step, batch


def planner_memory(stage: int) -> dict:
    """The planner's per-replica bytes (replica 0's device) after one step."""
    from graphdist.viz.summary import stats

    step, batch = make(stage)
    step(*batch)
    row = stats(step.replicated_graph)["memory"][DEVICES[0]]
    return {k: int(v) for k, v in row.items()}


def _current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _rss_child(stage: int) -> None:
    """Run in a subprocess: the process's resident bytes after a few steps at `stage`, with
    every kernel loaded (Numba's background loading alone adds ~200 MB at a time of its
    own choosing, the same at every stage), and its peak."""
    from graphdist.function import _kernels_loaded

    step, batch = make(stage)
    step(*batch)
    _kernels_loaded()
    for _ in range(3):
        step(*batch)
    print(json.dumps({"rss_B": _current_rss(),
                      "maxrss_B": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


def peak_rss(stage: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "bench.zero", "--rss-child", str(stage)],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def formula(stage: int, activations: int) -> int:
    params = sum(math.prod(p.shape) for p in init())
    per_param = {0: 4 + 4 + 8, 1: 4 + 4 + 8 / N, 2: 4 + (4 + 8) / N}[stage]
    return int(per_param * params + activations)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--rss-child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rss_child is not None:
        _rss_child(args.rss_child)
        return {}
    memory, rows = {}, []
    for stage in (0, 1, 2):
        planned = planner_memory(stage)
        total = sum(planned.values())
        memory[stage] = {**planned, "planner_total_B": total,
                         "formula_B": formula(stage, planned["peak activations"]),
                         **peak_rss(stage)}
    mib = 2**20
    for stage, m in memory.items():
        rows.append([stage, m["parameters"] / mib, m["gradients"] / mib,
                     m["optimizer slots"] / mib, m["peak activations"] / mib,
                     m["planner_total_B"] / mib, m["formula_B"] / mib, m["rss_B"] / mib,
                     m["maxrss_B"] / mib])
    mem_text = table(f"MLP {'-'.join(map(str, SIZES))} Adam, {N} logical CPU devices: memory "
                     "per replica (MiB; planner = g.summary(); RSS: the whole process, all "
                     f"{N} replicas, kernels and interpreter included, after 4 steps)",
                     ["stage", "params", "grads", "slots", "activations", "planner total",
                      "formula", "process RSS", "peak RSS"], rows)
    steps = {f"stage {s}": make(s) for s in (0, 1, 2)}
    steps["micro-step (k=10^6)"] = make(0, accumulation=10**6)
    steps["compute alone"] = make(0, update=False)
    timed = interleaved({name: (lambda sb=sb: sb[0](*sb[1])) for name, sb in steps.items()},
                        repeat=args.repeat)
    base = timed["stage 0"]["median_s"]
    compute = timed["compute alone"]["median_s"]
    time_rows = [[name, r["median_s"] * 1e3, r["min_s"] * 1e3, r["median_s"] / base,
                  r["median_s"] / compute] for name, r in timed.items()]
    time_text = table(f"step time, global batch {BATCH} on {N} logical CPU devices (median of "
                      f"{args.repeat}, interleaved; targets: stage 1 within 10% of stage 0, "
                      "micro-step within 5% of compute alone)",
                      ["step", "median ms", "min ms", "vs stage 0", "vs compute alone"],
                      time_rows)
    peer = ("torch is not installed here: PyTorch's ZeroRedundancyOptimizer was not run"
            if importlib.util.find_spec("torch") is None else
            "torch is installed, but the ZeroRedundancyOptimizer peer is not written yet")
    text = "\n\n".join([mem_text, time_text, peer])
    print(text)
    results = {"memory": {str(k): v for k, v in memory.items()}, "time": timed, "peer": peer}
    save("zero", {"results": results, "table": text})
    return results


if __name__ == "__main__":
    main()
