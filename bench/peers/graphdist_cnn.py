"""graphdist's tutorial CNN step in a fresh process, as the peers run: its first call next
to theirs.

    python -m bench.peers.graphdist_cnn --devices 4
"""

from __future__ import annotations

import argparse


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=1)
    args = ap.parse_args()
    from bench.models import make_cnn_step, own_process
    from bench.peers.common import cnn_data, report

    report(own_process(make_cnn_step, cnn_data(), args.devices, "adam"))


if __name__ == "__main__":
    main()
