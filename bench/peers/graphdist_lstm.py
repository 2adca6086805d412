"""graphdist's LSTM training step (gd.nn.LSTM on gd.scan, SGD) in a fresh process, as the
peers run: its first call next to theirs.

    python -m bench.peers.graphdist_lstm --devices 4
"""

from __future__ import annotations

import argparse


def make_lstm_step(strategy):
    """(step, variables): one SGD step of the LSTM of bench/peers/common.py under
    `strategy`, from lstm_init's weights."""
    import graphdist as gd
    from bench.peers.common import LSTM_BATCH, LSTM_LR, LSTM_STEPS, LSTM_WIDTH, lstm_init

    with strategy.scope():
        layer = gd.nn.LSTM(LSTM_WIDTH)
        layer.build((LSTM_BATCH, LSTM_STEPS, LSTM_WIDTH))
        opt = gd.optimizers.SGD(LSTM_LR)
    weights = (layer.kernel, layer.recurrent_kernel, layer.bias)
    for v, value in zip(weights, lstm_init()):
        v.assign(value)

    @gd.function
    def step(batch):
        def replica_fn(x, y):
            with gd.GradientTape() as tape:
                loss = gd.reduce_sum((layer(x) - y) ** 2.0) / float(x.shape[0])
            opt.apply_gradients(zip(tape.gradient(loss, list(weights)), weights))
            return loss
        return strategy.reduce(gd.ReduceOp.MEAN, strategy.run(replica_fn, args=batch))

    return step, list(weights)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=1)
    args = ap.parse_args()
    from bench.models import own_process
    from bench.peers.common import lstm_data, report

    report(own_process(make_lstm_step, lstm_data(), args.devices, "sgd"))


if __name__ == "__main__":
    main()
