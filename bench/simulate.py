"""The scaling simulator (gd.simulate) against measured runs, and where each all-reduce wins.

1. Validation: the MLP 784-1024-1024-10 Adam step, 128 examples per replica (weak scaling),
   on 1, 2 and 4 logical CPU devices of this host, with the default HostAllReduce, the
   RingAllReduce and ReductionToOneDevice: the prediction (shared_host: replicas run one
   after another; the link is the calibrated memory copy / host all-reduce; the 1-device
   step, measured in the same round-robin, is its input) against the best of `repeat`
   measured steps run that way (set_device_concurrency("sequential"); round-robin over
   every case and device count), and beside them the default's steps, a thread per
   device, which the model does not describe (its last column). Then strong scaling: a global
   batch of 512 split among 1, 2 and 4 logical devices (HostAllReduce), the per-replica
   compute at 256 and 128 examples predicted by the calibrated per-op model from the
   measured 512-example step. Target: within 20%.
2. 2 MPI workers x 1 device (MultiWorkerMirroredStrategy, bench/multi_worker_rank.py under
   `mpiexec -bind-to core -n 2`: each worker has a core and one BLAS thread of its own),
   global batch 512, against the "mpi" prediction (strong scaling; the MPI link
   calibrated between 2 workers of this host; no overlap: the executor calls MPI inline).
   Its input, the 1-device step, is measured here pinned to one core, so that it too runs
   one BLAS thread: a worker's thread share. The best of --rounds rounds, each timing the
   1-device step and then the workers, so that drift hits both.
3. The textbook all-reduce costs on a 25 GB/s, 5 us link, 2 to 1,024 devices, for several
   payloads (the MLP's gradient bucket among them): which lowering wins, and its time
   against the ring's; then the MLP step predicted to 1,024 devices for each lowering
   (weak scaling), and the global batch of 512 split among up to 512 (strong).

Threads: every step runs with the executor's share of the cores (a 1-device step both
cores' BLAS threads, each of 2 or 4 replicas one), and the calibration with a 1-device
step's share, so the model and the steps it is scaled to match.

    python -m bench.simulate [--repeat 20] [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import sys

import numpy as np

import graphdist as gd
from bench.common import save, table
from bench.models import make_step
from bench.peers.common import SIZES
from graphdist.simulate import (
    DEFAULT_LINK,
    best_time,
    hierarchical_cost,
    load_calibration,
    one_device_cost,
    ring_cost,
)

PER_REPLICA = 128
GLOBAL = 512                  # strong scaling and the MPI workers: bench/peers/common.BATCH
OPS = {"host": gd.HostAllReduce, "ring": gd.RingAllReduce,
       "one_device": gd.ReductionToOneDevice, "hierarchical": gd.HierarchicalCopyAllReduce}


def builder(lowering: str, scaling: str = "weak", concurrency: str = "sequential"):
    """build(n): the MLP step on n logical CPU devices, compiled in `concurrency`; weak:
    PER_REPLICA examples per replica, strong: GLOBAL examples split among them. The
    simulator's shared_host model is one program issuing the replicas in turn
    ("sequential"); "auto" gives each device a thread (the default)."""
    def build(n):
        strategy = gd.MirroredStrategy([f"cpu:{i}" for i in range(n)],
                                       cross_device_ops=OPS[lowering]())
        step, _ = make_step(strategy)
        batch = PER_REPLICA * n if scaling == "weak" else GLOBAL
        rng = np.random.default_rng(0)
        x = rng.standard_normal((batch, SIZES[0])).astype(np.float32)
        y = rng.integers(0, SIZES[-1], batch).astype(np.int32)
        args = (next(iter(strategy.experimental_distribute_dataset([(x, y)]))),)
        gd.config.set_device_concurrency(concurrency)
        try:
            step(*args)                          # compiled now, in that mode
        finally:
            gd.config.set_device_concurrency("auto")
        return step, args
    return build


def best_step(step, args) -> float:
    return best_time(lambda: step(*args), 1)


CASES = (("host", "weak"), ("ring", "weak"), ("one_device", "weak"), ("host", "strong"))


def validate(repeat: int) -> list[dict]:
    """The simulator (shared_host: replicas one after another) against the same steps run
    as one program, and beside them the default's (a thread per device) times."""
    builds = {case: builder(*case) for case in CASES}
    steps = {(case, n): build(n) for case, build in builds.items() for n in (1, 2, 4)}
    steps.update({(case, n, "threads"): builder(*case, concurrency="auto")(n)
                  for case in CASES for n in (2, 4)})
    measured = dict.fromkeys(steps, float("inf"))
    for _ in range(repeat):    # round-robin over every case, so that load from elsewhere
        for key, (step, args) in steps.items():          # hits all alike
            measured[key] = min(measured[key], best_step(step, args))
    rows = []
    for (lowering, scaling), build in builds.items():
        predicted = gd.simulate(build, [1, 2, 4], cross_device_ops=lowering,
                                shared_host=True, scaling=scaling,
                                compute_s=measured[(lowering, scaling), 1])
        for p in predicted:
            m = measured[(lowering, scaling), p["devices"]]
            threads = measured.get(((lowering, scaling), p["devices"], "threads"), m)
            rows.append({"lowering": lowering, "scaling": scaling, **p, "measured_s": m,
                         "threads_s": threads, "error": p["step_s"] / m - 1})
    return rows


@contextlib.contextmanager
def one_core():
    """This process pinned to one core for a while: the executor then gives a step one
    BLAS thread, as each of 2 workers pinned on this 2-core host has."""
    cores = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cores)})
    try:
        yield
    finally:
        os.sched_setaffinity(0, cores)


def validate_mpi(repeat: int, rounds: int) -> list[dict]:
    """2 MPI workers x 1 device, global batch GLOBAL, against the "mpi" prediction; [] when
    mpi4py or mpiexec is missing."""
    from bench.multi_worker import RANK, _env, mpiexec, run

    mpi = mpiexec()
    if mpi is None:
        print("bench.simulate: no MPI here (pip install 'graphdist[mpi]'): the 2-worker "
              "case is skipped", file=sys.stderr)
        return []
    build = builder("host", "strong")
    one = build(1)
    command = [mpi, "-bind-to", "core", "-n", "2", *RANK, "mlp", "--strategy", "multi",
               "--devices", "1", "--repeat", str(repeat)]
    single, workers = float("inf"), []
    for _ in range(rounds):        # the 1-device input and the workers in turn
        with one_core():
            single = min(single, min(best_step(*one) for _ in range(repeat)))
        r = run(command, _env(one_thread=True))
        if r is not None:
            workers.append(r)
    if not workers:
        return []
    measured = min(r["min_s"] for r in workers)
    (p,) = gd.simulate(build, [2], cross_device_ops="mpi", scaling="strong",
                       compute_s=single)
    return [{"lowering": "mpi", "scaling": "strong", **p, "measured_s": measured,
             "error": p["step_s"] / measured - 1, "one_device_s": single,
             "worker_medians_s": [r["median_s"] for r in workers],
             "blas_threads": sorted({t for w in workers[-1]["per_worker"]
                                     for t in w["blas_threads"]})}]


CANDIDATES = {
    "ring": ring_cost,
    "hierarchical(2)": lambda n, s, link: hierarchical_cost(n, s, link, 2),
    "hierarchical(sqrt n)": lambda n, s, link: hierarchical_cost(
        n, s, link, max(1, round(n ** 0.5))),
    "one_device": one_device_cost,
}
DEVICES = (2, 4, 8, 16, 64, 256, 1024)


def crossover(payloads: dict) -> tuple[list, dict]:
    rows, data = [], {}
    for n in DEVICES:
        row = [n]
        for name, nbytes in payloads.items():
            t = {k: fn(n, nbytes, DEFAULT_LINK) for k, fn in CANDIDATES.items()}
            best = min(t, key=t.get)
            row.append(f"{best} {t[best] * 1e3:.3g} ms ({t[best] / t['ring']:.2f}x ring)")
            data[f"{name}@{n}"] = t
        rows.append(row)
    return rows, data


def predicted_steps(scaling: str, devices: tuple, repeat: int) -> dict:
    """{lowering: gd.simulate rows} for the MLP on devices like this machine joined by the
    default 25 GB/s, 5 us link (the 1-device step measured once, for every lowering)."""
    build = builder("host", scaling)
    step, args = build(1)
    one = best_time(lambda: step(*args), repeat, 1.0)
    return {lowering: gd.simulate(build, [1, *devices], DEFAULT_LINK, lowering,
                                  scaling=scaling, compute_s=one)
            for lowering in ("ring", "hierarchical", "one_device", "mpi")}


def steps_table(title: str, steps: dict, devices: tuple) -> str:
    rows = [[n] + [f"{steps[k][i]['step_s'] * 1e3:.2f} ms, eff "
                   f"{steps[k][i]['efficiency']:.2f}" for k in steps]
            for i, n in enumerate([1, *devices])]
    return table(title, ["devices", *steps], rows)


def validation_table(rows: list, repeat: int, rounds: int) -> str:
    return table(f"gd.simulate vs measured: MLP {'-'.join(map(str, SIZES))} Adam; weak: "
                 f"{PER_REPLICA} examples per replica, strong: {GLOBAL} split among the "
                 f"devices; logical CPU devices of this host (best of {repeat}) and 2 MPI "
                 f"workers x 1 device (best of {rounds} runs of {repeat} steps) "
                 "(target |error| <= 20%)",
                 ["lowering", "scaling", "devices", "predicted ms", "measured ms",
                  "error %", "compute ms", "comm ms", "efficiency",
                  "a thread each ms"],
                 [[r["lowering"], r["scaling"], r["devices"], r["step_s"] * 1e3,
                   r["measured_s"] * 1e3, f"{100 * r['error']:+.1f}", r["compute_s"] * 1e3,
                   r["comm_s"] * 1e3, f"{r['efficiency']:.2f}",
                   f"{r.get('threads_s', r['measured_s']) * 1e3:.2f}"] for r in rows])


STRONG_DEVICES = (2, 4, 8, 16, 64, 256, 512)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3, help="runs of the 2 MPI workers")
    args = ap.parse_args(argv)
    cal = load_calibration(recalibrate=True)
    val = validate(args.repeat) + validate_mpi(args.repeat, args.rounds)
    text = validation_table(val, args.repeat, args.rounds)
    grads = 4 * sum(a * b + b for a, b in itertools.pairwise(SIZES))
    payloads = {"4 KiB": 4096, "1 MiB": 2**20, f"MLP grads {grads / 1e6:.2f} MB": grads,
                "256 MiB": 2**28}
    rows, costs = crossover(payloads)
    cross = table("all-reduce winner per device count and payload, 25 GB/s 5 us link "
                  "(textbook alpha-beta costs; time of the winner and against the ring)",
                  ["devices", *payloads], rows)
    steps = predicted_steps("weak", DEVICES, args.repeat)
    scaled = steps_table("MLP step predicted on devices like this machine joined by a "
                         f"25 GB/s, 5 us link (weak scaling, {PER_REPLICA} per replica; "
                         "hierarchical with sqrt(n) groups; mpi: no overlap)", steps, DEVICES)
    strong = predicted_steps("strong", STRONG_DEVICES, args.repeat)
    strong_text = steps_table(f"the same, strong scaling: a global batch of {GLOBAL} split "
                              "among the devices (efficiency T1 / (N TN))", strong,
                              STRONG_DEVICES)
    save("simulate", {"calibration": cal, "validation": val, "crossover": costs,
                      "steps": steps, "strong_steps": strong,
                      "table": f"{text}\n\n{cross}\n\n{scaled}\n\n{strong_text}"})
    return {"validation": val, "crossover": costs, "steps": steps, "strong_steps": strong}


def plot(payload: dict):
    """Left: predicted against measured step time per validated case (the diagonal is a
    perfect prediction, the band +-20%). Right: predicted efficiency against device count
    to 1,024 per lowering (weak scaling, solid; strong scaling of the global batch of 512,
    dashed)."""
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    from bench.plots import GRAPHDIST, REFERENCE, color, figure

    fig, (left, right) = figure("gd.simulate: the MLP step, predicted against measured, "
                                "and scaling to 1,024 devices", width=11, height=4.6, ncols=2)
    val = payload["validation"]
    marks = {"weak": "o", "strong": "s"}
    for r in val:
        left.scatter(r["measured_s"] * 1e3, r["step_s"] * 1e3, marker=marks[r["scaling"]],
                     color=REFERENCE if r["lowering"] == "mpi" else color("graphdist"),
                     s=28)
        left.annotate(f"{r['lowering']} {r['scaling'][0]}{r['devices']}",
                      (r["measured_s"] * 1e3, r["step_s"] * 1e3), fontsize=6,
                      xytext=(3, -3), textcoords="offset points")
    times = [t * 1e3 for r in val for t in (r["measured_s"], r["step_s"])]
    line = np.geomspace(0.8 * min(times), 1.25 * max(times), 50)
    left.plot(line, line, color="#555555", lw=0.8)
    left.fill_between(line, 0.8 * line, 1.2 * line, color="#dddddd", alpha=0.5, lw=0)
    left.set(xscale="log", yscale="log", xlim=(line[0], line[-1]), ylim=(line[0], line[-1]),
             xlabel="measured step (ms)", ylabel="predicted step (ms)")
    for axis in (left.xaxis, left.yaxis):
        axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        axis.set_minor_formatter(NullFormatter())
        axis.set_major_formatter(ScalarFormatter())
    left.set_title("validation, band +-20% (o weak, s strong; orange: 2 MPI workers)",
                   fontsize=9)
    shades = {"ring": GRAPHDIST, "hierarchical": "#2ca02c", "one_device": "#9e9e9e",
              "mpi": REFERENCE}
    for key, style in (("steps", "-"), ("strong_steps", "--")):
        for lowering, rows in payload.get(key, {}).items():
            right.plot([r["devices"] for r in rows], [r["efficiency"] for r in rows], style,
                       marker=".", color=shades.get(lowering, GRAPHDIST),
                       label=f"{lowering} ({'weak' if key == 'steps' else 'strong'})")
    right.set_xscale("log", base=2)
    right.set(xlabel="devices", ylabel="efficiency", ylim=(0, 1.05))
    right.set_title("predicted, 25 GB/s 5 us link", fontsize=9)
    right.legend(fontsize=6, ncol=2)
    return fig


if __name__ == "__main__":
    main()
