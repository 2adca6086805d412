"""graphdist's GPT-2-style step (bench/models.py make_gpt2_step) in a fresh process, as the
peers run: its first call next to theirs.

    python -m bench.peers.graphdist_gpt2 --devices 4
"""

from __future__ import annotations

from bench.peers.gpt_common import GPT2_MODEL
from bench.peers.graphdist_gpt import main

if __name__ == "__main__":
    main(GPT2_MODEL, "make_gpt2_step")
