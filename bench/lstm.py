"""An LSTM (batch 32, sequence 64, width 128) with gd.nn.LSTM on gd.scan: the forward pass
against a hand-written numpy loop of Keras's equations, and the training step (forward,
backward, SGD; loss sum((h_T - y)^2) / batch) against TensorFlow (keras LSTM in a
tf.function; MirroredStrategy x4), JAX (Keras's equations on lax.scan, jit) and PyTorch
(nn.LSTM, eager), each in a fresh process from the same weights and batch
(bench/peers/*_lstm.py; their losses are printed beside the times), graphdist on 1 and 4
logical devices. The run drops the environment's OpenBLAS pin, as on a user's machine.

    python -m bench.lstm [--no-peers] [--rounds 3]

The backward body's matmuls write into the program's buffers (`np.matmul(a, b.T, out=)`,
transposed operands included). An earlier note said that form ran ~12x slower than without
`out=`; on numpy 2.4.6 it does not: the same calls, shapes and strides timed alone take the
same time with and without `out=`, and the whole training step with matmul's `out=` forms
disabled (fresh arrays) is no faster (17.3 vs 17.0 ms on 1 device, 27.0 vs 26.6 ms on 4
replicas, interleaved in one process). numpy >= 2.0 hands transposed and strided operands to
BLAS (numpy PR 23752), so nothing in the lowering needs changing for it.
"""

import argparse
import sys
import time

import numpy as np

import graphdist as gd
from bench.common import (add_peer_arguments, fresh_process_rows, save, table, unpinned_rerun,
                          versus_best_peer, versus_text)

BATCH, STEPS, WIDTH = 32, 64, 128


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def lstm_numpy(x, kernel, recurrent, bias):
    units = recurrent.shape[0]
    h = c = np.zeros((x.shape[0], units), x.dtype)
    batch, steps, features = x.shape
    projected = (x.transpose(1, 0, 2).reshape(-1, features) @ kernel).reshape(
        steps, batch, -1) + bias
    for t in range(x.shape[1]):
        z = projected[t] + h @ recurrent
        i, f, g, o = np.split(z, 4, axis=1)
        c = sigmoid(f) * c + sigmoid(i) * np.tanh(g)
        h = sigmoid(o) * np.tanh(c)
    return h


def best(fn, *args, repeat=7):
    fn(*args)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return min(times)


def train_step(devices, x, y, seed=None):
    """A training step of gd.nn.LSTM; `seed` fixes its initial weights."""
    strategy = gd.MirroredStrategy(devices)
    with strategy.scope():
        if seed is not None:
            gd.random.set_global_generator(gd.random.Generator.from_seed(seed))
        layer = gd.nn.LSTM(WIDTH)
        opt = gd.optimizers.SGD(0.01)

    def replica_step(xb, yb):
        with gd.GradientTape() as tape:
            loss = gd.reduce_sum((layer(xb) - yb) ** 2.0) / float(xb.shape[0])
        grads = tape.gradient(loss, layer.trainable_variables)
        opt.apply_gradients(zip(grads, layer.trainable_variables))
        return loss

    @gd.function
    def step(xb, yb):
        return strategy.run(replica_step, args=(xb, yb))

    n = len(devices)
    if n == 1:
        return lambda: step(x, y)
    xs = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.array_split(x, n)[ctx.replica_id_in_sync_group])
    ys = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.array_split(y, n)[ctx.replica_id_in_sync_group])
    return lambda: step(xs, ys)


PEERS = [("bench.peers.jax_lstm", 1), ("bench.peers.tf_lstm", 1),
         ("bench.peers.torch_lstm", 1), ("bench.peers.tf_lstm", 4)]
ROWS = {"LSTM training step": {1: "graphdist 1 device (own process)",
                               4: "graphdist Mirrored x4 (own process)"}}


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser()
    add_peer_arguments(ap)
    args = ap.parse_args(argv)
    if unpinned_rerun("bench.lstm", argv):
        return {}
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, STEPS, WIDTH)).astype(np.float32)
    layer = gd.nn.LSTM(WIDTH)
    forward = gd.function(lambda x: layer(x))
    got = forward(x)
    weights = [v.numpy() for v in (layer.kernel, layer.recurrent_kernel, layer.bias)]
    np.testing.assert_allclose(got, lstm_numpy(x, *weights), rtol=1e-4, atol=1e-5)
    t_gd, t_np = best(forward, x), best(lstm_numpy, x, *weights)
    head = (f"forward  gd.nn.LSTM {t_gd * 1e3:6.2f} ms   numpy loop {t_np * 1e3:6.2f} ms   "
            f"ratio {t_gd / t_np:.2f}x")
    print(head)
    entry = fresh_process_rows("bench.peers.graphdist_lstm", PEERS, 1.0, args.no_peers,
                               args.rounds)
    base = entry.get(ROWS["LSTM training step"][1], {}).get("median_s")
    for r in entry.values():          # fresh_process_rows divided by 1.0: by the 1-device row
        if base and "median_s" in r:
            r["vs_graphdist_1"] = r["median_s"] / base
    rows = []
    for name, r in entry.items():
        if "status" in r:
            rows.append([name, r["status"], "", "", "", ""])
            continue
        losses = r.get("losses") or []
        rows.append([name, r["median_s"] * 1e3, r["min_s"] * 1e3, r.get("vs_graphdist_1", ""),
                     f"{r.get('first_call_s') or 0:.2f}",
                     " ".join(f"{v:.5f}" for v in losses[:3])])
    text = table(f"LSTM training step, batch {BATCH}, {STEPS} steps, width {WIDTH}, SGD, "
                 f"fresh processes ({args.rounds} rounds; median of medians)",
                 ["contender", "median ms", "min ms", "vs graphdist 1 dev", "first call s",
                  "losses 1-3"], rows)
    print(text)
    targets = versus_best_peer(entry, ROWS)
    if targets:
        print(versus_text(targets))
        text += "\n" + versus_text(targets)
    save("lstm", {"results": entry, "versus_best_peer": targets,
                  "forward_ms": {"graphdist": t_gd * 1e3, "numpy loop": t_np * 1e3},
                  "openblas_pin": "dropped (OPENBLAS_CORETYPE, OPENBLAS_L2_SIZE unset)",
                  "table": head + "\n\n" + text})
    return entry


def plot(payload):
    """ms per training step of every contender (graphdist's rows outlined)."""
    from bench.plots import bars, figure, rows_height, timings

    medians, mins = timings(payload.get("results", {}))
    fig, axes = figure(f"LSTM training step, batch {BATCH}, {STEPS} steps, width {WIDTH}, SGD",
                       width=8, height=rows_height(len(medians)))
    bars(axes[0], medians, "ms per step (bar: median, |: min)", mins=mins,
         highlight=list(ROWS["LSTM training step"].values()))
    return fig


if __name__ == "__main__":
    main()
