"""Layer norm on CPU, forward and gradient, over the rows of a float32 (rows, D) array with
gamma and beta: (2048, 128) is one of the GPT benchmark's normalizations (batch 32 x 64
tokens, width 128; 1 MiB, cache-resident), (8192, 1024) a wider model's (32 MiB, from
memory). graphdist's fused kernels (as its executor calls them, through the kernel table)
against the op's numpy impl (what runs with the fused kernels off) and PyTorch's CPU kernels
(F.layer_norm, and native_layer_norm_backward given the statistics its forward saved).

The bound is a copy of the same bytes at the same size (the faster of np.copyto and a
parallel Numba loop): the forward must read x and write y (2 x 4 bytes an element), the
gradient read ct and x and write dx (3 x 4; dgamma and dbeta are D-long). "x bound" is the
time over the bytes' copy time: 1 is memory (or cache) speed.

graphdist and numpy are timed side by side in this process; PyTorch in a subprocess of the
benchmark environment (bench/peers/torch_layer_norm.py), interleaved there, right after.

    python -m bench.layer_norm [--repeat 15] [--shapes 2048x128,8192x1024]
"""

from __future__ import annotations

import argparse

import numpy as np

from bench.common import interleaved, peer_python, run_peer, save, table

SHAPES = ((2048, 128), (8192, 1024))
EPSILON = 1e-5
BYTES = {"forward": 8, "gradient": 12, "copy": 8}          # per element, float32


def arrays(shape: tuple[int, int]) -> tuple:
    """x (mean 2, std 3), ct, gamma, beta: float32, seed 0 (the torch peer builds the same)."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) * 3 + 2).astype(np.float32)
    ct = rng.standard_normal(shape).astype(np.float32)
    gamma = rng.uniform(0.5, 1.5, shape[1]).astype(np.float32)
    beta = rng.standard_normal(shape[1]).astype(np.float32)
    return x, ct, gamma, beta


def local_contenders(shape: tuple[int, int]) -> dict:
    """{name: (call, pass)}: graphdist's kernels and the op's numpy impls, checked against
    each other first, and the copy references."""
    from bench.adam_fused import COPIES, numba_references
    from graphdist.ops import OPS
    from graphdist.runtime.adapters.nn import layer_norm_cpu, layer_norm_grad_cpu

    x, ct, gamma, beta = arrays(shape)
    params = {"naxes": 1, "epsilon": EPSILON, "scale": True, "center": True}
    y, grads = np.empty_like(x), (np.empty_like(x), np.empty_like(gamma), np.empty_like(beta))
    forward = lambda: layer_norm_cpu(y, x, gamma, beta, **params)
    gradient = lambda: layer_norm_grad_cpu(grads, ct, x, gamma, **params)
    np_forward = lambda: OPS["layer_norm"].impl(np, x, gamma, beta, **params)
    np_gradient = lambda: OPS["layer_norm_grad"].impl(np, ct, x, gamma, **params)
    forward(), gradient()
    np.testing.assert_allclose(y, np_forward(), rtol=1e-4, atol=1e-4)
    for got, want in zip(grads, np_gradient()):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3 * np.abs(want).max())
    copies = {name: fn for name, fn in numba_references(x.size).items() if name in COPIES}
    return {"graphdist forward": (forward, "forward"),
            "numpy forward (the op's impl)": (np_forward, "forward"),
            "graphdist gradient": (gradient, "gradient"),
            "numpy gradient (the op's impl)": (np_gradient, "gradient"),
            **{name: (fn, "copy") for name, fn in copies.items()}}


# PyTorch allocates its outputs on every call; glibc serves blocks of 32 MiB and more with
# mmap and unmaps them on free, so each call faults fresh pages in. A second run keeps
# freed blocks in the heap (what jemalloc or tcmalloc would do): the kernels themselves.
KEEP_FREED = {"MALLOC_MMAP_THRESHOLD_": str(2**32), "MALLOC_TRIM_THRESHOLD_": str(2**32)}


def torch_results(shapes, repeat: int) -> dict:
    """{shape text: {name: timing}} from bench/peers/torch_layer_norm.py, as is and with
    KEEP_FREED; {} without the benchmark environment or when it fails."""
    python = peer_python()
    out: dict = {}
    for suffix, env in (("", None), (", freed memory kept", KEEP_FREED)):
        r = python and run_peer(python, "bench.peers.torch_layer_norm", "--shapes",
                                ",".join(f"{a}x{b}" for a, b in shapes), "--repeat",
                                str(repeat), env_extra=env)
        for key, timed in (r["results"] if r else {}).items():
            out.setdefault(key, {}).update({name.replace(")", suffix + ")"): t
                                            for name, t in timed.items()})
    return out


def measure(shape, repeat: int) -> dict:
    """{name: timing and pass} of the contenders timed here, for one shape."""
    local = local_contenders(shape)
    t = interleaved({name: fn for name, (fn, _) in local.items()}, repeat=repeat, warmup=3,
                    label=f"layer norm {shape}")
    return {name: {**t[name], "pass": kind} for name, (_, kind) in local.items()}


def derive(timed: dict, elements: int) -> dict:
    """The timings with GB/s, x bound and vs graphdist added, forward rows first."""
    copy_s = min(r["median_s"] for r in timed.values() if r["pass"] == "copy")
    for r in timed.values():
        nbytes = BYTES[r["pass"]] * elements
        bound_s = copy_s * BYTES[r["pass"]] / BYTES["copy"]    # these bytes at copy speed
        r.update(GB_per_s=nbytes / r["median_s"] / 1e9, x_bound=r["median_s"] / bound_s)
        if r["pass"] != "copy":
            r["vs_graphdist"] = r["median_s"] / timed[f"graphdist {r['pass']}"]["median_s"]
    order = ("forward", "gradient", "copy")
    return dict(sorted(timed.items(), key=lambda kv: order.index(kv[1]["pass"])))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--shapes", default=",".join(f"{a}x{b}" for a, b in SHAPES),
                    help="comma-separated RxD shapes (default: %(default)s)")
    args = ap.parse_args(argv)
    shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")]
    timed = {f"{a}x{b}": measure((a, b), args.repeat) for a, b in shapes}
    for key, peer in torch_results(shapes, args.repeat).items():
        timed[key].update({name: {**r, "pass": "forward" if "forward" in name else "gradient"}
                           for name, r in peer.items()})
    results = {key: derive(t, a * b) for (key, t), (a, b) in zip(timed.items(), shapes)}
    rows = [[key, name, r["median_s"] * 1e3, r["min_s"] * 1e3, r["GB_per_s"], r["x_bound"],
             r.get("vs_graphdist", "")]
            for key, per in results.items() for name, r in per.items()]
    text = table(f"layer norm, float32 with gamma and beta (median of {args.repeat}; torch in "
                 "its own process, right after; x bound: over a copy of the bytes)",
                 ["rows x D", "contender", "ms", "min ms", "GB/s", "x bound", "vs graphdist"],
                 rows)
    save("layer_norm", {"epsilon": EPSILON, "bytes_per_element": BYTES, "results": results,
                        "table": text})
    return results


def plot(payload: dict):
    """Effective GB/s per contender, one panel per shape; the copies (the bound) in orange."""
    from bench.plots import bars, figure, rows_height

    shapes = list(payload["results"])
    most = max(len(timed) for timed in payload["results"].values())
    fig, axes = figure("Layer norm on CPU, float32 (forward: 8 B/element, gradient: 12)",
                       width=5.0 * len(shapes), height=rows_height(most), ncols=len(shapes))
    for ax, key in zip(axes, shapes):
        timed = payload["results"][key]
        bars(ax, {name: r["GB_per_s"] for name, r in timed.items()},
             f"{key.replace('x', ' x ')}: effective GB/s (bytes moved / time)", wrap=26)
    return fig


if __name__ == "__main__":
    main()
