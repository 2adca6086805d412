"""graphdist's MLP step in a fresh process, as the peers run: its first call (trace, compile
passes, Numba kernels from the on-disk cache, first step) next to theirs.

    python -m bench.peers.graphdist_mlp --devices 4 --optimizer adam
"""

from __future__ import annotations

import argparse


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--optimizer", default="adam")
    args = ap.parse_args()
    import graphdist as gd
    from bench.models import make_step
    from bench.peers.common import data, report, time_steps

    x, y = data()
    n = args.devices
    strategy = (gd.MirroredStrategy([f"cpu:{i}" for i in range(n)]) if n > 1
                else gd.OneDeviceStrategy("cpu:0"))
    step, _ = make_step(strategy, args.optimizer)
    batch = next(iter(strategy.experimental_distribute_dataset([(x, y)]))) if n > 1 else (x, y)
    r = time_steps(lambda: step(batch))
    report({"peer": f"graphdist {'1 device' if n == 1 else f'Mirrored x{n}'} (own process)",
            "devices": n, "optimizer": args.optimizer, **r})


if __name__ == "__main__":
    main()
