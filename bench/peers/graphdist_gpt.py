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
    from bench.models import make_gpt_step, own_process
    from bench.peers.common import report
    from bench.peers.gpt_common import gpt_data

    report(own_process(make_gpt_step, gpt_data(), args.devices))


if __name__ == "__main__":
    main()
