"""TensorFlow: the benchmark GPT step as a tf.function, on one device or MirroredStrategy over
N logical CPU devices (Keras Adam), in plain tf ops: matmuls, tf.where + tf.nn.softmax for
the causal attention, tf.nn.moments layer norm, tf.nn.gelu(approximate=False).

Keras's optimizer sums the replicas' gradients, so each replica's loss is divided by N (the
tf.distribute convention): the same mean gradient as the other contenders. The embedding's
gradient (tf.IndexedSlices, one slice per token) is made dense first: Keras's Adam squares
the slices before summing repeated rows, which is not Adam's update (losses differ ~2e-3
after one step).

    python -m bench.peers.tf_gpt --devices 4
"""

from __future__ import annotations

import argparse
import math
import os


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=1)
    args = ap.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    from bench.peers.common import LR, report, tf_strategy, tf_time_replica_fn
    from bench.peers.gpt_common import HEADS, KEY_DIM, LAYERS, LN_EPS, WIDTH, gpt_data, gpt_init

    n = args.devices
    strategy = tf_strategy(n)
    x, y = gpt_data()
    with strategy.scope():
        p = {k: tf.Variable(v, name=k.replace(".", "_")) for k, v in gpt_init().items()}
        opt = tf.keras.optimizers.Adam(LR, epsilon=1e-7)
        opt.build(list(p.values()))
    H, K = HEADS, KEY_DIM

    def ln(h, name):
        mean, var = tf.nn.moments(h, axes=[-1], keepdims=True)
        return (h - mean) * tf.math.rsqrt(var + LN_EPS) * p[f"{name}.g"] + p[f"{name}.b"]

    def attention(h, i):
        B, T = tf.shape(h)[0], h.shape[1]

        def heads(name):                # (B, T, D) -> (B, H, T, K)
            w, b = tf.reshape(p[f"{name}.w"], (WIDTH, H * K)), tf.reshape(p[f"{name}.b"], [-1])
            return tf.transpose(tf.reshape(h @ w + b, (B, T, H, K)), (0, 2, 1, 3))

        q, k, v = (heads(f"h{i}.{n}") for n in "qkv")
        scores = tf.matmul(q * (1 / math.sqrt(K)), k, transpose_b=True)
        causal = tf.linalg.band_part(tf.ones((T, T), tf.bool), -1, 0)
        probs = tf.nn.softmax(tf.where(causal, scores, float("-inf")), axis=-1)
        out = tf.reshape(tf.transpose(probs @ v, (0, 2, 1, 3)), (B, T, H * K))
        return out @ tf.reshape(p[f"h{i}.o.w"], (H * K, WIDTH)) + p[f"h{i}.o.b"]

    def forward(ids):
        h = tf.gather(p["wte"], ids) + p["wpe"][:ids.shape[1]]
        for i in range(LAYERS):
            h = h + attention(ln(h, f"h{i}.ln1"), i)
            m = tf.nn.gelu(ln(h, f"h{i}.ln2") @ p[f"h{i}.fc.w"] + p[f"h{i}.fc.b"],
                           approximate=False)
            h = h + m @ p[f"h{i}.proj.w"] + p[f"h{i}.proj.b"]
        return ln(h, "lnf") @ p["head.w"] + p["head.b"]

    def replica_fn(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=yb, logits=forward(xb))) / n
        variables = list(p.values())
        grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, variables)]
        opt.apply_gradients(zip(grads, variables))
        return loss

    r = tf_time_replica_fn(strategy, replica_fn, x, y, "SUM")     # each loss is over n
    name = "TF tf.function" if n == 1 else f"TF MirroredStrategy x{n} (reduction_to_one_device)"
    report({"peer": name, "devices": n, "optimizer": "adam", **r})


if __name__ == "__main__":
    main()
