"""JAX: the GPT-2-style step (bench/peers/gpt_common.py GPT2_MODEL: fused qkv, the
additive -1e9 causal mask, jax.nn.gelu(approximate=True)) as jax_gpt.py builds it, with jit
on one device or pmap over N host devices.

    python -m bench.peers.jax_gpt2 --devices 4
"""

from __future__ import annotations

from bench.peers.gpt_common import GPT2_MODEL
from bench.peers.jax_gpt import main

if __name__ == "__main__":
    main(GPT2_MODEL)
