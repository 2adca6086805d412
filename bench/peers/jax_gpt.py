"""JAX: the benchmark GPT step with jit (one device) or pmap over N host devices (Adam), in
plain jax.numpy: matmuls and einsums, jnp.where + jax.nn.softmax for the causal attention,
layer norm from mean and variance, jax.nn.gelu(approximate=False).

    python -m bench.peers.jax_gpt --devices 4
"""

from __future__ import annotations

import argparse
import os


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=1)
    args = ap.parse_args()
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    import jax
    import jax.numpy as jnp
    import numpy as np

    from bench.peers.common import LR, jax_step, report, time_steps
    from bench.peers.gpt_common import HEADS, KEY_DIM, LAYERS, LN_EPS, WIDTH, gpt_data, gpt_init

    x, y = gpt_data()
    params = {k: jnp.asarray(v) for k, v in gpt_init().items()}
    H, K = HEADS, KEY_DIM

    def ln(h, p, name):
        mean = h.mean(-1, keepdims=True)
        var = jnp.square(h - mean).mean(-1, keepdims=True)
        return (h - mean) * jax.lax.rsqrt(var + LN_EPS) * p[f"{name}.g"] + p[f"{name}.b"]

    def attention(h, p, i):
        B, T, _ = h.shape
        q, k, v = ((h @ p[f"h{i}.{n}.w"].reshape(WIDTH, H * K) + p[f"h{i}.{n}.b"].reshape(-1))
                   .reshape(B, T, H, K) for n in "qkv")
        scores = jnp.einsum("bthk,bshk->bhts", q * (1 / np.sqrt(K)), k)
        causal = jnp.tril(jnp.ones((T, T), bool))
        probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        out = jnp.einsum("bhts,bshk->bthk", probs, v).reshape(B, T, H * K)
        return out @ p[f"h{i}.o.w"].reshape(H * K, WIDTH) + p[f"h{i}.o.b"]

    def loss_fn(p, ids, targets):
        h = p["wte"][ids] + p["wpe"][:ids.shape[1]]
        for i in range(LAYERS):
            h = h + attention(ln(h, p, f"h{i}.ln1"), p, i)
            m = jax.nn.gelu(ln(h, p, f"h{i}.ln2") @ p[f"h{i}.fc.w"] + p[f"h{i}.fc.b"],
                            approximate=False)
            h = h + m @ p[f"h{i}.proj.w"] + p[f"h{i}.proj.b"]
        logp = jax.nn.log_softmax(ln(h, p, "lnf") @ p["head.w"] + p["head.b"])
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
            "optimizer": "adam", "losses": losses[:3], **r})


if __name__ == "__main__":
    main()
