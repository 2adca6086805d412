"""Kernel adapters of gradient accumulation's fused form on the CPU: matmul_accumulate
(ops/accumulate.py) updates the accumulator in place with one BLAS GEMM, beta=1
(kernels/gemm.py), instead of a product into a temporary and a read-add-write pass.

Not `exact`: the GEMM adds c to its product's blocks as it writes them, so the bits are
within float32 rounding of the op's own impl (the product, then the add), not equal to
them; the numpy twin (fused kernels off) is that impl, in place.
"""

from __future__ import annotations

import numpy as np

from graphdist.runtime.adapters.registry import register_kernel


def matmul_accumulate_numpy(c, a, b):
    """c += a @ b as numpy computes it: the product into a temporary, then the add."""
    np.add(c, np.matmul(a, b), out=c)


@register_kernel("matmul_accumulate", kind="cpu", numpy=matmul_accumulate_numpy)
def matmul_accumulate_cpu(c, a, b):
    """c += a @ b in place: one sgemm/dgemm with beta=1 (numpy's product and add where the
    BLAS numpy links has no such symbol, or for other dtypes)."""
    from graphdist.kernels.gemm import gemm_accumulate

    gemm_accumulate(c, a, b)
