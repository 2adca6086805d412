"""JAX: a benchmark GPT step (bench/peers/gpt_common.py: the GPT by default, the GPT-2-style
step from jax_gpt2.py) with jit (one device) or pmap over N host devices (Adam), in plain
jax.numpy: matmuls and einsums, jax.nn.softmax over the causal scores (jnp.where for the GPT,
the additive mask for the GPT-2-style step), layer norm from mean and variance, jax.nn.gelu
in the model's form.

    python -m bench.peers.jax_gpt --devices 4
"""

from __future__ import annotations

import argparse
import os

from bench.peers.gpt_common import GPT_MODEL, Model


def main(model: Model = GPT_MODEL) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=1)
    args = ap.parse_args()
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    import jax
    import jax.numpy as jnp
    import numpy as np

    from bench.peers.common import LR, jax_step, report, time_steps
    from bench.peers.gpt_common import (HEADS, KEY_DIM, LAYERS, LN_EPS, WIDTH,
                                        additive_causal_mask, parameter_count)

    x, y = model.data()
    params = {k: jnp.asarray(v) for k, v in model.init().items()}
    H, K = HEADS, KEY_DIM
    mask = jnp.asarray(additive_causal_mask(x.shape[1]))

    def ln(h, p, name):
        mean = h.mean(-1, keepdims=True)
        var = jnp.square(h - mean).mean(-1, keepdims=True)
        return (h - mean) * jax.lax.rsqrt(var + LN_EPS) * p[f"{name}.g"] + p[f"{name}.b"]

    def qkv(h, p, i):                   # (B, T, D) -> three (B, T, H * K)
        if model.fused_qkv:
            return jnp.split(h @ p[f"h{i}.qkv.w"] + p[f"h{i}.qkv.b"], 3, axis=-1)
        return [h @ p[f"h{i}.{n}.w"].reshape(WIDTH, H * K) + p[f"h{i}.{n}.b"].reshape(-1)
                for n in "qkv"]

    def attention(h, p, i):
        B, T, _ = h.shape
        q, k, v = (z.reshape(B, T, H, K) for z in qkv(h, p, i))
        if model.additive_mask:
            scores = jnp.einsum("bthk,bshk->bhts", q, k) * (1 / np.sqrt(K)) + mask
        else:
            causal = jnp.tril(jnp.ones((T, T), bool))
            scores = jnp.where(causal, jnp.einsum("bthk,bshk->bhts", q * (1 / np.sqrt(K)), k),
                               -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("bhts,bshk->bthk", probs, v).reshape(B, T, H * K)
        return out @ p[f"h{i}.o.w"].reshape(H * K, WIDTH) + p[f"h{i}.o.b"]

    def loss_fn(p, ids, targets):
        h = p["wte"][ids] + p["wpe"][:ids.shape[1]]
        for i in range(LAYERS):
            h = h + attention(ln(h, p, f"h{i}.ln1"), p, i)
            m = jax.nn.gelu(ln(h, p, f"h{i}.ln2") @ p[f"h{i}.fc.w"] + p[f"h{i}.fc.b"],
                            approximate=model.tanh_gelu)
            h = h + m @ p[f"h{i}.proj.w"] + p[f"h{i}.proj.b"]
        logits = ln(h, p, "lnf") @ p["head.w"]
        logp = jax.nn.log_softmax(logits + p["head.b"] if model.head_bias else logits)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

    tree = jax.tree_util.tree_map

    def update(p, state, grads):
        m, v, t = state
        t = t + 1
        m = tree(lambda a, g: 0.9 * a + 0.1 * g, m, grads)
        v = tree(lambda a, g: 0.999 * a + 0.001 * g * g, v, grads)
        lr_t = LR * jnp.sqrt(1 - 0.999 ** t) / (1 - 0.9 ** t)
        return tree(lambda w, a, b: w - lr_t * a / (jnp.sqrt(b) + 1e-7), p, m, v), (m, v, t)

    zeros = tree(jnp.zeros_like, params)
    n = args.devices
    run = jax_step(loss_fn, update, params, (zeros, zeros, jnp.float32(0)), x, y, n)
    losses = []
    r = time_steps(run, sync=lambda loss: losses.append(float(np.mean(loss))))
    report({"peer": f"JAX {'jit' if n == 1 else f'pmap x{n}'}", "devices": n,
            "optimizer": "adam", "losses": losses[:3],
            "parameters": parameter_count(a.shape for a in params.values()), **r})


if __name__ == "__main__":
    main()
