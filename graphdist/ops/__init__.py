"""The op registry: every op's rules in one block each (see docs/adding_an_op.md)."""

from graphdist.ops import (array, collectives, control_flow, conv, division, logic,  # noqa: F401
                           math, nn, optim, pool, random, state)  # (each registers its ops)
from graphdist.ops import (device_collectives, host_collectives,  # noqa: F401  (fused collectives)
                           mpi_collectives, zero_collectives)
from graphdist.ops import (attention, construct, einsum, layer_norm, softmax,  # noqa: F401
                           special)  # (transformer blocks)
from graphdist.ops import accumulate  # noqa: F401  (gradient accumulation's fused GEMM)
from graphdist.ops import epilogue  # noqa: F401  (fused matmul/conv epilogues, passes/epilogue.py)
from graphdist.ops.core import OPS, Op, Symbolic, bind

__all__ = ["OPS", "Op", "Symbolic", "bind", "array", "collectives", "math", "nn", "optim",
           "state"]
