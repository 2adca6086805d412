"""JAX: the tutorial CNN step with jit (one device) or pmap over N host devices (Adam).

    python -m bench.peers.jax_cnn --devices 4
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

    from bench.peers.common import LR, cnn_data, cnn_init, jax_step, report, time_steps

    x, y = cnn_data()
    params = [jnp.asarray(p) for p in cnn_init()]
    dims = ("NHWC", "HWIO", "NHWC")

    def pool(h):
        return jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1),
                                     "VALID")

    def loss_fn(params, h, y):
        k1, b1, k2, b2, w3, b3, w4, b4 = params
        h = pool(jax.nn.relu(jax.lax.conv_general_dilated(h, k1, (1, 1), "VALID",
                                                          dimension_numbers=dims) + b1))
        h = pool(jax.nn.relu(jax.lax.conv_general_dilated(h, k2, (1, 1), "VALID",
                                                          dimension_numbers=dims) + b2))
        h = h.reshape(h.shape[0], -1)
        h = jax.nn.relu(h @ w3 + b3) @ w4 + b4
        logp = jax.nn.log_softmax(h)
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))

    def update(params, state, grads):
        m, v, t = state
        t = t + 1
        m = [0.9 * a + 0.1 * g for a, g in zip(m, grads)]
        v = [0.999 * a + 0.001 * g * g for a, g in zip(v, grads)]
        lr_t = LR * jnp.sqrt(1 - 0.999 ** t) / (1 - 0.9 ** t)
        return [p - lr_t * a / (jnp.sqrt(b) + 1e-7) for p, a, b in zip(params, m, v)], (m, v, t)

    zeros = [jnp.zeros_like(p) for p in params]
    state = (zeros, zeros, jnp.float32(0))
    n = args.devices
    run = jax_step(loss_fn, update, params, state, x, y, n)
    losses = []                         # float() waits for the step, as block_until_ready
    r = time_steps(run, sync=lambda loss: losses.append(float(jnp.mean(loss))))
    report({"peer": f"JAX {'jit' if n == 1 else f'pmap x{n}'}", "devices": n,
            "optimizer": "adam", "losses": losses[:3], **r})


if __name__ == "__main__":
    main()
