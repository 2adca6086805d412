"""Faults across 2 workers under `graphdist launch -n 2` (issue 23), and the cost of the
collective schedule check on the MLP step.

    python -m bench.multi_worker_faults [--repeat 3]          # faults, then the check's cost
    python -m bench.multi_worker_faults check-cost            # (a rank of the second part)

Faults (tests/mpi/faults.py, worker_fails.py): worker 1 fails after one good step; the
detection time is from the moment it failed (its wall clock, written just before) to the
moment worker 0 raised gd.WorkerError naming it; the launcher's exit time is from the same
moment to `graphdist launch` returning. The check's cost: the cached MLP 784-1024-1024-10
Adam step (global batch 512, 2 workers x 1 device) timed with GRAPHDIST_SCHEDULE_CHECK
unset (a 16-byte header exchanged every call) and =first, alternating rounds in one run,
the slower rank per step. Kernels load before the first step (no background compile).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(os.path.dirname(HERE), "tests", "mpi")
LAUNCH = [sys.executable, "-m", "graphdist", "launch", "-n", "2"]
# the kernels load before the first step: a background compile holds the interpreter lock
# for stretches of the first steps, which would time the loader, not the notice
ENV = {**os.environ, "GRAPHDIST_BACKGROUND_COMPILE": "0"}
KINDS = ("between", "trace", "exit", "kill", "hang")


def one_fault(kind: str) -> dict:
    """Run faults.py `kind` once: detection and launcher exit times in seconds."""
    with tempfile.TemporaryDirectory() as out:
        done = subprocess.run([*LAUNCH, os.path.join(SCRIPTS, "faults.py"), out, kind],
                              capture_output=True, text=True, timeout=120, env=ENV)
        returned = time.time()
        reports = {}
        for rank in (0, 1):
            try:
                with open(os.path.join(out, f"rank{rank}.json")) as f:
                    reports[rank] = json.load(f)
            except OSError as e:
                raise RuntimeError(f"{kind}: worker {rank} wrote no report\n{done.stderr}") from e
    failed = reports[1]["failed_at"]
    return {"detect_s": reports[0]["at"] - failed, "exit_s": returned - failed,
            "status": done.returncode, "named": "worker 1 failed" in reports[0]["message"]
            or "worker 1: no answer" in reports[0]["message"]}


def faults(repeat: int) -> dict:
    rows = {}
    for kind in KINDS:
        runs = [one_fault(kind) for _ in range(repeat)]
        rows[kind] = {"detect_ms": statistics.median(r["detect_s"] for r in runs) * 1e3,
                      "detect_max_ms": max(r["detect_s"] for r in runs) * 1e3,
                      "exit_s": statistics.median(r["exit_s"] for r in runs),
                      "statuses": sorted({r["status"] for r in runs}),
                      "all_named": all(r["named"] for r in runs)}
    return rows


def check_cost(rounds: int = 12, steps: int = 20) -> None:
    """A rank: rounds of `steps` cached MLP steps, the check's mode alternating per round;
    rank 0 prints the per-step medians (the slower rank's time per step), the median of
    the rounds' ratios, and the header alone (1000 exchanges back to back)."""
    sys.path.insert(0, os.path.dirname(HERE))
    import numpy as np
    from mpi4py import MPI

    import graphdist as gd
    from bench.models import make_step
    from bench.peers.common import data

    strategy = gd.MultiWorkerMirroredStrategy(["cpu:0"])
    x, y = data()
    step, _ = make_step(strategy, "adam")
    batch = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
    for _ in range(5):
        step(batch)
    samples = {"every": [], "first": []}
    for r in range(rounds):
        for mode in (("every", "first") if r % 2 == 0 else ("first", "every")):
            if mode == "every":
                os.environ.pop("GRAPHDIST_SCHEDULE_CHECK", None)
            else:
                os.environ["GRAPHDIST_SCHEDULE_CHECK"] = "first"
            for _ in range(steps):
                start = time.perf_counter()
                step(batch)
                samples[mode].append(time.perf_counter() - start)
    every = {k: np.max(MPI.COMM_WORLD.allgather(np.array(v)), axis=0).reshape(rounds, steps)
             for k, v in samples.items()}
    ratios = sorted(float(np.median(a) / np.median(b))
                    for a, b in zip(every["every"], every["first"]))
    from graphdist.runtime.schedule_check import agree, fingerprint

    start = time.perf_counter()
    for _ in range(1000):
        agree(strategy._group, [], fingerprint([]))
    header = (time.perf_counter() - start) / 1000
    if strategy.is_chief:
        print("RESULT " + json.dumps({
            **{k: float(np.median(v)) for k, v in every.items()}, "ratio": ratios[len(ratios) // 2],
            "ratio_q25": ratios[len(ratios) // 4], "ratio_q75": ratios[3 * len(ratios) // 4],
            "header_s": header}))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("part", nargs="?", choices=("all", "check-cost"), default="all")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    if args.part == "check-cost":
        check_cost()
        return
    for kind, row in faults(args.repeat).items():
        print(f"{kind:8s} detected in {row['detect_ms']:8.1f} ms (max {row['detect_max_ms']:.1f})"
              f"  launcher out {row['exit_s']:.2f} s after the fault  status "
              f"{row['statuses']}  named {row['all_named']}")
    done = subprocess.run([*LAUNCH, "-m", "bench.multi_worker_faults", "check-cost"],
                          capture_output=True, text=True, timeout=600,
                          cwd=os.path.dirname(HERE), env=ENV)
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    cost = json.loads(line[len("RESULT "):])
    print(f"MLP step: check every call {cost['every'] * 1e3:.2f} ms, first call only "
          f"{cost['first'] * 1e3:.2f} ms; ratio per round pair: median {cost['ratio']:.4f} "
          f"(quartiles {cost['ratio_q25']:.4f}-{cost['ratio_q75']:.4f}); the header alone "
          f"{cost['header_s'] * 1e6:.1f} us")


if __name__ == "__main__":
    main()
