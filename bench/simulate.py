"""The scaling simulator (gd.simulate) against measured runs, and where each all-reduce wins.

1. Validation: the MLP 784-1024-1024-10 Adam step, 128 examples per replica (weak scaling),
   on 1, 2 and 4 logical CPU devices of this host, with the default HostAllReduce, the
   RingAllReduce and ReductionToOneDevice: the prediction (shared_host: replicas run one
   after another; the link is the calibrated memory copy / host all-reduce; the 1-device
   step, measured in the same round-robin, is its input) against the best of `repeat`
   measured steps (round-robin over the device counts). Target: within 20%.
2. The textbook all-reduce costs on a 25 GB/s, 5 us link, 2 to 1,024 devices, for several
   payloads (the MLP's gradient bucket among them): which lowering wins, and its time
   against the ring's; then the MLP step predicted to 1,024 devices for each lowering.

    python -m bench.simulate [--repeat 20] [--blas-threads 1]
"""

from __future__ import annotations

import argparse
import itertools

import numpy as np

import graphdist as gd
from bench.common import save, table
from bench.models import make_step
from bench.peers.common import SIZES
from graphdist.device.threads import set_blas_threads
from graphdist.simulate import (DEFAULT_LINK, best_time, hierarchical_cost, load_calibration,
                                one_device_cost, ring_cost)

PER_REPLICA = 128
OPS = {"host": gd.HostAllReduce, "ring": gd.RingAllReduce,
       "one_device": gd.ReductionToOneDevice, "hierarchical": gd.HierarchicalCopyAllReduce}


def builder(lowering: str):
    def build(n):
        strategy = gd.MirroredStrategy([f"cpu:{i}" for i in range(n)],
                                       cross_device_ops=OPS[lowering]())
        step, _ = make_step(strategy)
        rng = np.random.default_rng(0)
        x = rng.standard_normal((PER_REPLICA * n, SIZES[0])).astype(np.float32)
        y = rng.integers(0, SIZES[-1], PER_REPLICA * n).astype(np.int32)
        return step, (next(iter(strategy.experimental_distribute_dataset([(x, y)]))),)
    return build


def validate(repeat: int) -> list[dict]:
    rows = []
    for lowering in ("host", "ring", "one_device"):
        build = builder(lowering)
        steps = {n: build(n) for n in (1, 2, 4)}
        measured = dict.fromkeys(steps, float("inf"))
        for _ in range(repeat):    # round-robin, so that load from elsewhere hits all alike
            for n, (step, args) in steps.items():
                measured[n] = min(measured[n], best_time(lambda s=step, a=args: s(*a), 1))
        predicted = gd.simulate(build, [1, 2, 4], cross_device_ops=lowering,
                                shared_host=True, compute_s=measured[1])
        for p in predicted:
            m = measured[p["devices"]]
            rows.append({"lowering": lowering, **p, "measured_s": m, "error": p["step_s"] / m - 1})
    return rows


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


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--blas-threads", type=int, default=1,
                    help="BLAS threads (default 1: on a loaded machine a multi-threaded BLAS "
                         "stalls whenever one of its threads is descheduled, swinging step "
                         "times up to 10x; 0: the library default)")
    args = ap.parse_args(argv)
    set_blas_threads(args.blas_threads or None)
    cal = load_calibration(recalibrate=True)    # under the same BLAS threads
    val = validate(args.repeat)
    text = table(f"gd.simulate vs measured: MLP {'-'.join(map(str, SIZES))} Adam, "
                 f"{PER_REPLICA} examples per replica, logical CPU devices of this host "
                 f"(best of {args.repeat}; target |error| <= 20%)",
                 ["lowering", "devices", "predicted ms", "measured ms", "error %",
                  "compute ms", "comm ms"],
                 [[r["lowering"], r["devices"], r["step_s"] * 1e3, r["measured_s"] * 1e3,
                   f"{100 * r['error']:+.1f}", r["compute_s"] * 1e3, r["comm_s"] * 1e3]
                  for r in val])
    grads = 4 * sum(a * b + b for a, b in itertools.pairwise(SIZES))
    payloads = {"4 KiB": 4096, "1 MiB": 2**20, f"MLP grads {grads / 1e6:.2f} MB": grads,
                "256 MiB": 2**28}
    rows, costs = crossover(payloads)
    cross = table("all-reduce winner per device count and payload, 25 GB/s 5 us link "
                  "(textbook alpha-beta costs; time of the winner and against the ring)",
                  ["devices", *payloads], rows)
    steps = {}
    build = builder("host")
    for lowering in ("ring", "hierarchical", "one_device"):
        steps[lowering] = gd.simulate(build, [1, *DEVICES], cross_device_ops=lowering,
                                      repeat=args.repeat)
    step_rows = [[n] + [f"{steps[k][i]['step_s'] * 1e3:.1f} ms, eff "
                        f"{steps[k][i]['efficiency']:.2f}" for k in steps]
                 for i, n in enumerate([1, *DEVICES])]
    scaled = table("MLP step predicted on devices like this machine joined by a 25 GB/s, "
                   "5 us link (weak scaling; hierarchical with sqrt(n) groups)",
                   ["devices", *steps], step_rows)
    save("simulate", {"calibration": cal, "validation": val, "crossover": costs,
                      "steps": steps, "table": f"{text}\n\n{cross}\n\n{scaled}"})
    return {"validation": val, "crossover": costs, "steps": steps}


if __name__ == "__main__":
    main()
