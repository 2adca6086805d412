"""What Model.fit costs over the hand-written loop on the CNN of examples/cnn_digits.py (the
digits, 1438 training rows, global batch 128: 12 steps an epoch, the last one of 30 rows),
on 1 and 4 logical CPU devices. One sample is one epoch:

- "hand loop": the guide's loop, written to be exact on the partial last batch as fit is: a
  gd.function around strategy.run, gd.nn.compute_average_loss over the global batch size
  with an optimizer made with gradient_reduction="sum", strategy.reduce(SUM) of the loss,
  over strategy.experimental_distribute_dataset of gd.data.batches(shuffle=True,
  drop_remainder=False);
- "fit": model.fit(x, y, batch_size=128, epochs=1, verbose=0) with no metrics: the loss
  reduction fit owns, the loss tracker (a sync-on-read Mean), its data order and callbacks;
- "fit + accuracy": the same with metrics=["accuracy"].

Timed interleaved (bench.common.interleaved); the ratio is median over median. On a
shared machine the epoch times drift by more than fit's cost, so each contender also
times its compiled step calls, and "outside the steps" (the epoch's time minus its step
calls: input splitting, the loop, fit's metrics reads and callbacks) is reported too.

    python -m bench.fit_overhead [--repeat 7] [--devices 1 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import graphdist as gd
from bench.common import interleaved, save, table
from graphdist.datasets import load_digits
from graphdist.examples.cnn_digits import images, make_model

BATCH = 128


def strategy_of(devices: int):
    return gd.OneDeviceStrategy("cpu:0") if devices == 1 else \
        gd.MirroredStrategy([f"cpu:{i}" for i in range(devices)])


def hand_loop(devices: int, x, y):
    strategy = strategy_of(devices)
    with strategy.scope():
        model = make_model(0)
        model(x[:1])
        opt = gd.optimizers.Adam(3e-3, gradient_reduction="sum")

    @gd.function
    def train_step(batch, global_batch_size):
        def replica_fn(images_, labels):
            with gd.GradientTape() as tape:
                logits = model(images_, training=True)
                loss = gd.nn.compute_average_loss(
                    gd.nn.sparse_softmax_cross_entropy(labels, logits), global_batch_size)
            variables = model.trainable_variables
            opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
            return loss

        return strategy.reduce(gd.ReduceOp.SUM, strategy.run(replica_fn, args=batch))

    epoch = [0]

    def one_epoch():
        data = gd.data.batches((x, y), BATCH, shuffle=True, seed=epoch[0],
                               drop_remainder=False)
        epoch[0] += 1
        rows = iter([min(BATCH, len(x) - start) for start in range(0, len(x), BATCH)])
        for batch in strategy.experimental_distribute_dataset(data):
            loss = timed(train_step, batch, next(rows))
        return float(loss)

    return one_epoch


_in_steps = [0.0]


def timed(fn, *args):
    start = time.perf_counter()
    try:
        return fn(*args)
    finally:
        _in_steps[0] += time.perf_counter() - start


def outside_steps(fn):
    """fn, also recording each call's time outside its compiled steps in `fn.outside`."""
    def run():
        _in_steps[0] = 0.0
        start = time.perf_counter()
        fn()
        run.outside.append(time.perf_counter() - start - _in_steps[0])

    run.outside = []
    return run


def fit_loop(devices: int, x, y, metrics):
    strategy = strategy_of(devices)
    with strategy.scope():
        model = make_model(0)
        model.compile(gd.optimizers.Adam(3e-3),
                      gd.losses.SparseCategoricalCrossentropy(from_logits=True), metrics)
    execute = model._execute

    def timed_execute(which, batches):        # the batch is pulled (split) outside the timing,
        batch = next(batches)                 # as the hand loop's is
        return timed(execute, which, iter([batch]))

    model._execute = timed_execute
    return lambda: model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 4])
    args = parser.parse_args(argv)
    x, y = load_digits("train")
    x = images(x)
    rows, results = [], {}
    for devices in args.devices:
        loops = {"hand loop": outside_steps(hand_loop(devices, x, y)),
                 "fit": outside_steps(fit_loop(devices, x, y, [])),
                 "fit + accuracy": outside_steps(fit_loop(devices, x, y, ["accuracy"]))}
        timings = interleaved(loops, repeat=args.repeat, warmup=2)
        base = timings["hand loop"]["median_s"]
        for name, t in timings.items():
            t["outside_steps_median_s"] = statistics.median(loops[name].outside[2:])
            rows.append([devices, name, f"{t['median_s'] * 1e3:.1f}", f"{t['min_s'] * 1e3:.1f}",
                         f"{t['median_s'] / base:.3f}",
                         f"{t['outside_steps_median_s'] * 1e3:.2f}"])
        results[str(devices)] = timings
    table("Model.fit vs the hand-written loop, CNN on the digits, one epoch (12 steps)",
          ["devices", "loop", "median ms", "min ms", "vs hand loop", "outside steps ms"], rows)
    save("fit_overhead", {"results": results, "repeat": args.repeat})
    return results


if __name__ == "__main__":
    main()
