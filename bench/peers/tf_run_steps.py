"""TensorFlow: the digits MLP (64-256-256-10) as a Keras Sequential under MirroredStrategy
over 4 logical CPU devices, trained by `model.fit` with `steps_per_execution=N` (N steps
per call of the compiled train function, TF's in-graph loop), global batch 128, Adam 1e-3.

After a warm-up fit (tracing and compiling excluded), fits of `--steps` steps run until
`--samples` samples are in: a callback notes the time at the end of every execution (Keras
calls it once per N steps), and a sample is the time of 50 steps between two such notes, so
`median_s` / `min_s` are per step in the steady state, without fit's fixed cost per call
(graphdist's samples are 50 steps too); `fit_median_s` is per step over whole fits.

    python -m bench.peers.tf_run_steps --steps-per-execution 50
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--steps-per-execution", type=int, default=50)
    ap.add_argument("--steps", type=int, default=500, help="steps per timed fit")
    ap.add_argument("--samples", type=int, default=30)
    args = ap.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import tensorflow as tf

    from bench.peers.common import LR, digits, init, report, tf_strategy

    n, spe = args.devices, args.steps_per_execution
    strategy = tf_strategy(n)
    x, y = digits()
    dataset = (tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=0)
               .batch(128, drop_remainder=True).repeat().prefetch(tf.data.AUTOTUNE))
    with strategy.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, "relu"),
                                  keras.layers.Dense(256, "relu"), keras.layers.Dense(10)])
        model.set_weights(init(0, (64, 256, 256, 10)))
        model.compile(optimizer=keras.optimizers.Adam(LR, epsilon=1e-7),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      steps_per_execution=spe)

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            ends.append(time.perf_counter())

    def fit(steps: int) -> float:
        t0 = time.perf_counter()
        model.fit(dataset, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=[Clock()])
        return time.perf_counter() - t0

    ends, block = [], 50 // spe                    # executions per 50-step sample
    fit(args.steps)                                 # warm-up: traces and compiles
    per_step, whole = [], []
    while len(per_step) < args.samples:
        ends = []
        whole.append(fit(args.steps) / args.steps)
        marks = ends[::block]
        per_step += [(b - a) / 50 for a, b in itertools.pairwise(marks)]
    per_step = per_step[:args.samples]
    report({"peer": f"TF Keras fit, MirroredStrategy x{n}, steps_per_execution={spe}",
            "devices": n, "steps_per_execution": spe, "steps_per_fit": args.steps,
            "median_s": statistics.median(per_step), "min_s": min(per_step),
            "fit_median_s": statistics.median(whole), "fit_min_s": min(whole),
            "samples": len(per_step), "fits": len(whole)})


if __name__ == "__main__":
    main()
