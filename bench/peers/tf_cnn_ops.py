"""TensorFlow: each op of the tutorial CNN's training step alone, at the step's shapes
(global batch 256, one device), so graphdist's per-op profile has the peer's next to it.

    python -m bench.peers.tf_cnn_ops
"""

from __future__ import annotations

import os


def main() -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import numpy as np
    import tensorflow as tf

    from bench.peers.common import CNN_BATCH, report

    rng = np.random.default_rng(0)

    def t(*shape):
        return tf.constant(rng.random(shape, dtype=np.float32))

    n = CNN_BATCH
    x1, k1, y1 = t(n, 28, 28, 1), t(3, 3, 1, 32), t(n, 26, 26, 32)
    p1, x2, k2, y2 = t(n, 13, 13, 32), t(n, 13, 13, 32), t(3, 3, 32, 64), t(n, 11, 11, 64)
    p2 = t(n, 5, 5, 64)
    raw = tf.raw_ops
    pool = dict(ksize=[1, 2, 2, 1], strides=[1, 2, 2, 1], padding="VALID")
    conv = dict(strides=[1, 1, 1, 1], padding="VALID")
    ops = {   # graphdist's op name -> the TF ops doing its work in the step
        "conv2d": lambda: (tf.nn.conv2d(x1, k1, 1, "VALID"), tf.nn.conv2d(x2, k2, 1, "VALID")),
        "conv2d_backprop_filter": lambda: (
            raw.Conv2DBackpropFilter(input=x1, filter_sizes=[3, 3, 1, 32], out_backprop=y1,
                                     **conv),
            raw.Conv2DBackpropFilter(input=x2, filter_sizes=[3, 3, 32, 64], out_backprop=y2,
                                     **conv)),
        "conv2d_backprop_input": lambda: raw.Conv2DBackpropInput(
            input_sizes=[n, 13, 13, 32], filter=k2, out_backprop=y2, **conv),
        "max_pool2d": lambda: (raw.MaxPool(input=y1, **pool), raw.MaxPool(input=y2, **pool)),
        "max_pool2d_grad": lambda: (
            raw.MaxPoolGrad(orig_input=y1, orig_output=p1, grad=p1, **pool),
            raw.MaxPoolGrad(orig_input=y2, orig_output=p2, grad=p2, **pool)),
        "relu and its gradient": lambda: (tf.nn.relu(y1), tf.nn.relu(y2),
                                          raw.ReluGrad(gradients=y1, features=y1),
                                          raw.ReluGrad(gradients=y2, features=y2)),
        "bias add and its gradient": lambda: (tf.nn.bias_add(y1, k1[0, 0, 0]),
                                              tf.nn.bias_add(y2, k2[0, 0, 0]),
                                              raw.BiasAddGrad(out_backprop=y1),
                                              raw.BiasAddGrad(out_backprop=y2)),
    }
    result = {}
    for name, fn in ops.items():
        f = tf.function(fn)
        f()
        samples = []
        for _ in range(20):
            t0 = __import__("time").perf_counter()
            out = f()
            [o.numpy() for o in (out if isinstance(out, tuple) else (out,))]
            samples.append(__import__("time").perf_counter() - t0)
        result[name] = sorted(samples)[len(samples) // 2]
    report({"peer": "TF ops", "ops_s": result})


if __name__ == "__main__":
    main()
