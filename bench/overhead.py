"""Per-node run overhead: a chain of 1,000 tiny elementwise ops, compiled by graphdist,
against the same 1,000 numpy calls written by hand in a Python function.

    python -m bench.overhead
"""

from __future__ import annotations

import numpy as np

import graphdist as gd
from bench.common import interleaved, save, table

N_OPS = 1000
OPS = [(np.tanh, gd.tanh), (lambda x: np.multiply(x, 1.01, dtype=np.float32),
                            lambda x: x * 1.01),
       (lambda x: np.add(x, 0.5, dtype=np.float32), lambda x: x + 0.5),
       (np.negative, gd.negative)]


def chain_numpy(x):
    for i in range(N_OPS):
        x = OPS[i % 4][0](x)
    return x


def _generated_numpy_source() -> str:
    # the fair baseline: 1,000 straight-line numpy calls, no loop, no dispatch
    calls = ["np.tanh(x)", "np.multiply(x, c1)", "np.add(x, c2)", "np.negative(x)"]
    body = "\n".join(f"    x = {calls[i % 4]}" for i in range(N_OPS))
    return f"def by_hand(x):\n{body}\n    return x\n"


def main() -> dict:
    env = {"np": np, "c1": np.float32(1.01), "c2": np.float32(0.5)}
    exec(_generated_numpy_source(), env)
    by_hand = env["by_hand"]

    @gd.function
    def chain(x):
        for i in range(N_OPS):
            x = OPS[i % 4][1](x)
        return x

    rows, results = [], {}
    for size in (1, 16, 256):
        x = np.linspace(-1, 1, size, dtype=np.float32)
        np.testing.assert_allclose(chain(x), by_hand(x), rtol=1e-5, atol=1e-6)
        assert len(chain.graph) == N_OPS, len(chain.graph)
        t = interleaved({"numpy": lambda: by_hand(x), "graphdist": lambda: chain(x)},
                        repeat=200, warmup=10)
        ratio = t["graphdist"]["median_s"] / t["numpy"]["median_s"]
        rows.append([size, t["numpy"]["median_s"] * 1e6 / N_OPS,
                     t["graphdist"]["median_s"] * 1e6 / N_OPS, ratio])
        results[str(size)] = {**t, "ratio": ratio}
    text = table(f"Chain of {N_OPS} elementwise ops (median of 200 runs; target ratio <= 1.5)",
                 ["elements", "numpy us/op", "graphdist us/op", "ratio"], rows)
    save("overhead", {"n_ops": N_OPS, "results": results, "table": text})
    return results


def plot(payload):
    """Microseconds per op of the chain, numpy by hand against graphdist, per array size."""
    from bench.plots import figure, grouped

    n_ops = payload.get("n_ops", N_OPS)
    results = payload.get("results", {})
    series = {who: {f"{size} element{'s' if size != '1' else ''}":
                    r[who]["median_s"] * 1e6 / n_ops for size, r in results.items()
                    if "median_s" in r.get(who, {})} for who in ("numpy", "graphdist")}
    fig, axes = figure(f"chain of {n_ops:,} elementwise ops: the cost of each node",
                       width=7, height=2.8)
    grouped(axes[0], {"numpy by hand" if k == "numpy" else k: v for k, v in series.items()},
            "microseconds per op (median of the chain)", "{:.3f}")
    return fig


if __name__ == "__main__":
    main()
