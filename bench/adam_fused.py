"""Fused Adam over 16M float32 parameters in 50 tensors, through the public API
(apply_gradients inside a compiled step), against unfused numpy with `out=`,
torch.optim.Adam(fused=True) on CPU (when torch is installed in the benchmark environment),
and an in-place `a += s * b` Numba probe of the memory bandwidth, side by side in one run.

Effective bandwidth counts 7 x 4 bytes per parameter for Adam (read p, g, m, v; write p, m,
v) and 3 x 4 for the probe.

    python -m bench.adam_fused
"""

from __future__ import annotations

import numpy as np

import graphdist as gd
from bench.common import interleaved, save, table

TOTAL = 16 * 2**20
N_TENSORS = 50
LR, B1, B2, EPS = 1e-3, 0.9, 0.999, 1e-7


def sizes(total: int = TOTAL) -> list[int]:
    """50 sizes from 4K to ~1.3M elements (for 16M) that add up to `total`: a model-like
    spread."""
    raw = np.geomspace(1, 300, N_TENSORS)
    s = np.maximum(min(4096, total // (4 * N_TENSORS)), (raw / raw.sum() * total).astype(int))
    s[-1] += total - s.sum()
    return [int(x) for x in s]


def numpy_adam(params, grads, ms, vs, tmp):
    t = [0]

    def step():
        t[0] += 1
        lr_t = np.float32(LR * np.sqrt(1 - B2 ** t[0]) / (1 - B1 ** t[0]))
        for p, g, m, v, w in zip(params, grads, ms, vs, tmp):
            m *= np.float32(B1); np.multiply(g, np.float32(1 - B1), out=w); m += w
            v *= np.float32(B2); np.multiply(g, g, out=w); w *= np.float32(1 - B2); v += w
            np.sqrt(v, out=w); w += np.float32(EPS); np.divide(m, w, out=w)
            w *= lr_t; p -= w
    return step


def numba_probe(n):
    import numba

    @numba.njit(parallel=True, cache=True, error_model="numpy")
    def axpy(a, b, s):
        for i in numba.prange(a.size):
            a[i] += s * b[i]

    a = np.ones(n, np.float32)
    b = np.ones(n, np.float32)
    axpy(a, b, np.float32(1e-9))
    return lambda: axpy(a, b, np.float32(1e-9))


def torch_adam(params_np, grads_np):
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(len(__import__("os").sched_getaffinity(0)))
    params = [torch.nn.Parameter(torch.from_numpy(p.copy())) for p in params_np]
    for p, g in zip(params, grads_np):
        p.grad = torch.from_numpy(g.copy())
    opt = torch.optim.Adam(params, lr=LR, betas=(B1, B2), eps=EPS, fused=True)
    return opt.step


def main(repeat: int = 15) -> dict:
    rng = np.random.default_rng(0)
    shapes = sizes()
    params = [rng.standard_normal(n).astype(np.float32) for n in shapes]
    grads = [rng.standard_normal(n).astype(np.float32) * 1e-2 for n in shapes]
    variables = [gd.Variable(p, name=f"p{i}") for i, p in enumerate(params)]
    opt = gd.optimizers.Adam(LR, B1, B2, EPS)
    step = gd.function(lambda gs: opt.apply_gradients(zip(gs, variables)))
    assert sum(e.op.name == "adam_multi_update" for e in step.get_graph(grads).eqns) == 1
    np_state = ([p.copy() for p in params], grads, [np.zeros_like(p) for p in params],
                [np.zeros_like(p) for p in params], [np.zeros_like(p) for p in params])
    contenders = {"graphdist fused Adam": lambda: step(grads),
                  "numpy unfused (out=)": numpy_adam(*np_state),
                  "numba probe a += s*b": numba_probe(TOTAL)}
    torch_step = torch_adam(params, grads)
    if torch_step is not None:
        contenders["torch Adam(fused=True)"] = torch_step
    t = interleaved(contenders, repeat=repeat, warmup=2)
    rows, results = [], {}
    probe_gbs = 3 * 4 * TOTAL / t["numba probe a += s*b"]["median_s"] / 1e9
    for name, r in t.items():
        per_param = 12 if "probe" in name else 28
        gbs = per_param * TOTAL / r["median_s"] / 1e9
        results[name] = {**r, "GB_per_s": gbs, "vs_probe": gbs / probe_gbs}
        rows.append([name, r["median_s"] * 1e3, gbs, gbs / probe_gbs])
    text = table(f"Adam over {TOTAL / 2**20:.0f}M float32 params in {N_TENSORS} tensors "
                 f"(median of {repeat})", ["contender", "ms", "GB/s", "vs probe"], rows)
    save("adam_fused", {"total_params": TOTAL, "tensors": N_TENSORS, "results": results,
                        "table": text})
    return results


if __name__ == "__main__":
    main()
