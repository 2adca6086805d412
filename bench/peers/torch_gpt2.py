"""PyTorch: the GPT-2-style step (bench/peers/gpt_common.py GPT2_MODEL: fused qkv, the
additive -1e9 causal mask, F.gelu(approximate="tanh")) as torch_gpt.py builds it, eager on
one CPU device; --profile for its time per op group.

    python -m bench.peers.torch_gpt2 [--profile]
"""

from __future__ import annotations

from bench.peers.gpt_common import GPT2_MODEL
from bench.peers.torch_gpt import main

if __name__ == "__main__":
    main(GPT2_MODEL)
