"""PyTorch: a benchmark GPT step (bench/peers/gpt_common.py: the GPT by default, the
GPT-2-style step from torch_gpt2.py) on one CPU device (Adam, eager), in plain ops: matmuls,
softmax over the causal scores (masked_fill for the GPT, the additive mask for the GPT-2-style
step; not scaled_dot_product_attention), F.layer_norm, F.gelu in the model's form,
F.cross_entropy.

    python -m bench.peers.torch_gpt [--profile]

--profile reports the step's time per op group instead (torch.profiler's self CPU time of
each aten op, grouped as bench/peers/gpt_common.op_group groups graphdist's ops; the ops
under Optimizer.step as the Adam update).
"""

from __future__ import annotations

import argparse
import math

from bench.peers.gpt_common import GPT_MODEL, Model


def main(model: Model = GPT_MODEL) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    from bench.peers.common import LR, one_device_only, report, timed_with_losses

    one_device_only("torch_gpt", args.devices, "the 4-replica rows compare TF and JAX")
    import torch

    from bench.peers.gpt_common import (HEADS, KEY_DIM, LAYERS, LN_EPS, WIDTH,
                                        additive_causal_mask, parameter_count)

    x, y = model.data()
    p = {k: torch.tensor(v, requires_grad=True) for k, v in model.init().items()}
    opt = torch.optim.Adam(p.values(), lr=LR, eps=1e-7)
    xs, ys = torch.tensor(x, dtype=torch.long), torch.tensor(y, dtype=torch.long)
    F = torch.nn.functional
    B, T, H, K = *x.shape, HEADS, KEY_DIM
    future = torch.ones(T, T, dtype=torch.bool).triu(1)                 # key > query
    mask = torch.tensor(additive_causal_mask(T))
    gelu = "tanh" if model.tanh_gelu else "none"

    def ln(h, name):
        return F.layer_norm(h, (WIDTH,), p[f"{name}.g"], p[f"{name}.b"], LN_EPS)

    def qkv(h, i):                      # (B, T, D) -> three (B, T, H * K)
        if model.fused_qkv:
            return (h @ p[f"h{i}.qkv.w"] + p[f"h{i}.qkv.b"]).split(WIDTH, -1)
        return [h @ p[f"h{i}.{n}.w"].view(WIDTH, H * K) + p[f"h{i}.{n}.b"].view(H * K)
                for n in "qkv"]

    def attention(h, i):
        q, k, v = (z.view(B, T, H, K).transpose(1, 2) for z in qkv(h, i))
        if model.additive_mask:
            probs = (q @ k.transpose(-1, -2) * (1 / math.sqrt(K)) + mask).softmax(-1)
        else:
            scores = (q * (1 / math.sqrt(K))) @ k.transpose(-1, -2)
            probs = scores.masked_fill(future, float("-inf")).softmax(-1)
        out = (probs @ v).transpose(1, 2).reshape(B, T, H * K)
        return out @ p[f"h{i}.o.w"].view(H * K, WIDTH) + p[f"h{i}.o.b"]

    def step():
        h = F.embedding(xs, p["wte"]) + p["wpe"][:T]
        for i in range(LAYERS):
            h = h + attention(ln(h, f"h{i}.ln1"), i)
            m = F.gelu(ln(h, f"h{i}.ln2") @ p[f"h{i}.fc.w"] + p[f"h{i}.fc.b"],
                       approximate=gelu)
            h = h + m @ p[f"h{i}.proj.w"] + p[f"h{i}.proj.b"]
        logits = ln(h, "lnf") @ p["head.w"]
        if model.head_bias:
            logits = logits + p["head.b"]
        loss = F.cross_entropy(logits.reshape(B * T, -1), ys.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.detach()

    if args.profile:
        report({"peer": "PyTorch eager", "ops_s": profile(step)})
        return
    report({"peer": "PyTorch eager", "devices": 1, "optimizer": "adam",
            "parameters": parameter_count(t.shape for t in p.values()),
            **timed_with_losses(step)})


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
