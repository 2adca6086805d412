"""TensorFlow: a benchmark GPT step (bench/peers/gpt_common.py: the GPT by default, the
GPT-2-style step from tf_gpt2.py) as a tf.function, on one device or MirroredStrategy over N
logical CPU devices (Keras Adam), in plain tf ops: matmuls, tf.nn.softmax over the causal
scores (tf.where for the GPT, the additive mask for the GPT-2-style step), tf.nn.moments
layer norm, tf.nn.gelu in the model's form.

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

from bench.peers.gpt_common import GPT_MODEL, Model


def main(model: Model = GPT_MODEL) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=1)
    args = ap.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    from bench.peers.common import LR, report, tf_strategy, tf_time_replica_fn
    from bench.peers.gpt_common import (HEADS, KEY_DIM, LAYERS, LN_EPS, WIDTH,
                                        additive_causal_mask, parameter_count)

    n = args.devices
    strategy = tf_strategy(n)
    x, y = model.data()
    with strategy.scope():
        p = {k: tf.Variable(v, name=k.replace(".", "_")) for k, v in model.init().items()}
        opt = tf.keras.optimizers.Adam(LR, epsilon=1e-7)
        opt.build(list(p.values()))
    H, K = HEADS, KEY_DIM
    mask = tf.constant(additive_causal_mask(x.shape[1]))

    def ln(h, name):
        mean, var = tf.nn.moments(h, axes=[-1], keepdims=True)
        return (h - mean) * tf.math.rsqrt(var + LN_EPS) * p[f"{name}.g"] + p[f"{name}.b"]

    def qkv(h, i):                      # (B, T, D) -> three (B, T, H * K)
        if model.fused_qkv:
            return tf.split(h @ p[f"h{i}.qkv.w"] + p[f"h{i}.qkv.b"], 3, axis=-1)
        return [h @ tf.reshape(p[f"h{i}.{n}.w"], (WIDTH, H * K)) +
                tf.reshape(p[f"h{i}.{n}.b"], [-1]) for n in "qkv"]

    def attention(h, i):
        B, T = tf.shape(h)[0], h.shape[1]
        q, k, v = (tf.transpose(tf.reshape(z, (B, T, H, K)), (0, 2, 1, 3)) for z in qkv(h, i))
        if model.additive_mask:
            scores = tf.matmul(q, k, transpose_b=True) * (1 / math.sqrt(K)) + mask
        else:
            causal = tf.linalg.band_part(tf.ones((T, T), tf.bool), -1, 0)
            scores = tf.where(causal, tf.matmul(q * (1 / math.sqrt(K)), k, transpose_b=True),
                              float("-inf"))
        probs = tf.nn.softmax(scores, axis=-1)
        out = tf.reshape(tf.transpose(probs @ v, (0, 2, 1, 3)), (B, T, H * K))
        return out @ tf.reshape(p[f"h{i}.o.w"], (H * K, WIDTH)) + p[f"h{i}.o.b"]

    def forward(ids):
        h = tf.gather(p["wte"], ids) + p["wpe"][:ids.shape[1]]
        for i in range(LAYERS):
            h = h + attention(ln(h, f"h{i}.ln1"), i)
            m = tf.nn.gelu(ln(h, f"h{i}.ln2") @ p[f"h{i}.fc.w"] + p[f"h{i}.fc.b"],
                           approximate=model.tanh_gelu)
            h = h + m @ p[f"h{i}.proj.w"] + p[f"h{i}.proj.b"]
        logits = ln(h, "lnf") @ p["head.w"]
        return logits + p["head.b"] if model.head_bias else logits

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
    report({"peer": name, "devices": n, "optimizer": "adam",
            "parameters": parameter_count(v.shape for v in p.values()), **r})


if __name__ == "__main__":
    main()
