"""Gradient accumulation fused into the gradient's last producer.

A micro-step adds each gradient to its accumulator: `acc := read(acc) + g`. When g is a
matmul's product (a weight gradient, x^T @ dy), that is a GEMM writing g out, then a pass
that reads acc and g and writes acc: for the benchmark MLP about 8% of the step. This pass
rewrites the pair into one `matmul_accumulate(read(acc), x^T, dy)` (ops/accumulate.py),
which the CPU kernel runs as one BLAS GEMM with beta=1 straight into the accumulator's
storage (the buffer planner donates the storage to an in-place op when the old value dies
there), so the micro-step costs what the step's compute alone does.

Only accumulators are rewritten (state whose StateRef.role is "accumulator"), and only
float32/float64 2-D products that nothing else reads: the fused GEMM rounds c + a @ b once
per block rather than twice, which is within float32 rounding of the unfused form but not
its bits, so ordinary user code (`v.assign(v + x @ y)`) keeps numpy's rounding. A bias
gradient (a column sum) and other producers keep their add: for the benchmark MLP they are
0.1% of the accumulated bytes.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from graphdist.ir import Eqn, Graph, Var
from graphdist.ops.accumulate import matmul_accumulate_p
from graphdist.ops.math import add_p, matmul_p
from graphdist.ops.state import assign_p, read_p
from graphdist.passes.fuse import stable_topological

ROLE = "accumulator"
DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def fuse_accumulate(g: Graph) -> Graph:
    """`assign(acc, read(acc) + matmul(a, b))` -> `assign(acc, matmul_accumulate(read(acc),
    a, b))` for every gradient accumulator whose added product nothing else reads. The
    fused eqn takes the matmul's place in the order (its accumulator read just before it),
    not the add's: the adds come after the whole backward pass, and the product's operands
    (the layer's activations) would otherwise live until then."""
    if not any(v.role == ROLE for v in g.variables):      # no accumulators: nothing to scan
        return g
    producer = {v: i for i, e in enumerate(g.eqns) for v in e.outputs}
    uses: dict = {}
    for v in (*(v for e in g.eqns for v in e.inputs), *g.outputs):
        if isinstance(v, Var):
            uses[v] = uses.get(v, 0) + 1
    order = {i: float(i) for i in range(len(g.eqns))}
    fused: dict = {}
    for eqn in g.eqns:
        if eqn.op is assign_p and eqn.attrs["var"].role == ROLE:
            found = _fusable(g, eqn, producer, uses)
            if found is None:
                continue
            add_at, matmul_at, read_at = found
            product = g.eqns[matmul_at]
            fused[matmul_at] = None
            fused[add_at] = Eqn(matmul_accumulate_p,
                                (g.eqns[read_at].outputs[0], *product.inputs),
                                g.eqns[add_at].outputs, device=g.eqns[add_at].device,
                                scope=g.eqns[add_at].scope,
                                source=product.source or g.eqns[add_at].source)
            order[add_at], order[read_at] = matmul_at, matmul_at - 0.5
    if not fused:
        return g
    eqns = [(order[i], fused.get(i, e)) for i, e in enumerate(g.eqns)
            if fused.get(i, e) is not None]
    return replace(g, eqns=tuple(stable_topological(eqns, g.inputs)))


def _fusable(g: Graph, assign: Eqn, producer: dict, uses: dict):
    """(index of the add, of the matmul, of the accumulator's read) when `assign` writes
    read(acc) + a 2-D float product that only this add reads, else None."""
    add_at = producer.get(assign.inputs[1])
    if add_at is None or g.eqns[add_at].op is not add_p:
        return None
    ref = assign.attrs["var"]
    x, y = g.eqns[add_at].inputs
    for old, grad in ((x, y), (y, x)):
        read_at = producer.get(old) if isinstance(old, Var) else None
        if read_at is None or not (g.eqns[read_at].op is read_p
                                   and g.eqns[read_at].attrs["var"] == ref):
            continue
        matmul_at = producer.get(grad) if isinstance(grad, Var) else None
        if matmul_at is None:
            return None
        product = g.eqns[matmul_at]
        if (product.op is matmul_p and uses.get(grad) == 1 and uses.get(old) == 1
                and grad.ty == old.ty and grad.ty.ndim == 2 and grad.ty.dtype in DTYPES
                and all(v.ty.ndim == 2 for v in product.inputs)):
            return add_at, matmul_at, read_at
        return None
    return None
