"""The MLP 784-1024-1024-10 step, global batch 512, on 4 logical CPU devices with
MirroredStrategy against graphdist's own one-device step, as it runs by default (one copy
per device with its collectives, what the views show) and merged (opt-in: the replicas as
one batched program), and the peers on the same model and machine in the same run:
TensorFlow (tf.function and MirroredStrategy x4 with ReductionToOneDevice) and JAX (jit and
pmap over 4 host devices). Target: the default x4 step at least as fast as both peers' x4.

Peers run in subprocesses of the benchmark environment's Python (`.venv-bench/bin/python`
or $GRAPHDIST_PEER_PYTHON); graphdist never depends on them.

    python -m bench.mirrored_mlp [--no-peers]
"""

from __future__ import annotations

import argparse

import numpy as np

import graphdist as gd
from bench.common import interleaved, run_peers, save, table
from bench.models import make_step
from bench.peers.common import BATCH, SIZES, data

def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args(argv)
    x, y = data()
    one = gd.OneDeviceStrategy("cpu:0")
    four = gd.MirroredStrategy([f"cpu:{i}" for i in range(4)])
    batch4 = next(iter(four.experimental_distribute_dataset([(x, y)])))
    results, rows = {}, []
    for optimizer in ("adam", "momentum"):
        s1, w1 = make_step(one, optimizer)
        s4, w4 = make_step(four, optimizer)              # per-device copies (the default)
        gd.config.set_device_concurrency("merged")
        try:                                             # the same step, replicas merged
            s4m, w4m = make_step(four, optimizer)
            s4m(batch4)
        finally:
            gd.config.set_device_concurrency("auto")
        assert not s4.get_replicated_graph(batch4).merged and s4m.replicated_graph.merged
        for _ in range(3):                    # the same three steps: same parameters
            s1((x, y))
            s4(batch4)
        diff = max(float(np.max(np.abs(a.numpy() - b.numpy()))) for a, b in zip(w1, w4))
        t = interleaved({"graphdist 1 device": lambda: s1((x, y)),
                         "graphdist Mirrored x4 (default: per-device)": lambda: s4(batch4),
                         "graphdist Mirrored x4 merged (opt-in)": lambda: s4m(batch4)},
                        repeat=args.repeat)
        base = t["graphdist 1 device"]["median_s"]
        entry = {name: {**r, "vs_graphdist_1": r["median_s"] / base} for name, r in t.items()}
        entry["max_param_diff_after_3_steps"] = diff
        peers = [(module, devices) for module in ("bench.peers.jax_mlp", "bench.peers.tf_mlp")
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
                 "fast as TF Mirrored x4 and JAX pmap x4)",
                 ["optimizer", "contender", "median ms", "min ms", "vs graphdist 1 dev",
                  "first call s"],
                 rows)
    save("mirrored_mlp", {"results": results, "table": text})
    return results


if __name__ == "__main__":
    main()
