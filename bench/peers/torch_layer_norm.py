"""PyTorch's CPU layer norm for bench/layer_norm.py: torch.nn.functional.layer_norm forward
(no grad) and its backward kernel (aten.native_layer_norm_backward, given the mean and
1/std its forward saved, as autograd calls it), over the same (rows, D) float32 arrays,
timed side by side (interleaved) in this one process.

    python -m bench.peers.torch_layer_norm --shapes 2048x128,8192x1024 [--repeat 15]
"""

from __future__ import annotations

import argparse
import os

EPSILON = 1e-5


def contenders(shape: tuple[int, int]) -> dict:
    """{name: call} on the arrays bench/layer_norm.py builds (seed 0)."""
    import torch
    import torch.nn.functional as F

    from bench.layer_norm import arrays

    x, ct, gamma, beta = (torch.from_numpy(a) for a in arrays(shape))
    d = shape[1]
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [d], gamma, beta, EPSILON)
    mask = [True, True, True]
    return {"torch forward (F.layer_norm)": lambda: F.layer_norm(x, (d,), gamma, beta, EPSILON),
            "torch gradient (native_layer_norm_backward)": lambda: (
                torch.ops.aten.native_layer_norm_backward(ct, x, [d], mean, rstd, gamma, beta,
                                                          mask))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", required=True, help="comma-separated RxD shapes")
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    import torch

    from bench.common import interleaved
    from bench.peers.common import report

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    results = {}
    with torch.no_grad():
        for text in args.shapes.split(","):
            shape = tuple(int(n) for n in text.split("x"))
            results[text] = interleaved(contenders(shape), repeat=args.repeat, warmup=3)
    report({"peer": "torch", "torch": torch.__version__, "threads": torch.get_num_threads(),
            "results": results})


if __name__ == "__main__":
    main()
