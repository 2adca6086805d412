"""Compile time (trace + passes + lowering) against graph size: chains of matmul/tanh of
1k, 5k, 10k and 50k nodes. Target: linear growth, and a 5,000-op chain in under 0.5 s.

    python -m bench.trace_time
"""

from __future__ import annotations

import time

import numpy as np

import graphdist as gd
from bench.common import save, table

SIZES = (1000, 5000, 10000, 50000)


def chain(n_ops: int):
    def fn(x, w):
        for i in range(n_ops // 2):
            x = gd.tanh(x @ w)
        return x
    return fn


def compile_seconds(n_ops: int) -> tuple[float, int]:
    x = np.ones((4, 4), np.float32)
    w = np.eye(4, dtype=np.float32) * 0.5
    f = gd.function(chain(n_ops))
    t0 = time.perf_counter()
    f.get_graph(x, w)                 # trace + passes + place + schedule + lower
    return time.perf_counter() - t0, len(f.graph)


def main() -> dict:
    compile_seconds(100)              # warm imports
    rows, results = [], {}
    for n in SIZES:
        best = min(compile_seconds(n)[0] for _ in range(3 if n <= 10000 else 1))
        _, nodes = compile_seconds(min(n, 1000))
        results[str(n)] = {"seconds": best, "us_per_node": best / n * 1e6}
        rows.append([n, best, best / n * 1e6])
    text = table("Compile time of a matmul/tanh chain (trace + passes + lowering; best of 3)",
                 ["nodes", "seconds", "us/node"], rows)
    save("trace_time", {"results": results, "table": text})
    return results


if __name__ == "__main__":
    main()
