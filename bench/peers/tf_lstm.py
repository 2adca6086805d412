"""TensorFlow: the LSTM training step (tf.keras.layers.LSTM, SGD) as a tf.function, on one
device or MirroredStrategy over N logical CPU devices, from the same weights. Keras's
optimizer sums the replicas' gradients, so each replica's loss is over the global batch.

    python -m bench.peers.tf_lstm --devices 4
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

    from bench.peers.common import (LSTM_BATCH, LSTM_LR, LSTM_STEPS, LSTM_WIDTH, lstm_data,
                                    lstm_init, report, tf_strategy, tf_time_replica_fn)

    n = args.devices
    strategy = tf_strategy(n)
    x, y = lstm_data()
    with strategy.scope():
        layer = tf.keras.layers.LSTM(LSTM_WIDTH)
        layer.build((LSTM_BATCH // n, LSTM_STEPS, LSTM_WIDTH))
        layer.set_weights(list(lstm_init()))
        opt = tf.keras.optimizers.SGD(LSTM_LR)
        opt.build(layer.trainable_variables)

    def replica_fn(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum((layer(xb) - yb) ** 2) / LSTM_BATCH
        opt.apply_gradients(zip(tape.gradient(loss, layer.trainable_variables),
                                layer.trainable_variables))
        return loss

    r = tf_time_replica_fn(strategy, replica_fn, x, y, "SUM")
    name = "TF tf.function (keras LSTM)" if n == 1 else \
        f"TF MirroredStrategy x{n} (keras LSTM)"
    report({"peer": name, "devices": n, "optimizer": "sgd", **r})


if __name__ == "__main__":
    main()
