"""The MLP 784-1024-1024-10 step, global batch 512, on 4 logical CPU devices with
MirroredStrategy against graphdist's own one-device step, as it runs by default (one copy
per device with its collectives, what the views show) and merged (opt-in: the replicas as
one batched program), and the peers on the same model and machine in the same run:
TensorFlow (tf.function and MirroredStrategy x4 with ReductionToOneDevice), JAX (jit and
pmap over 4 host devices) and PyTorch (one process, and DDP over 4 gloo processes sharing
the cores). Target: the default x4 step at least as fast as every peer's x4. First calls:
graphdist's own process with a warm and with an empty Numba cache, against the peers'.

Peers run in subprocesses of the benchmark environment's Python (`.venv-bench/bin/python`
or $GRAPHDIST_PEER_PYTHON); graphdist never depends on them.

    python -m bench.mirrored_mlp [--no-peers]
"""

from __future__ import annotations

import argparse


from bench.common import run_peers, save, table
from bench.models import graphdist_side_by_side, make_step
from bench.peers.common import BATCH, SIZES, data

def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args(argv)
    x, y = data()
    results, rows = {}, []
    for optimizer in ("adam", "momentum"):
        t, diff = graphdist_side_by_side(lambda strategy: make_step(strategy, optimizer),
                                         (x, y), args.repeat)
        base = t["graphdist 1 device"]["median_s"]
        entry = {name: {**r, "vs_graphdist_1": r["median_s"] / base} for name, r in t.items()}
        entry["max_param_diff_after_3_steps"] = diff
        peers = [(module, devices) for module in ("bench.peers.jax_mlp", "bench.peers.tf_mlp",
                                                  "bench.peers.torch_ddp_mlp")
                 for devices in (1, 4)]
        entry.update(run_peers("bench.peers.graphdist_mlp", peers, base, args.no_peers,
                               "--optimizer", optimizer))
        results[optimizer] = entry
        for name, r in entry.items():
            if isinstance(r, dict):
                first = r.get("first_call_s")
                rows.append([optimizer, name, r["median_s"] * 1e3, r["min_s"] * 1e3,
                             r["vs_graphdist_1"], "" if first is None else f"{first:.2f}"])
    text = table(f"MLP {'-'.join(map(str, SIZES))}, global batch {BATCH}, 4 logical CPU "
                 f"devices vs one (median of {args.repeat}; target: default x4 at least as "
                 "fast as every peer's x4)",
                 ["optimizer", "contender", "median ms", "min ms", "vs graphdist 1 dev",
                  "first call s"],
                 rows)
    save("mirrored_mlp", {"results": results, "table": text})
    return results


DEFAULT = "graphdist Mirrored x4 (default: per-device)"


def plot(payload):
    """ms per step of every contender, one panel per optimizer; graphdist's default
    (per-device) row outlined."""
    from bench.plots import bars, figure, rows_height, timings

    results = payload.get("results", {})
    n = max((len(timings(r)[0]) for r in results.values()), default=0)
    fig, axes = figure(f"MLP {'-'.join(map(str, SIZES))}, global batch {BATCH}: 4 logical "
                       "CPU devices vs one", width=10, height=rows_height(n),
                       ncols=max(1, len(results)))
    for ax, (optimizer, entry) in zip(axes, results.items()):
        medians, mins = timings(entry)
        bars(ax, medians, "ms per step (bar: median, |: min)", mins=mins, highlight=[DEFAULT])
        ax.set_title(optimizer, fontsize=9)
    return fig


if __name__ == "__main__":
    main()
