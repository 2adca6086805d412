"""PyTorch: the benchmark GPT step on one CPU device (Adam, eager), in plain ops: matmuls,
masked_fill + softmax for the causal attention (not scaled_dot_product_attention),
F.layer_norm, exact F.gelu, F.cross_entropy.

    python -m bench.peers.torch_gpt [--profile]

--profile reports the step's time per op group instead (torch.profiler's self CPU time of
each aten op, grouped as bench/peers/gpt_common.op_group groups graphdist's ops; the ops
under Optimizer.step as the Adam update).
"""

from __future__ import annotations

import argparse
import math


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    if args.devices != 1:
        raise SystemExit("torch_gpt: one device only (the 4-replica rows compare TF and JAX)")
    import torch

    from bench.peers.common import LR, report, time_steps
    from bench.peers.gpt_common import HEADS, KEY_DIM, LAYERS, LN_EPS, WIDTH, gpt_data, gpt_init

    x, y = gpt_data()
    p = {k: torch.tensor(v, requires_grad=True) for k, v in gpt_init().items()}
    opt = torch.optim.Adam(p.values(), lr=LR, eps=1e-7)
    xs, ys = torch.tensor(x, dtype=torch.long), torch.tensor(y, dtype=torch.long)
    F = torch.nn.functional
    B, T, H, K = *x.shape, HEADS, KEY_DIM
    future = torch.ones(T, T, dtype=torch.bool).triu(1)                 # key > query

    def ln(h, name):
        return F.layer_norm(h, (WIDTH,), p[f"{name}.g"], p[f"{name}.b"], LN_EPS)

    def heads(h, name):                 # (B, T, D) -> (B, H, T, K)
        w, b = p[f"{name}.w"].view(WIDTH, H * K), p[f"{name}.b"].view(H * K)
        return (h @ w + b).view(B, T, H, K).transpose(1, 2)

    def attention(h, i):
        q, k, v = (heads(h, f"h{i}.{n}") for n in "qkv")
        scores = (q * (1 / math.sqrt(K))) @ k.transpose(-1, -2)
        probs = scores.masked_fill(future, float("-inf")).softmax(-1)
        out = (probs @ v).transpose(1, 2).reshape(B, T, H * K)
        return out @ p[f"h{i}.o.w"].view(H * K, WIDTH) + p[f"h{i}.o.b"]

    def step():
        h = F.embedding(xs, p["wte"]) + p["wpe"][:T]
        for i in range(LAYERS):
            h = h + attention(ln(h, f"h{i}.ln1"), i)
            m = F.gelu(ln(h, f"h{i}.ln2") @ p[f"h{i}.fc.w"] + p[f"h{i}.fc.b"])
            h = h + m @ p[f"h{i}.proj.w"] + p[f"h{i}.proj.b"]
        logits = ln(h, "lnf") @ p["head.w"] + p["head.b"]
        loss = F.cross_entropy(logits.reshape(B * T, -1), ys.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.detach()

    if args.profile:
        report({"peer": "PyTorch eager", "ops_s": profile(step)})
        return
    losses = []
    r = time_steps(step, sync=lambda loss: losses.append(float(loss)))
    report({"peer": "PyTorch eager", "devices": 1, "optimizer": "adam", "losses": losses[:3],
            **r})


def profile(step, repeat: int = 5) -> dict:
    """Seconds per step in each op group, from torch.profiler after a warm-up."""
    import torch

    from bench.peers.gpt_common import op_group

    for _ in range(5):
        step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(repeat):
            step()
    totals: dict = {}
    for e in prof.events():
        group, up = op_group(e.name), e
        while up is not None:           # the optimizer's ops are plain arithmetic
            if up.name.startswith("Optimizer.step"):
                group = "adam update"
            up = up.cpu_parent
        totals[group] = totals.get(group, 0.0) + e.self_cpu_time_total / 1e6 / repeat
    return totals


if __name__ == "__main__":
    main()
