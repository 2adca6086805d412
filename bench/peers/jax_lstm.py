"""JAX: the LSTM training step (Keras's equations on lax.scan, SGD) under jit on one CPU
device, from the same weights.

    python -m bench.peers.jax_lstm
"""

from __future__ import annotations


def main() -> None:
    from bench.peers.common import (LSTM_LR, LSTM_WIDTH, lstm_data, lstm_init, one_device_args,
                                    report, timed_with_losses)

    one_device_args("jax_lstm")
    import jax
    import jax.numpy as jnp


    x, y = lstm_data()
    params = tuple(jnp.asarray(p) for p in lstm_init())
    w = LSTM_WIDTH

    def forward(params, x):
        kernel, recurrent, bias = params
        projected = jnp.einsum("btf,fk->tbk", x, kernel) + bias

        def cell(state, xw):
            h, c = state
            z = xw + h @ recurrent
            i, f = jax.nn.sigmoid(z[:, :w]), jax.nn.sigmoid(z[:, w:2 * w])
            g, o = jnp.tanh(z[:, 2 * w:3 * w]), jax.nn.sigmoid(z[:, 3 * w:])
            c = f * c + i * g
            h = o * jnp.tanh(c)
            return (h, c), None

        zeros = jnp.zeros((x.shape[0], w), x.dtype)
        (h, _), _ = jax.lax.scan(cell, (zeros, zeros), projected)
        return h

    def loss_fn(params, x, y):
        return jnp.sum((forward(params, x) - y) ** 2) / x.shape[0]

    @jax.jit
    def train(params, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        return tuple(p - LSTM_LR * g for p, g in zip(params, grads)), loss

    state = {"params": params}
    xs, ys = jnp.asarray(x), jnp.asarray(y)

    def step():
        state["params"], loss = train(state["params"], xs, ys)
        return loss

    report({"peer": "JAX jit (lax.scan)", "devices": 1, "optimizer": "sgd",
            **timed_with_losses(step)})


if __name__ == "__main__":
    main()
