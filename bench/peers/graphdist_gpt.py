"""graphdist's GPT step (the example's own) in a fresh process, as the peers run: its first
call next to theirs. graphdist_gpt2.py runs the GPT-2-style step the same way.

    python -m bench.peers.graphdist_gpt --devices 4
"""

from __future__ import annotations

import argparse

from bench.peers.gpt_common import GPT_MODEL, Model


def main(model: Model = GPT_MODEL, make: str = "make_gpt_step") -> None:
    """Time bench/models.py's `make` (the step builder of `model`) in this process."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=1)
    args = ap.parse_args()
    from bench import models
    from bench.peers.common import report

    report(models.own_process(getattr(models, make), model.data(), args.devices))


if __name__ == "__main__":
    main()
