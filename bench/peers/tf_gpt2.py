"""TensorFlow: the GPT-2-style step (bench/peers/gpt_common.py GPT2_MODEL: fused qkv, the
additive -1e9 causal mask, tanh GELU) as tf_gpt.py builds it, on one device or
MirroredStrategy over N logical CPU devices.

    python -m bench.peers.tf_gpt2 --devices 4
"""

from __future__ import annotations

from bench.peers.gpt_common import GPT2_MODEL
from bench.peers.tf_gpt import main

if __name__ == "__main__":
    main(GPT2_MODEL)
