"""PyTorch's optimizer updates on CPU for bench/adam_fused.py: Adam and SGD with momentum,
each as fused=True, foreach=True and the plain per-tensor loop (foreach=False), over the
same tensor sizes, timed side by side (interleaved) in this one process.

The gradients are fixed tensors set once, so a sample is `opt.step()` alone: the update's
memory traffic, as the graphdist rows time it.

    python -m bench.peers.torch_optim --sizes 4096,8192,... [--repeat 15]
"""

from __future__ import annotations

import argparse
import os

import numpy as np

LR, B1, B2, EPS, MOMENTUM = 1e-3, 0.9, 0.999, 1e-7, 0.9


def tensors(sizes: list[int]):
    """Parameters and gradients with the values bench/adam_fused.py uses (seed 0)."""
    import torch

    rng = np.random.default_rng(0)
    params = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    grads = [rng.standard_normal(n).astype(np.float32) * 1e-2 for n in sizes]
    ps = [torch.nn.Parameter(torch.from_numpy(p)) for p in params]
    for p, g in zip(ps, grads):
        p.grad = torch.from_numpy(g)
    return ps


def contenders(sizes: list[int]) -> dict:
    """{name: step}. Each optimizer owns its parameters: the states (m, v, momentum) and the
    parameters it writes are its own, as in a real model."""
    import torch

    out = {}
    for mode in ("fused", "foreach", "for-loop"):
        kw = {"fused": {"fused": True}, "foreach": {"foreach": True},
              "for-loop": {"foreach": False, "fused": False}}[mode]
        label = ", ".join(f"{k}={v}" for k, v in kw.items())
        adam = torch.optim.Adam(tensors(sizes), lr=LR, betas=(B1, B2), eps=EPS, **kw)
        sgd = torch.optim.SGD(tensors(sizes), lr=LR, momentum=MOMENTUM, **kw)
        out[f"torch Adam({label})"] = adam.step
        out[f"torch SGD(momentum=0.9, {label})"] = sgd.step
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", required=True, help="comma-separated tensor sizes")
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    import torch

    from bench.common import interleaved
    from bench.peers.common import report

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    sizes = [int(s) for s in args.sizes.split(",")]
    with torch.no_grad():
        t = interleaved(contenders(sizes), repeat=args.repeat, warmup=2)
    report({"peer": "torch", "torch": torch.__version__, "threads": torch.get_num_threads(),
            "results": t})


if __name__ == "__main__":
    main()
