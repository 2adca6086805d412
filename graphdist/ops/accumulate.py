"""matmul_accumulate: c + a @ b as one op, so a GEMM can add its product into c as it writes
it (BLAS's beta=1) instead of writing the product out and adding it in a second pass.

Gradient accumulation is its user: passes/accumulate.py rewrites an accumulator's
`acc + x^T @ dy` (read, add, assign back) into this op, and the CPU kernel
(runtime/adapters/accumulate.py) updates the accumulator's storage in place with one
sgemm/dgemm. The op's own impl is the reference: the product, then the add.
"""

from __future__ import annotations

import numpy as np

from graphdist.errors import ShapeError
from graphdist.ir.types import ArrayType
from graphdist.ops.core import Op, require_float, same_dtype

# output 0 is input 0 updated in place where a kernel runs it (the accumulator's storage)
matmul_accumulate_p = Op("matmul_accumulate", differentiable=False, inplace={0: 0},
                         cost_kind="matmul")


@matmul_accumulate_p.def_shape
def _matmul_accumulate_shape(c, a, b):
    dtype = same_dtype("matmul_accumulate", c, a, b, names=("c", "a", "b"))
    require_float("matmul_accumulate", c)
    if c.ndim != 2 or a.ndim != 2 or b.ndim != 2:
        raise ShapeError(f"matmul_accumulate: needs 2-D operands, got c:{c} += a:{a} @ b:{b}")
    if a.shape[1] != b.shape[0] or c.shape != (a.shape[0], b.shape[1]):
        raise ShapeError(f"matmul_accumulate: shapes do not fit c += a @ b: c:{c} += "
                         f"a:{a} @ b:{b}")
    return ArrayType(c.shape, np.dtype(dtype))


matmul_accumulate_p.def_impl(lambda xp, c, a, b: xp.add(c, xp.matmul(a, b)))
# the product lands in a temporary before the add, so `out` may be c
matmul_accumulate_p.def_out(lambda xp, out, c, a, b: xp.add(c, xp.matmul(a, b), out=out),
                            may_alias=True)
matmul_accumulate_p.def_cost(lambda ins, outs, **_: (
    2 * outs[0].size * ins[1].shape[1] + outs[0].size,
    sum(t.nbytes for t in (*ins, *outs))))
