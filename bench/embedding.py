"""The embedding-heavy step: a 50,000 x 256 float32 table (51 MB), 4,096 lookups per replica
on 4 logical CPU devices (per-device replication), a squared-error loss on the looked-up
rows, SGD. graphdist's sparse path (the rows all-gathered, duplicates summed, a scatter
update) side by side with the dense gradient (densified, all-reduced) and the one-hot matmul
a user would otherwise write, and PyTorch's sparse embedding gradient; bytes moved between
devices from each step's summary.

    python -m bench.embedding [--no-peers] [--repeat 10] [--one-hot-repeat 2]
"""

from __future__ import annotations

import argparse

import numpy as np

import graphdist as gd
from bench.common import interleaved, peer_python, run_peer, save, table
from bench.peers.embedding import LOOKUPS, LR, REPLICAS, VOCAB, embedding_data
from graphdist.ops.sparse import densify
from graphdist.viz.summary import stats


def make_step(path: str, replicas: int = REPLICAS):
    """(step, batch, table variable) for `path`: "sparse", "dense" or "one_hot"."""
    table0, ids, targets = embedding_data()
    if replicas == 1:
        strategy = gd.OneDeviceStrategy("cpu:0")
    else:
        strategy = gd.MirroredStrategy([f"cpu:{i}" for i in range(replicas)])
    with strategy.scope():
        table = gd.Variable(table0)
        opt = gd.optimizers.SGD(LR)

    def replica_fn(ids, targets):
        with gd.GradientTape() as tape:
            rows = (gd.matmul(gd.one_hot(ids, VOCAB), table) if path == "one_hot"
                    else gd.nn.embedding_lookup(table, ids))
            loss = gd.reduce_mean(gd.reduce_sum(gd.square(rows - targets), axis=1))
        grad = tape.gradient(loss, table)
        opt.apply_gradients([(densify(grad) if path == "dense" else grad, table)])
        return loss

    step = gd.function(lambda i, t: strategy.run(replica_fn, args=(i, t)))
    batch = next(iter(strategy.experimental_distribute_dataset([(ids, targets)])))
    return step, batch, table


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--one-hot-repeat", type=int, default=2)
    args = ap.parse_args(argv)
    steps, moved, tables = {}, {}, {}
    for path in ("sparse", "dense", "one_hot"):
        step, batch, variable = make_step(path)
        step(*batch)                                   # compile
        steps[path] = (lambda s=step, b=batch: s(*b))
        moved[path] = stats(step.replicated_graph)["moved"]
        tables[path] = variable
    one, one_batch, _ = make_step("sparse", replicas=1)
    one(*one_batch)
    after = {p: t.numpy() for p, t in tables.items()}     # one step each: the same update
    np.testing.assert_allclose(after["sparse"], after["dense"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(after["sparse"], after["one_hot"], rtol=1e-4, atol=1e-5)
    timed = interleaved({"sparse": steps["sparse"], "dense": steps["dense"],
                         "1 device": lambda: one(*one_batch)}, repeat=args.repeat, warmup=2)
    timed["one_hot"] = interleaved({"one_hot": steps["one_hot"]},
                                   repeat=args.one_hot_repeat, warmup=1)["one_hot"]
    names = {"sparse": "graphdist sparse: all-gather rows, scatter update (4 replicas)",
             "dense": "graphdist dense gradient: densify, all-reduce (4 replicas)",
             "one_hot": "graphdist one-hot matmul (4 replicas)",
             "1 device": "graphdist sparse, 1 device, global batch"}
    base = timed["sparse"]["median_s"]
    rows = [[names[k], r["median_s"] * 1e3, r["min_s"] * 1e3, moved.get(k, 0) / 2**20,
             r["median_s"] / base] for k, r in timed.items()]
    peers = {}
    python = None if args.no_peers else peer_python()
    for sparse in (1, 0) if python else ():
        r = run_peer(python, "bench.peers.torch_embedding", "--sparse", str(sparse))
        if r:
            peers[r["peer"]] = r
            rows.append([r["peer"], r["median_s"] * 1e3, r["min_s"] * 1e3, 0.0,
                         r["median_s"] / base])
    table(f"Embedding step: {VOCAB:,} x 256 table, {LOOKUPS:,} lookups per replica, SGD",
          ["contender", "median ms", "min ms", "MiB moved between devices", "vs sparse"], rows)
    save("embedding", {"graphdist": {names[k]: {**r, "moved_bytes": moved.get(k, 0)}
                                     for k, r in timed.items()}, "peers": peers})


def plot(payload):
    """ms per step of each path (log scale: the one-hot matmul is hundreds of times slower)
    and the MiB each graphdist path moves between devices per step."""
    from bench.plots import bars, figure, rows_height, timings

    ours = payload.get("graphdist", {})
    medians, mins = timings({**ours, **payload.get("peers", {})})
    moved = {n: r["moved_bytes"] / 2**20 for n, r in ours.items() if "moved_bytes" in r}
    fig, axes = figure(f"Embedding step: {VOCAB:,} x 256 table, {LOOKUPS:,} lookups per "
                       "replica, SGD", width=11, height=rows_height(len(medians)),
                       ncols=2 if moved else 1)
    bars(axes[0], medians, "ms per step, log scale (bar: median, |: min)", mins=mins, log=True)
    if moved:
        bars(axes[1], moved, "MiB moved between devices per step", "{:.0f}")
    return fig


if __name__ == "__main__":
    main()
