"""TensorFlow: the tutorial CNN step as a tf.function, on one device or MirroredStrategy over
N logical CPU devices (Adam). Keras's optimizer sums the replicas' gradients, so each
replica's loss is divided by N (the tf.distribute convention, as tf_gpt.py): the mean
gradient, as the other contenders (undivided, 4 replicas' losses differed from one
device's by 2.5e-3 after one step: Adam's epsilon meets 4x the gradient).

    python -m bench.peers.tf_cnn --devices 4
"""

from __future__ import annotations

import argparse
import os


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=1)
    args = ap.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    from bench.peers.common import LR, cnn_data, cnn_init, report, tf_strategy, tf_time_replica_fn

    n = args.devices
    strategy = tf_strategy(n)
    x, y = cnn_data()
    with strategy.scope():
        params = [tf.Variable(p) for p in cnn_init()]
        opt = tf.keras.optimizers.Adam(LR, epsilon=1e-7)
        opt.build(params)

    def forward(h):
        k1, b1, k2, b2, w3, b3, w4, b4 = params
        h = tf.nn.relu(tf.nn.conv2d(h, k1, 1, "VALID") + b1)
        h = tf.nn.max_pool2d(h, 2, 2, "VALID")
        h = tf.nn.relu(tf.nn.conv2d(h, k2, 1, "VALID") + b2)
        h = tf.nn.max_pool2d(h, 2, 2, "VALID")
        h = tf.reshape(h, (tf.shape(h)[0], -1))
        h = tf.nn.relu(h @ w3 + b3)
        return h @ w4 + b4

    def replica_fn(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=yb, logits=forward(xb))) / n
        opt.apply_gradients(zip(tape.gradient(loss, params), params))
        return loss

    r = tf_time_replica_fn(strategy, replica_fn, x, y, "SUM")     # each loss is over n
    name = "TF tf.function" if n == 1 else f"TF MirroredStrategy x{n} (reduction_to_one_device)"
    report({"peer": name, "devices": n, "optimizer": "adam", **r})


if __name__ == "__main__":
    main()
