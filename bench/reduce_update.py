"""The gradient all-reduce fused with every replica's optimizer update (what a 4-replica
step on logical CPU devices runs) against the two apart, side by side in one run: the
MLP's 1.86M float32 parameters (6 tensors, one 7.1 MiB bucket) on 4 replicas, with
momentum and with Adam.

Bytes per parameter: apart, the all-reduce reads 4 gradients and writes 4 results (32 B)
and each replica's update reads the result and its state and writes the state (momentum
4 x 20 B, Adam 4 x 28 B); fused, the gradients are read once (16 B) and each replica reads
and writes only its state (momentum 4 x 16 B, Adam 4 x 24 B).

    python -m bench.reduce_update
"""

from __future__ import annotations

import numpy as np
from graphdist.kernels import adam, reduce, reduce_update, sgd

from bench.common import interleaved, save, table

SHAPES = [(784, 1024), (1024,), (1024, 1024), (1024,), (1024, 10), (10,)]
REPLICAS = 4


def _setup(rng):
    sizes = [int(np.prod(s)) for s in SHAPES]
    offsets = [int(o) for o in np.cumsum([0] + sizes[:-1])]
    bufs = [rng.standard_normal(sum(sizes)).astype(np.float32) for _ in range(REPLICAS)]
    state = [[rng.standard_normal(s).astype(np.float32) * 0.1 for _ in range(REPLICAS)
              for s in SHAPES] for _ in range(3)]           # p, m, v
    state[2] = [np.abs(v) for v in state[2]]
    return bufs, offsets, sizes, state


def main(repeat: int = 30) -> dict:
    rng = np.random.default_rng(0)
    bufs, offsets, sizes, (ps, ms, vs) = _setup(rng)
    n = len(SHAPES)
    reduced = [np.empty_like(bufs[0]) for _ in bufs]
    views = [[reduced[k][o:o + s].reshape(sh) for o, s, sh in zip(offsets, sizes, SHAPES)]
             for k in range(REPLICAS)]
    lr_t = np.float32(1e-3)

    def apart(kind):
        def run():
            reduce.all_reduce_cpu(bufs, "mean", outs=reduced)
            for k in range(REPLICAS):
                part = slice(k * n, (k + 1) * n)
                if kind == "adam":
                    adam.adam_multi_cpu(ps[part], ms[part], vs[part], views[k], lr_t, 0.9, 0.999,
                                        1e-7)
                else:
                    sgd.sgd_multi_cpu(ps[part], ms[part], views[k], 1e-3, 0.9)
        return run

    def fused(kind):
        if kind == "adam":
            return lambda: reduce_update.reduce_adam_cpu(bufs, offsets, ps, ms, vs,
                                                         [lr_t] * REPLICAS, "mean", 0.9, 0.999,
                                                         1e-7)
        return lambda: reduce_update.reduce_sgd_cpu(bufs, offsets, ps, ms, "mean", 1e-3, 0.9)

    contenders = {f"{kind} {how}": make(kind) for kind in ("momentum", "adam")
                  for how, make in (("all-reduce, then updates", apart), ("fused", fused))}
    t = interleaved(contenders, repeat=repeat, warmup=3)
    total = sum(sizes)
    moved = {"momentum all-reduce, then updates": 32 + 4 * 20, "momentum fused": 16 + 4 * 16,
             "adam all-reduce, then updates": 32 + 4 * 28, "adam fused": 16 + 4 * 24}
    rows, results = [], {}
    for name, r in t.items():
        gbs = moved[name] * total / r["min_s"] / 1e9
        results[name] = {**r, "bytes_per_param": moved[name], "GB_per_s": gbs}
        rows.append([name, r["median_s"] * 1e3, r["min_s"] * 1e3, moved[name], gbs])
    text = table(f"all-reduce + update of {total / 1e6:.2f}M float32 params on {REPLICAS} "
                 f"replicas (min of {repeat})",
                 ["contender", "median ms", "min ms", "B/param", "GB/s (min)"], rows)
    save("reduce_update", {"params": total, "replicas": REPLICAS, "results": results,
                           "table": text})
    return results


def plot(payload):
    """ms per all-reduce + update, fused against all-reduce-then-update, and the memory
    traffic rate each reaches (bytes each pass must move per param over the min time)."""
    from bench.plots import GRAPHDIST, bars, figure, rows_height, timings

    results = payload.get("results", {})
    medians, mins = timings(results)
    rates = {n: r["GB_per_s"] for n, r in results.items() if "GB_per_s" in r}
    colors = {n: GRAPHDIST if n.endswith("fused") else "#9ecae1" for n in medians}
    fig, axes = figure(f"all-reduce + update of {payload.get('params', 0) / 1e6:.2f}M float32 "
                       f"params on {payload.get('replicas', REPLICAS)} replicas", width=9,
                       height=rows_height(len(medians)), ncols=2 if rates else 1)
    bars(axes[0], medians, "ms per step (bar: median, |: min)", mins=mins, colors=colors)
    if rates:
        bars(axes[1], rates, "GB/s of memory traffic (at the min time)", "{:.0f}",
             colors=colors)
        axes[1].set_yticks([])
    return fig


if __name__ == "__main__":
    main()
