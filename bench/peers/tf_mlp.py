"""TensorFlow: the MLP step as a tf.function, on one device or MirroredStrategy over N
logical CPU devices. Keras's optimizer sums the replicas' gradients, so each replica's loss
is divided by N (the tf.distribute convention, as tf_gpt.py): the mean gradient, as the
other contenders (undivided, SGD with momentum took 4x steps on 4 replicas: loss 2.818
after one step against everyone else's 2.689).

    python -m bench.peers.tf_mlp --devices 4 --optimizer adam
"""

from __future__ import annotations

import argparse
import os


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--optimizer", default="adam")
    ap.add_argument("--cross-device-ops", default="reduction_to_one_device")
    args = ap.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    from bench.peers.common import LR, data, init, report, tf_strategy, tf_time_replica_fn

    n = args.devices
    strategy = tf_strategy(n, args.cross_device_ops)
    x, y = data()
    with strategy.scope():
        params = [tf.Variable(p) for p in init()]
        opt = (tf.keras.optimizers.Adam(LR, epsilon=1e-7) if args.optimizer == "adam"
               else tf.keras.optimizers.SGD(0.01, momentum=0.9))
        opt.build(params)

    def replica_fn(xb, yb):
        with tf.GradientTape() as tape:
            h = xb
            for i in range(0, len(params), 2):
                h = h @ params[i] + params[i + 1]
                if i + 2 < len(params):
                    h = tf.nn.relu(h)
            loss = tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(labels=yb, logits=h)) / n
        grads = tape.gradient(loss, params)
        opt.apply_gradients(zip(grads, params))
        return loss

    r = tf_time_replica_fn(strategy, replica_fn, x, y, "SUM")     # each loss is over n
    name = f"TF {'tf.function' if n == 1 else f'MirroredStrategy x{n} ({args.cross_device_ops})'}"
    report({"peer": name, "devices": n, "optimizer": args.optimizer, **r})


if __name__ == "__main__":
    main()
