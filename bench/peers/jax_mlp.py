"""JAX: the MLP step with jit (one device) or pmap over N host devices.

    python -m bench.peers.jax_mlp --devices 4 --optimizer adam
"""

from __future__ import annotations

import argparse
import os


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--optimizer", default="adam")
    args = ap.parse_args()
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    import jax
    import jax.numpy as jnp

    from bench.peers.common import LR, data, init, jax_step, report, time_steps

    x, y = data()
    params = [jnp.asarray(p) for p in init()]

    def loss_fn(params, x, y):
        h = x
        for i in range(0, len(params), 2):
            h = h @ params[i] + params[i + 1]
            if i + 2 < len(params):
                h = jax.nn.relu(h)
        logp = jax.nn.log_softmax(h)
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))

    def update(params, state, grads):
        if args.optimizer == "adam":
            m, v, t = state
            t = t + 1
            m = [0.9 * a + 0.1 * g for a, g in zip(m, grads)]
            v = [0.999 * a + 0.001 * g * g for a, g in zip(v, grads)]
            lr_t = LR * jnp.sqrt(1 - 0.999 ** t) / (1 - 0.9 ** t)
            params = [p - lr_t * a / (jnp.sqrt(b) + 1e-7) for p, a, b in zip(params, m, v)]
            return params, (m, v, t)
        (m,) = state
        m = [0.9 * a + g for a, g in zip(m, grads)]
        return [p - 0.01 * a for p, a in zip(params, m)], (m,)

    zeros = [jnp.zeros_like(p) for p in params]
    state = (zeros, zeros, jnp.float32(0)) if args.optimizer == "adam" else (zeros,)
    n = args.devices
    run = jax_step(loss_fn, update, params, state, x, y, n)
    r = time_steps(run, sync=lambda loss: loss.block_until_ready())
    report({"peer": f"JAX {'jit' if n == 1 else f'pmap x{n}'}", "devices": n,
            "optimizer": args.optimizer, **r})


if __name__ == "__main__":
    main()
