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
    from bench.models import make_step, own_process
    from bench.peers.common import data, report

    report(own_process(lambda strategy: make_step(strategy, args.optimizer), data(),
                       args.devices, args.optimizer))


if __name__ == "__main__":
    main()
