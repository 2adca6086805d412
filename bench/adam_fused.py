"""Fused optimizer updates over 16M float32 parameters in 50 tensors, through the public API
(apply_gradients inside a compiled step): Adam and SGD with momentum 0.9, each against
unfused numpy with `out=` and PyTorch's CPU optimizers (fused=True, foreach=True and the
per-tensor loop), with two references for the machine's memory bandwidth: an in-place
`a += s * b` Numba probe and a parallel Numba copy (np.copyto beside it).

Effective bandwidth counts the bytes the update must move per parameter: Adam 7 x 4 (read
p, g, m, v; write p, m, v), SGD with momentum 5 x 4 (read p, g, m; write p, m), the probe
3 x 4 and a copy 2 x 4 (read + write). A copy loop's destination is not read, so the CPU
also reads each of its lines before writing it (a read-for-ownership the count leaves out);
memcpy's non-temporal stores avoid that, and the updates and the probe write only what they
have just read. "vs copy" is against the faster of the two copies.

graphdist, numpy and the references are timed side by side in this process; PyTorch runs
in a subprocess of the benchmark environment (bench/peers/torch_optim.py), its six
contenders interleaved there, right after.

    python -m bench.adam_fused [--repeat 15]
"""

from __future__ import annotations

import argparse

import numpy as np

import graphdist as gd
from bench.common import interleaved, peer_python, run_peer, save, table

TOTAL = 16 * 2**20
N_TENSORS = 50
LR, B1, B2, EPS, MOMENTUM = 1e-3, 0.9, 0.999, 1e-7, 0.9
BYTES = {"Adam": 28, "SGD momentum": 20, "probe": 12, "copy": 8}   # per parameter
PROBE = "numba probe a += s*b"
COPIES = ("copy: numba parallel loop", "copy: np.copyto (memcpy, one thread)")


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


def numpy_momentum(params, grads, ms, tmp):
    """torch.optim.SGD's momentum: m = mu * m + g; p -= lr * m."""
    def step():
        for p, g, m, w in zip(params, grads, ms, tmp):
            m *= np.float32(MOMENTUM); m += g
            np.multiply(m, np.float32(LR), out=w); p -= w
    return step


def numba_references(n: int) -> dict:
    """The memory-bandwidth references over n float32: the in-place probe, a parallel copy
    loop (Numba's threads, as graphdist's kernels use) and np.copyto (glibc's memcpy, whose
    non-temporal stores skip the read-for-ownership: one thread may copy faster)."""
    import numba

    @numba.njit(parallel=True, cache=True, error_model="numpy")
    def axpy(a, b, s):
        for i in numba.prange(a.size):
            a[i] += s * b[i]

    @numba.njit(parallel=True, cache=True)
    def copy(dst, src):
        for i in numba.prange(src.size):
            dst[i] = src[i]

    a, b, c = np.ones(n, np.float32), np.ones(n, np.float32), np.empty(n, np.float32)
    return {PROBE: lambda: axpy(a, b, np.float32(1e-9)), COPIES[0]: lambda: copy(c, b),
            COPIES[1]: lambda: np.copyto(c, b)}


def graphdist_step(opt, params, grads, op_name: str):
    """apply_gradients on fresh variables in a gd.function, checked to be one fused node."""
    variables = [gd.Variable(p, name=f"p{i}") for i, p in enumerate(params)]
    step = gd.function(lambda gs: opt.apply_gradients(zip(gs, variables)))
    found = sum(e.op.name == op_name for e in step.get_graph(grads).eqns)
    assert found == 1, f"expected one {op_name} node in the step, found {found}"
    return lambda: step(grads)


def local_contenders(params, grads) -> dict:
    """{name: (step, bytes per parameter)} for everything timed in this process."""
    zeros = lambda: [np.zeros_like(p) for p in params]
    copies = lambda: [p.copy() for p in params]
    adam = gd.optimizers.Adam(LR, B1, B2, EPS)
    sgd = gd.optimizers.SGD(LR, momentum=MOMENTUM)
    refs = numba_references(TOTAL)
    return {
        "graphdist fused Adam": (graphdist_step(adam, params, grads, "adam_multi_update"),
                                 BYTES["Adam"]),
        "numpy unfused Adam (out=)": (numpy_adam(copies(), grads, zeros(), zeros(), zeros()),
                                      BYTES["Adam"]),
        "graphdist fused SGD momentum": (
            graphdist_step(sgd, params, grads, "sgd_momentum_multi_update"),
            BYTES["SGD momentum"]),
        "numpy unfused SGD momentum (out=)": (numpy_momentum(copies(), grads, zeros(), zeros()),
                                              BYTES["SGD momentum"]),
        PROBE: (refs[PROBE], BYTES["probe"]),
        **{name: (fn, BYTES["copy"]) for name, fn in refs.items() if name != PROBE},
    }


def torch_results(shapes: list[int], repeat: int) -> dict:
    """{name: (timing, bytes per parameter)} from bench/peers/torch_optim.py; {} when there
    is no benchmark environment or it fails."""
    python = peer_python()
    r = python and run_peer(python, "bench.peers.torch_optim", "--sizes",
                            ",".join(map(str, shapes)), "--repeat", str(repeat))
    if not r:
        return {}
    return {name: (t, BYTES["Adam" if "Adam" in name else "SGD momentum"])
            for name, t in r["results"].items()}


def main(repeat: int = 15) -> dict:
    rng = np.random.default_rng(0)
    shapes = sizes()
    params = [rng.standard_normal(n).astype(np.float32) for n in shapes]
    grads = [rng.standard_normal(n).astype(np.float32) * 1e-2 for n in shapes]
    local = local_contenders(params, grads)
    t = interleaved({name: fn for name, (fn, _) in local.items()}, repeat=repeat, warmup=2)
    timed = {name: (t[name], nbytes) for name, (_, nbytes) in local.items()}
    timed.update(torch_results(shapes, repeat))
    gbs = {name: nbytes * TOTAL / r["median_s"] / 1e9 for name, (r, nbytes) in timed.items()}
    copy = max(gbs[name] for name in COPIES)       # the machine's copy bandwidth: the faster
    order = sorted(timed, key=lambda n: ("Adam" not in n, "SGD" not in n))  # Adam, SGD, refs
    rows, results = [], {}
    for name in order:
        r, nbytes = timed[name]
        results[name] = {**r, "bytes_per_param": nbytes, "GB_per_s": gbs[name],
                         "vs_probe": gbs[name] / gbs[PROBE], "vs_copy": gbs[name] / copy}
        rows.append([name, nbytes, r["median_s"] * 1e3, gbs[name], gbs[name] / gbs[PROBE],
                     gbs[name] / copy])
    text = table(f"optimizer updates over {TOTAL / 2**20:.0f}M float32 params in {N_TENSORS} "
                 f"tensors (median of {repeat}; torch in its own process, right after; vs copy: "
                 f"the faster copy, {copy:.1f} GB/s)",
                 ["contender", "B/param", "ms", "GB/s", "vs probe", "vs copy"], rows)
    save("adam_fused", {"total_params": TOTAL, "tensors": N_TENSORS, "copy_GB_per_s": copy,
                        "results": results, "table": text})
    return results


def plot(payload: dict):
    """Effective GB/s per contender; the probe and the copies (the machine's bandwidth) in
    orange."""
    from bench.plots import bars, figure

    fig, (ax,) = figure(f"Optimizer updates, {payload['total_params'] / 2**20:.0f}M float32 "
                        f"params in {payload['tensors']} tensors", height=5.0)
    bars(ax, {name: r["GB_per_s"] for name, r in payload["results"].items()},
         "effective GB/s (bytes the update must move / time)")
    return fig


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=15)
    main(parser.parse_args().repeat)
