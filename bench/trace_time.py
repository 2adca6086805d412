"""Compile time against graph size: a chain of n ops (n/2 x (4x4 matmul, tanh)) for n from
100 to 50,000, graphdist's trace + passes + lowering against the peers' nearest step
(bench/peers/trace_chain.py says what each one covers). Target: a 5,000-op chain under
0.25 s, and linear growth to 50,000.

    python -m bench.trace_time [--no-peers]
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np

import graphdist as gd
from bench.common import peer_python, run_peer, save, table

SIZES = (100, 1000, 5000, 10000, 50000)
PEERS = {"jax": "JAX jit lower", "jax_compile": "JAX lower + XLA compile",
         "torch_fx": "torch.fx symbolic_trace", "tf": "tf.function trace"}
BUDGET_S = 20.0             # a peer run predicted to take longer than this is skipped


def chain(n_ops: int):
    def fn(x, w):
        for _ in range(n_ops // 2):
            x = gd.tanh(x @ w)
        return x
    return fn


def graphdist_seconds(n_ops: int) -> tuple[float, int]:
    """Seconds of `get_graph` (trace + passes + place + schedule + lower) and graph size."""
    x = np.ones((4, 4), np.float32)
    w = np.eye(4, dtype=np.float32) * 0.5
    f = gd.function(chain(n_ops))
    t0 = time.perf_counter()
    f.get_graph(x, w)
    return time.perf_counter() - t0, len(f.graph)


def repeats(predicted_s: float) -> int:
    """Best of 3 (the machine is shared, and a single run at 50,000 ops was seen 40% slow),
    but once only where a run is predicted to take over 3 s."""
    return 1 if predicted_s > 3.0 else 3


def predict(done: dict, n_ops: int) -> float:
    """Seconds a contender should take at n_ops, extrapolated from its last two sizes with
    the growth exponent they show (at least 1; 2 when only one size is known)."""
    sizes = sorted(int(k) for k in done)
    if not sizes:
        return 0.0
    n1, t1 = sizes[-1], done[str(sizes[-1])]["seconds"]
    exponent = 2.0
    if len(sizes) > 1:
        n0, t0 = sizes[-2], done[str(sizes[-2])]["seconds"]
        exponent = max(1.0, math.log(t1 / t0) / math.log(n1 / n0))
    return t1 * (n_ops / n1) ** exponent


def peer_row(python: str, framework: str, n_ops: int, done: dict) -> dict:
    """One peer measurement in its own process, or {"skipped": why}."""
    guess = predict(done, n_ops)
    if guess > BUDGET_S:
        return {"skipped": f"predicted {guess:.0f} s (> {BUDGET_S:.0f} s budget)"}
    limit = 1.5 * BUDGET_S + 15               # imports, and a prediction that was too low
    r = run_peer(python, "bench.peers.trace_chain", "--framework", framework, "--ops",
                 str(n_ops), "--repeat", str(repeats(guess)), timeout=limit)
    if r is None:
        return {"skipped": f"failed or ran past {limit:.0f} s"}
    return {"seconds": r["seconds"], "us_per_node": r["seconds"] / n_ops * 1e6,
            "nodes": r["nodes"]}


def measure(sizes, python: str | None) -> tuple[dict, dict]:
    """{contender: {str(n): row}} and {contender: {str(n): why}} for the skipped ones; the
    contenders run one after another at each size, so drift hits them alike."""
    graphdist_seconds(100)                            # warm imports
    results = {"graphdist": {}, **({PEERS[f]: {} for f in PEERS} if python else {})}
    skipped = {name: {} for name in results}
    for n in sizes:
        guess = predict(results["graphdist"], n)
        runs = [graphdist_seconds(n) for _ in range(repeats(guess))]
        best, nodes = min(runs)
        if abs(nodes - n) > 0.05 * n:
            raise RuntimeError(f"trace_time: a {n}-op chain gave {nodes} graph nodes")
        results["graphdist"][str(n)] = {"seconds": best, "us_per_node": best / n * 1e6,
                                        "nodes": nodes}
        for framework, name in PEERS.items() if python else ():
            row = peer_row(python, framework, n, results[name])
            (skipped if "skipped" in row else results)[name][str(n)] = row.get("skipped", row)
    return results, skipped


def rows(results: dict, sizes) -> list[list]:
    out = []
    for n in sizes:
        base = results["graphdist"][str(n)]["seconds"]
        for name, by_size in results.items():
            r = by_size.get(str(n))
            if r is None:
                out.append([n, name, "-", "skipped", "-", "-"])
            else:
                out.append([n, name, r.get("nodes", "-"), r["seconds"], r["us_per_node"],
                            r["seconds"] / base])
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.trace_time")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)),
                    help="comma-separated op counts (even numbers)")
    ap.add_argument("--no-peers", action="store_true", help="graphdist rows only")
    args = ap.parse_args(argv or [])
    sizes = [int(s) for s in args.sizes.split(",")]
    python = None if args.no_peers else peer_python()
    results, skipped = measure(sizes, python)
    text = table("Compile time of an n-op matmul/tanh chain (best of 3, of 1 for runs "
                 "predicted over 3 s); x graphdist = seconds / graphdist's seconds",
                 ["ops", "contender", "nodes", "seconds", "us/node", "x graphdist"],
                 rows(results, sizes))
    notes = [f"skipped: {name} at {n} ops, {why}" for name in skipped
             for n, why in skipped[name].items()]
    print("\n".join(notes) + "\n" if notes else "", end="")
    text += "".join("\n" + line for line in notes)
    save("trace_time", {"sizes": sizes, "budget_s": BUDGET_S, "results": results,
                        "skipped": skipped, "table": text})
    return results


def plot(payload):
    """Seconds against ops, log-log, one line per contender (graphdist in blue)."""
    from bench.plots import color, figure

    fig, (ax,) = figure("Compile time of an n-op matmul/tanh chain", width=7.0, height=4.5)
    for k, (name, by_size) in enumerate(payload["results"].items()):
        sizes = sorted(int(n) for n in by_size)
        if not sizes:
            continue
        ours = "graphdist" in name
        ax.plot(sizes, [by_size[str(n)]["seconds"] for n in sizes], "-" if ours else "--",
                marker="osv^Dx"[k % 6], color=color(name), label=name, lw=2.2 if ours else 1.2)
        if payload.get("skipped", {}).get(name):
            budget = payload.get("budget_s", BUDGET_S)
            ax.annotate(f"larger sizes skipped (over {budget:.0f} s)",
                        (sizes[-1], by_size[str(sizes[-1])]["seconds"]), fontsize=7,
                        color=color(name), va="center", ha="right", xytext=(-8, 0),
                        textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("ops in the chain")
    ax.set_ylabel("seconds")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    return fig


if __name__ == "__main__":
    main(sys.argv[1:])
