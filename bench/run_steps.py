"""Many steps per call where per-step overhead dominates: the digits MLP 64-256-256-10,
global batch 128 on 4 logical CPU devices (MirroredStrategy, per-device replication), Adam
1e-3. Steps per second of `strategy.experimental_run_steps(fn, iterator, steps=50)` against
50 single calls of a gd.function step, 50 calls of run_steps(steps=1), Keras
`steps_per_execution=50` under TF's MirroredStrategy (a peer, in a subprocess), and the
pure compute time that the profile measures: the time in a step during which some node runs
(profile=True; the union of the nodes' spans over every device's lane, which is their sum
where one program runs every device).
Target: run_steps(50) within 5% of the pure compute time, and ahead of TF.

Every graphdist contender pulls its batches from its own distributed iterator (the shards
are split there); "pre-pulled" runs the same 50 batches from a list, input excluded, which
is what compares to the profile; "pull 50 batches" times the input on its own. All are timed
interleaved, 50 steps a sample; "vs pure compute" is median over median, "min vs min" the
same for the fastest samples (the steadier figure on a shared machine).

    python -m bench.run_steps [--no-peers] [--repeat 20]
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

import graphdist as gd
from bench.common import interleaved, peer_python, run_peer, save, table
from bench.models import B1, B2, EPS, mlp_loss
from bench.peers.common import LR, init
from graphdist.datasets import load_digits

SIZES, BATCH, STEPS = (64, 256, 256, 10), 128, 50


def make(strategy):
    """(fn for run_steps, a gd.function step, variables) of a fresh model, seeded weights."""
    with strategy.scope():
        ws = [gd.Variable(p, name=f"p{i}") for i, p in enumerate(init(0, SIZES))]
        opt = gd.optimizers.Adam(LR, B1, B2, EPS)

    def replica_step(x, y):
        with gd.GradientTape() as tape:
            loss = mlp_loss(ws, x, y)
        opt.apply_gradients(zip(tape.gradient(loss, ws), ws))
        return loss

    def fn(ctx, x, y):
        ctx.set_last_step_output("loss", strategy.run(replica_step, args=(x, y)),
                                 gd.ReduceOp.MEAN)

    step = gd.function(lambda x, y: strategy.reduce(
        gd.ReduceOp.MEAN, strategy.run(replica_step, args=(x, y)), axis=None))
    return fn, step, ws


def profile_split(trace: dict) -> tuple[float, float]:
    """(time some node runs, mean "step k" slice) per step of a profiled run, seconds. The
    devices' worker threads run nodes at once (the default on logical CPU devices), so a
    node's time counts once however many lanes run one then: the union of the nodes'
    spans, which is their sum where one program runs every device."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    slices = [e["dur"] for e in events if e["cat"] == "step" and e["tid"] == 0]
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["cat"] != "step")
    covered, end = 0.0, float("-inf")
    for start, stop in spans:
        if stop > end:
            covered += stop - max(start, end)
            end = stop
    return covered * 1e-6 / len(slices), statistics.mean(slices) * 1e-6


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args(argv)
    x, y = load_digits()
    strategy = gd.MirroredStrategy([f"cpu:{i}" for i in range(4)])
    run_steps = strategy.experimental_run_steps

    def batches():
        return iter(strategy.experimental_distribute_dataset(
            gd.data.batches((x, y), BATCH, shuffle=True, seed=0, repeat=True)))

    (fa, _, wa), (_, step, wb), (fc, _, wc) = make(strategy), make(strategy), make(strategy)
    ita, itb, itc, itp = batches(), batches(), batches(), batches()
    # the first 50 steps of each, from the same weights and batches: the same weights after
    ctx = run_steps(fa, ita, steps=STEPS)
    for _ in range(STEPS):
        step(*next(itb))
        run_steps(fc, itc, steps=1)
    diff = max(float(np.max(np.abs(a.numpy() - o.numpy()))) for a, b, c in zip(wa, wb, wc)
               for o in (b, c))
    executable = ctx.step_function._latest().executable
    pulled = [next(itp) for _ in range(STEPS)]
    profiles = []

    def single_calls():
        for _ in range(STEPS):
            step(*next(itb))

    def run_steps_1():
        for _ in range(STEPS):
            run_steps(fc, itc, steps=1)

    def pull():
        for _ in range(STEPS):
            next(itp)

    def profiled():      # then one plain run: what follows building the trace runs slower
        profiles.append(profile_split(run_steps(fa, iter(pulled), STEPS, profile=True).profile))
        run_steps(fa, iter(pulled), steps=STEPS)

    t = interleaved({"run_steps(50)": lambda: run_steps(fa, ita, steps=STEPS),
                     "run_steps(50), batches pre-pulled": lambda: run_steps(fa, iter(pulled),
                                                                            steps=STEPS),
                     "50 single calls of a gd.function": single_calls,
                     "50 x run_steps(1)": run_steps_1,
                     "pull 50 distributed batches (input only)": pull,
                     "profile": profiled}, repeat=args.repeat)
    results = {name: {"median_s": r["median_s"] / STEPS, "min_s": r["min_s"] / STEPS}
               for name, r in t.items() if name != "profile"}
    profiles = profiles[-args.repeat:]                 # the timed runs, not the warm-up
    for k, name in enumerate(("pure compute (profile: time some node runs)",
                              "profile's step slice (compute + Python between nodes)")):
        per_step = [p[k] for p in profiles]
        results[name] = {"median_s": statistics.median(per_step), "min_s": min(per_step)}
    python = None if args.no_peers else peer_python()
    for spe in (50, 1) if python else ():
        r = run_peer(python, "bench.peers.tf_run_steps", "--steps-per-execution", str(spe),
                     "--samples", str(args.repeat))
        if r:
            results[r["peer"]] = r
    pure = results["pure compute (profile: time some node runs)"]
    rows = []
    for name, r in results.items():
        r["steps_per_s"] = 1 / r["median_s"]
        r["vs_pure_compute"] = r["median_s"] / pure["median_s"]
        r["min_vs_pure_compute_min"] = r["min_s"] / pure["min_s"]
        rows.append([name, r["steps_per_s"], r["median_s"] * 1e3, r["min_s"] * 1e3,
                     r["vs_pure_compute"], r["min_vs_pure_compute_min"]])
    text = table(f"MLP {'-'.join(map(str, SIZES))} on the digits, global batch {BATCH}, 4 "
                 f"logical CPU devices ({type(executable).__name__}), per step (median of "
                 f"{args.repeat} x {STEPS} steps; target: run_steps(50) within 5% of pure "
                 "compute and ahead of TF)",
                 ["contender", "steps/s", "median ms/step", "min ms/step", "vs pure compute",
                  "min vs min"],
                 rows)
    save("run_steps", {"results": results, "steps": STEPS, "executable":
                       type(executable).__name__, "max_param_diff_after_50_steps": diff,
                       "table": text})
    return results


def plot(payload):
    """ms per step of each way to run 50 steps, against the pure compute the profile
    measures (the bound: what the nodes themselves take)."""
    from bench.plots import GRAPHDIST, PEER, REFERENCE, bars, figure, rows_height, timings

    medians, mins = timings(payload.get("results", {}))
    colors = {n: PEER if n.startswith("TF") else REFERENCE if "profile" in n else GRAPHDIST
              for n in medians}
    fig, axes = figure(f"MLP {'-'.join(map(str, SIZES))} on the digits, global batch {BATCH}, "
                       f"4 logical CPU devices, {payload.get('steps', STEPS)} steps per call",
                       width=9, height=rows_height(len(medians)))
    bars(axes[0], medians, "ms per step (bar: median, |: min)", mins=mins, colors=colors,
         highlight=[f"run_steps({payload.get('steps', STEPS)})"])
    pure = next((m for n, m in medians.items() if n.startswith("pure compute")), None)
    if pure:
        axes[0].axvline(pure, color=REFERENCE, linestyle="--", linewidth=1,
                        label=f"pure compute {pure:.3g} ms")
        axes[0].legend(fontsize=7, loc="upper right")
    return fig


if __name__ == "__main__":
    main()
