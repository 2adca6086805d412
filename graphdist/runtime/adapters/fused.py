"""Kernel adapter of fused_elementwise on the CPU (ops/fused.py; the fuse_elementwise stage
makes the nodes): one generated Numba loop per cluster (kernels/fused_elementwise.py),
generated from the members' scalar formulas and compiled once per cluster text and operand
types; its numpy twin runs the members one after another on the forms the unfused program
runs (each member's own exact twin where it has a kernel entry, else its numpy impl).

Exact: every member's formula gives the bits of that member's kernel or ufunc (fastmath off,
the same float operations in the same order), so the twin gives the kernel's bits and a
program's first calls run the twin while the kernel compiles in the background
(runtime/warmup.py)."""

from __future__ import annotations

import numpy as np

from graphdist.ir import Lit
from graphdist.ops.fused import fused_elementwise_p  # noqa: F401 - registers the op
from graphdist.runtime.adapters.registry import ENTRIES, OP_IMPL, register_kernel

_plans: dict = {}      # (formula, operand types) -> _Plan


class _Plan:
    """A cluster's kernel as the generator needs it: its source, each input's kind (full,
    row, column, scalar), the row length, the literals' values, which member results it writes."""

    def __init__(self, body, ins, out_shape):
        from graphdist.kernels.fused_elementwise import COL, FULL, ROW, SCALAR, kernel_source

        out_shape = tuple(out_shape)
        n = int(np.prod(out_shape))
        self.kinds, self.cols = [], n
        for x in ins:
            if tuple(x.shape) == out_shape:
                self.kinds.append(FULL)
            elif x.size == 1:
                self.kinds.append(SCALAR)
            elif tuple(x.shape) == (*out_shape[:-1], 1):
                self.kinds.append(COL)
                self.cols = out_shape[-1]
            else:
                self.kinds.append(ROW)
                self.cols = x.size
        self.ok = n > 0 and n % self.cols == 0 and all(
            x.size == (self.cols if k == ROW else n // self.cols)
            for x, k in zip(ins, self.kinds) if k in (ROW, COL))
        refs = {v: ("x", j) for j, v in enumerate(body.inputs)}
        self.literals, steps = [], []
        for k, e in enumerate(body.eqns):
            args = []
            for v in e.inputs:
                if isinstance(v, Lit):
                    args.append(("k", len(self.literals)))
                    self.literals.append(np.asarray(v.value, v.ty.dtype)[()])
                else:
                    args.append(refs[v])
            refs[e.outputs[0]] = ("t", k)
            steps.append((e.op.name, dict(e.params), args, ("t", k)))
        self.source = kernel_source(steps, self.kinds, len(self.literals),
                                    [refs[v] for v in body.outputs],
                                    [e.outputs[0].ty.dtype.name for e in body.eqns])


def _plan(body, formula, ins, out_shape) -> _Plan:
    key = (formula, tuple((x.shape, x.dtype.str) for x in ins))
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = _Plan(body, ins, out_shape)
    return plan


def _flat_input(x):
    return np.ascontiguousarray(x).reshape(-1)


def _member_form(op):
    """How the unfused program runs member `op` on the CPU with its kernels' bits: the
    numpy twin of its exact kernel entry (OP_IMPL: its out_impl), else None (its impl)."""
    entry = ENTRIES.get(("cpu", op.name))
    if entry is None or not entry.exact or entry.out is None:
        return None
    if entry.numpy_out is OP_IMPL:
        return lambda out, *args, **params: op.out_impl(np, out, *args, **params)
    return entry.numpy_out


def fused_elementwise_numpy(out, *ins, body, formula, members):
    """The members one after another, each on the numpy form that gives its kernel's bits
    (the reference order), then the results copied into `out` (a tuple for several)."""
    env = dict(zip(body.inputs, ins))
    for e in body.eqns:
        args = [np.asarray(v.value, v.ty.dtype) if isinstance(v, Lit) else env[v]
                for v in e.inputs]
        params = dict(e.params)
        form = _member_form(e.op)
        ty = e.outputs[0].ty
        if form is not None:
            value = np.empty(ty.shape, ty.dtype)
            form(value, *args, **params)
        else:       # C order, as the buffers the unfused program writes members into
            value = np.ascontiguousarray(e.op.impl(np, *args, **params))
        env[e.outputs[0]] = value
    outs = out if isinstance(out, tuple) else (out,)
    for o, v in zip(outs, body.outputs):
        np.copyto(o, env[v], casting="unsafe")


@register_kernel("fused_elementwise", kind="cpu", out=True, numpy=fused_elementwise_numpy,
                 exact=True)
def fused_elementwise_cpu(out, *ins, body, formula, members):
    """The cluster's generated loop over the flattened output(s), parallel over rows; the
    numpy twin where the operands do not fit it (an output that is not C-contiguous, a
    strided input of a cluster with gelu)."""
    from graphdist.kernels.fused_elementwise import run

    outs = out if isinstance(out, tuple) else (out,)
    ins = [np.asarray(x) for x in ins]
    plan = _plan(body, formula, ins, outs[0].shape)
    # gelu's own kernel takes C-contiguous operands only (else the op's float64 reference
    # runs): with a strided input the twin gives the unfused program's bits
    strided = any(not x.flags.c_contiguous for x in ins) and any(
        m in ("gelu", "gelu_grad") for m in members)
    if strided or not plan.ok or not all(o.flags.c_contiguous for o in outs):
        fused_elementwise_numpy(out, *ins, body=body, formula=formula, members=members)
        return
    run(plan.source, plan.kinds, plan.cols, [_flat_input(x) for x in ins], plan.literals,
        [o.reshape(-1) for o in outs])
