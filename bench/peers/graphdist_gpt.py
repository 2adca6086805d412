"""graphdist's GPT step (the example's own) in a fresh process, as the peers run: its first
call next to theirs.

    python -m bench.peers.graphdist_gpt --devices 4
"""

from __future__ import annotations

import argparse


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=1)
    args = ap.parse_args()
    import graphdist as gd
    from bench.models import make_gpt_step
    from bench.peers.common import report, time_steps
    from bench.peers.gpt_common import gpt_data

    x, y = gpt_data()
    n = args.devices
    strategy = (gd.MirroredStrategy([f"cpu:{i}" for i in range(n)]) if n > 1
                else gd.OneDeviceStrategy("cpu:0"))
    step, _ = make_gpt_step(strategy)
    batch = next(iter(strategy.experimental_distribute_dataset([(x, y)]))) if n > 1 else (x, y)
    losses = []
    r = time_steps(lambda: step(batch), sync=lambda loss: losses.append(float(loss)))
    report({"peer": f"graphdist {'1 device' if n == 1 else f'Mirrored x{n}'} (own process)",
            "devices": n, "optimizer": "adam", "losses": losses[:3], **r})


if __name__ == "__main__":
    main()
