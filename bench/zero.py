"""Sharded optimizer state and gradient accumulation (issue 25) on the benchmark MLP
(784-1024-1024-10, Adam, global batch 512) over 4 logical CPU devices, in one run:

- memory per replica at zero_stage 0, 1, 2: the planner's figure (g.summary()'s memory
  table: parameters, reduced gradients, slots, peak activations of the replicated graph),
  the process's peak RSS (each stage in a fresh subprocess, so one stage's arrays do not
  hide another's), and the formula (float32 Adam: 4 + 4 + 8 bytes per parameter; stage 1
  4 + 4 + 8/N, stage 2 4 + 12/N; plus the activations, which data parallelism keeps);
- step time at stages 0, 1, 2, interleaved (target: stage 1 within 10% of stage 0), and
  stage 1 without its fused reduce-scatter + update + all-gather node (passes/fuse_zero.py);
- gradient accumulation: a micro-step (accumulating, k large enough that no call applies)
  against the plain step and against the step's compute alone (loss and gradients written
  to per-replica variables, no update, no collective; target: micro-step within 5%).

- the same MLP step at stages 0, 1, 2 on 2 MPI workers x 1 device
  (MultiWorkerMirroredStrategy(zero_stage=...), bench/zero_rank.py under `mpiexec
  -bind-to core -n 2`, one BLAS thread per worker as bench/multi_worker.py pins them; the
  three stages built in the same processes and timed interleaved, the slower rank's time
  per sample); skipped when mpi4py or mpiexec is missing;
- the GPT step (bench/models.make_gpt_step, the example's train step) at stages 0, 1, 2
  on the 4 logical devices: step time, interleaved, and the planner's memory per replica
  against the same formula.

- the peer the issue names, PyTorch's ZeroRedundancyOptimizer (bench/peers/torch_zero.py,
  run by the benchmark environment's Python, .venv-bench/bin/python or
  $GRAPHDIST_PEER_PYTHON): the same MLP, batch and Adam on 2 gloo processes, 1 thread each,
  pinned, DDP + Adam (stage 0) and DDP + ZeroRedundancyOptimizer timed interleaved in the
  same processes, beside graphdist's 2 MPI workers (the mpi part); skipped where that
  Python or torch is missing.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python -m bench.zero [--repeat 15]
        [--parts mlp,mpi,gpt]
"""

from __future__ import annotations

import argparse
import contextlib
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
    return make_with_optimizer(stage, accumulation, update)[:2]


def make_with_optimizer(stage: int = 0, accumulation: int = 1, update: bool = True):
    """make()'s (step, batch) and the step's optimizer (bench/accumulation.py reads its
    window's phase)."""
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
    return step, batch, opt


def unfused_stage_1():
    """(step, batch) at stage 1 compiled without fuse_sharded_update: each bucket's
    reduce-scatter, the replicas' updates and the all-gather as separate nodes (what stage
    1 ran before the fused node)."""
    import graphdist.pipeline as pipeline

    saved, pipeline.fuse_sharded_update = pipeline.fuse_sharded_update, lambda g: g
    try:
        step, batch = make(1)
        step(*batch)                          # compiled now
    finally:
        pipeline.fuse_sharded_update = saved
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


def formula(stage: int, activations: int, params: int | None = None) -> int:
    """float32 Adam's bytes per replica at `stage` for `params` parameters (the MLP's by
    default), plus the planner's activations."""
    if params is None:
        params = sum(math.prod(p.shape) for p in init())
    per_param = {0: 4 + 4 + 8, 1: 4 + 4 + 8 / N, 2: 4 + (4 + 8) / N}[stage]
    return int(per_param * params + activations)


@contextlib.contextmanager
def one_program():
    """Steps compiled inside run their replicas as one program (set_device_concurrency(
    "sequential")): how stages 1 and 2 run by default (their fused node needs it), while
    stage 0 gets a thread per device."""
    gd.config.set_device_concurrency("sequential")
    try:
        yield
    finally:
        gd.config.set_device_concurrency("auto")


def part_mlp(repeat: int) -> tuple[dict, str]:
    """Memory and step time of the MLP on N logical devices, with the accumulation step."""
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
    with one_program():
        steps["stage 0, one program"] = make(0)
        steps["stage 0, one program"][0](*steps["stage 0, one program"][1])   # compiled
    steps["stage 1, nodes apart"] = unfused_stage_1()
    steps["micro-step (k=10^6)"] = make(0, accumulation=10**6)
    steps["compute alone"] = make(0, update=False)
    timed = interleaved({name: (lambda sb=sb: sb[0](*sb[1])) for name, sb in steps.items()},
                        repeat=repeat)
    base = timed["stage 0"]["median_s"]
    compute = timed["compute alone"]["median_s"]
    time_rows = [[name, r["median_s"] * 1e3, r["min_s"] * 1e3, r["median_s"] / base,
                  r["median_s"] / compute] for name, r in timed.items()]
    time_text = table(f"step time, global batch {BATCH} on {N} logical CPU devices (median of "
                      f"{repeat}, interleaved; targets: stage 1 within 10% of stage 0, "
                      "micro-step within 5% of compute alone)",
                      ["step", "median ms", "min ms", "vs stage 0", "vs compute alone"],
                      time_rows)
    return ({"memory": {str(k): v for k, v in memory.items()}, "time": timed},
            "\n\n".join([mem_text, time_text]))


def part_mpi(repeat: int) -> tuple[dict, str]:
    """The MLP step at stages 0/1/2 on 2 MPI workers x 1 device (bench/zero_rank.py)."""
    from bench.multi_worker import _env, mpiexec, run

    mpi = mpiexec()
    if mpi is None:
        return {}, "mpi4py or mpiexec is missing: the 2-worker stages were not run"
    r = run([mpi, "-bind-to", "core", "-n", "2", sys.executable, "-m", "bench.zero_rank",
             "--repeat", str(repeat)], _env(one_thread=True))
    if r is None:
        return {}, "the 2-worker run failed (see stderr)"
    res = r["results"]
    base = res["stage 0"]["median_s"]
    rows = [[f"graphdist {name}", v["median_s"] * 1e3, v["min_s"] * 1e3, v["median_s"] / base,
             max(abs(a - b) for a, b in zip(v["losses"], res["stage 0"]["losses"]))]
            for name, v in res.items()]
    peer = torch_zero(repeat)
    if peer is not None:
        r["peer"] = peer
        theirs = peer["results"]
        rows += [[f"PyTorch {label}", v["median_s"] * 1e3, v["min_s"] * 1e3,
                  v["median_s"] / theirs["stage 0"]["median_s"],
                  max(abs(a - b) for a, b in zip(v["losses"], res["stage 0"]["losses"]))]
                 for label, v in (("stage 0 (DDP + Adam)", theirs["stage 0"]),
                                  ("ZeroRedundancyOptimizer", theirs["ZeRO"]))]
    text = table(f"MLP step, global batch {BATCH}, on 2 workers x 1 device, 1 BLAS thread each, "
                 f"pinned (graphdist: MPI; PyTorch: gloo; median of {repeat}, interleaved, the "
                 "slower rank per sample; 'vs stage 0' against each one's own stage 0; target: "
                 "stage 1 within 10% of stage 0)",
                 ["step", "median ms", "min ms", "vs stage 0", "loss diff 3 steps"], rows)
    return r, text


def torch_zero(repeat: int) -> dict | None:
    """PyTorch's DDP + Adam and DDP + ZeroRedundancyOptimizer on 2 gloo processes
    (bench/peers/torch_zero.py in the benchmark environment's Python), or None where there
    is none (said on stderr)."""
    from bench.common import peer_python, run_peer

    python = peer_python()
    if python is None:
        print("no benchmark Python (.venv-bench): PyTorch's ZeroRedundancyOptimizer was not "
              "run", file=sys.stderr)
        return None
    return run_peer(python, "bench.peers.torch_zero", "--procs", "2", "--repeat", str(repeat))


def part_gpt(repeat: int) -> tuple[dict, str]:
    """The GPT step at stages 0/1/2 on N logical devices: planner memory and step time."""
    from graphdist.viz.summary import stats

    from bench.models import make_gpt_step
    from bench.peers.gpt_common import gpt_data

    steps, memory, losses = {}, {}, {}
    for stage in (0, 1, 2):
        strategy = gd.MirroredStrategy(DEVICES, zero_stage=stage)
        step, variables = make_gpt_step(strategy)
        batch = next(iter(strategy.experimental_distribute_dataset([gpt_data()])))
        losses[stage] = [float(step(batch)) for _ in range(3)]
        if stage == 0:          # and as one program, as stages 1 and 2 run by default
            with one_program():
                alone, _ = make_gpt_step(strategy)
                alone(batch)
            steps["stage 0, one program"] = (lambda alone=alone, batch=batch: alone(batch))
        planned = {k: int(v) for k, v in
                   stats(step.replicated_graph)["memory"][DEVICES[0]].items()}
        params = sum(math.prod(v.shape) for v in variables)
        memory[stage] = {**planned, "planner_total_B": sum(planned.values()),
                         "formula_B": formula(stage, planned["peak activations"], params),
                         "parameter_count": params}
        steps[f"stage {stage}"] = (lambda step=step, batch=batch: step(batch))
    timed = interleaved(steps, repeat=repeat)
    for stage in (0, 1, 2):
        timed[f"stage {stage}"]["losses"] = losses[stage]
    mib = 2**20
    base = timed["stage 0"]["median_s"]
    rows = [[stage, m["parameters"] / mib, m["gradients"] / mib, m["optimizer slots"] / mib,
             m["peak activations"] / mib, m["planner_total_B"] / mib, m["formula_B"] / mib,
             timed[f"stage {stage}"]["median_s"] * 1e3, timed[f"stage {stage}"]["min_s"] * 1e3,
             timed[f"stage {stage}"]["median_s"] / base] for stage, m in memory.items()]
    text = table(f"GPT step (bench/models.make_gpt_step, {memory[0]['parameter_count']} "
                 f"parameters, Adam) on {N} logical CPU devices: memory per replica (MiB, "
                 f"planner = g.summary()) and step time (median of {repeat}, interleaved)",
                 ["stage", "params", "grads", "slots", "activations", "planner total",
                  "formula", "median ms", "min ms", "vs stage 0"], rows)
    alone = timed["stage 0, one program"]["median_s"]
    line = (f"stage 0 as one program (how stages 1 and 2 run): {alone * 1e3:.2f} ms; "
            f"stage 1 / that: {timed['stage 1']['median_s'] / alone:.3f}")
    print(line)
    text += "\n" + line
    return {"memory": {str(k): v for k, v in memory.items()}, "time": timed}, text


PARTS = {"mlp": part_mlp, "mpi": part_mpi, "gpt": part_gpt}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--parts", default="mlp,mpi,gpt",
                    help="comma-separated parts to run: mlp (memory, time, accumulation on "
                         f"{N} devices), mpi (2 MPI workers), gpt (the GPT step)")
    ap.add_argument("--rss-child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rss_child is not None:
        _rss_child(args.rss_child)
        return {}
    results, texts = {}, []
    for name in args.parts.split(","):
        results[name], text = PARTS[name](args.repeat)
        texts.append(text)
    text = "\n\n".join(texts)            # table() printed the parts' tables
    if "mlp" in results:              # the layout earlier runs saved: memory and time on top
        results.update(results.pop("mlp"))
    save("zero", {"results": results, "table": text})
    return results


if __name__ == "__main__":
    main()
