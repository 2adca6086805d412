"""One training step of an MLP 784-1024-1024-10 (relu), batch 512, float32, Adam, on one CPU
device: graphdist's compiled step against a hand-written numpy forward/backward/Adam step
that reuses its buffers (`out=`), side by side in one run.

    python -m bench.mlp_step
"""

from __future__ import annotations

import numpy as np

import graphdist as gd
from bench.common import interleaved, save, table

from bench.models import B1, B2, EPS, make_step
from bench.peers.common import BATCH, LR, SIZES, init

# forward: three x @ W; backward: three dW = h.T @ d and two d @ W.T (no gradient for x)
_LAYERS = list(zip(SIZES[:-1], SIZES[1:]))
MATMUL_FLOPS = 2 * BATCH * (2 * sum(a * b for a, b in _LAYERS) + sum(a * b for a, b in _LAYERS[1:]))


class NumpyStep:
    """Forward, backward and Adam written by hand with preallocated buffers."""

    def __init__(self, params):
        self.p = [p.copy() for p in params]
        self.m = [np.zeros_like(p) for p in params]
        self.v = [np.zeros_like(p) for p in params]
        self.g = [np.zeros_like(p) for p in params]
        self.tmp = [np.zeros_like(p) for p in params]
        self.t = 0
        self.h = [np.empty((BATCH, n), np.float32) for n in SIZES[1:]]
        self.d = [np.empty((BATCH, n), np.float32) for n in SIZES[1:]]
        self.rows = np.arange(BATCH)

    def __call__(self, x, y):
        p, h, d = self.p, self.h, self.d
        # forward
        np.matmul(x, p[0], out=h[0]); h[0] += p[1]; np.maximum(h[0], 0, out=h[0])
        np.matmul(h[0], p[2], out=h[1]); h[1] += p[3]; np.maximum(h[1], 0, out=h[1])
        np.matmul(h[1], p[4], out=h[2]); h[2] += p[5]
        logits = h[2]
        shifted = logits - logits.max(axis=1, keepdims=True)
        e = np.exp(shifted)
        s = e.sum(axis=1, keepdims=True)
        loss = float(np.mean(np.log(s[:, 0]) - shifted[self.rows, y]))
        # backward: d logits = (softmax - onehot) / B
        np.divide(e, s, out=d[2]); d[2][self.rows, y] -= 1; d[2] /= BATCH
        np.matmul(h[1].T, d[2], out=self.g[4]); np.sum(d[2], axis=0, out=self.g[5])
        np.matmul(d[2], p[4].T, out=d[1]); d[1] *= h[1] > 0
        np.matmul(h[0].T, d[1], out=self.g[2]); np.sum(d[1], axis=0, out=self.g[3])
        np.matmul(d[1], p[2].T, out=d[0]); d[0] *= h[0] > 0
        np.matmul(x.T, d[0], out=self.g[0]); np.sum(d[0], axis=0, out=self.g[1])
        # Adam, in place
        self.t += 1
        lr_t = np.float32(LR * np.sqrt(1 - B2 ** self.t) / (1 - B1 ** self.t))
        for p_, g, m, v, tmp in zip(p, self.g, self.m, self.v, self.tmp):
            m *= np.float32(B1); np.multiply(g, np.float32(1 - B1), out=tmp); m += tmp
            v *= np.float32(B2); np.multiply(g, g, out=tmp); tmp *= np.float32(1 - B2); v += tmp
            np.sqrt(v, out=tmp); tmp += np.float32(EPS); np.divide(m, tmp, out=tmp)
            tmp *= lr_t; p_ -= tmp
        return loss


def graphdist_step(params, fused: bool):
    gd.config.set_fused_kernels(fused)
    step, ws = make_step(gd.OneDeviceStrategy("cpu:0"), "adam", params)
    return (lambda x, y: step((x, y))), ws


def main(repeat: int = 20) -> dict:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((BATCH, SIZES[0])).astype(np.float32)
    y = rng.integers(0, SIZES[-1], BATCH).astype(np.int32)
    params = init()
    by_hand = NumpyStep(params)
    contenders = {"numpy by hand (out=)": lambda: by_hand(x, y)}
    steps = {}
    for fused in (True, False):
        step, ws = graphdist_step(params, fused)
        name = f"graphdist ({'fused kernels' if fused else 'numpy impls'})"
        steps[name] = (step, ws)
        contenders[name] = (lambda s=step: s(x, y))
    gd.config.set_fused_kernels(True)
    # correctness first: three steps of each agree with the hand-written step
    check = NumpyStep(params)
    for name, (step, ws) in steps.items():
        fresh_step, fresh_ws = graphdist_step(params, "fused" in name)
        for _ in range(3):
            fresh_step(x, y)
        if name == next(iter(steps)):
            for _ in range(3):
                check(x, y)
        for w, ref in zip(fresh_ws, check.p):
            np.testing.assert_allclose(w.numpy(), ref, rtol=2e-3, atol=2e-5)
    gd.config.set_fused_kernels(True)
    a = np.ones((1024, 1024), np.float32)
    out = np.empty_like(a)
    contenders["BLAS probe: sgemm 1024^3"] = lambda: np.matmul(a, a, out=out)
    t = interleaved(contenders, repeat=repeat, warmup=3)
    peak = 2 * 1024**3 / t.pop("BLAS probe: sgemm 1024^3")["median_s"]
    base = t["numpy by hand (out=)"]["median_s"]
    rows = [[k, v["median_s"] * 1e3, v["min_s"] * 1e3, v["median_s"] / base,
             MATMUL_FLOPS / v["median_s"] / peak] for k, v in t.items()]
    text = table(f"MLP {'-'.join(map(str, SIZES))}, batch {BATCH}, Adam, one CPU device "
                 f"(median of {repeat}; target: graphdist <= numpy by hand)",
                 ["contender", "median ms", "min ms", "vs numpy", "matmul FLOPs/s vs sgemm"],
                 rows)
    print(f"sgemm 1024^3 probe: {peak / 1e9:.0f} GFLOP/s; the step's matmuls are "
          f"{MATMUL_FLOPS / 1e9:.2f} GFLOP")
    save("mlp_step", {"sizes": SIZES, "batch": BATCH, "results": t, "table": text,
                      "sgemm_probe_flops": peak, "step_matmul_flops": MATMUL_FLOPS})
    return t


def plot(payload):
    """ms per step, and the step's matmul FLOP rate as a share of the sgemm probe's (the
    bound: a step can't run its matmuls faster than BLAS runs one big one)."""
    from bench.plots import bars, figure, rows_height, timings

    medians, mins = timings(payload.get("results", {}))
    sizes = payload.get("sizes", SIZES)
    peak, flops = payload.get("sgemm_probe_flops"), payload.get("step_matmul_flops")
    fig, axes = figure(f"MLP {'-'.join(map(str, sizes))}, batch {payload.get('batch', BATCH)}, "
                       "Adam, one CPU device", width=9, height=rows_height(len(medians)),
                       ncols=2 if peak and flops else 1)
    bars(axes[0], medians, "ms per step (bar: median, |: min)", mins=mins)
    if len(axes) > 1:
        share = {n: flops / (m * 1e-3) / peak for n, m in medians.items()}
        bars(axes[1], share, "matmul FLOP/s of the step / sgemm 1024^3 probe", "{:.2f}")
        axes[1].axvline(1.0, color="#ff7f0e", linestyle="--", linewidth=1)
        axes[1].set_yticks([])
    return fig


if __name__ == "__main__":
    main()
