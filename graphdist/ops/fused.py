"""fused_elementwise: a cluster of elementwise ops run as one node (the fuse_elementwise
stage, passes/fuse_elementwise.py, makes it; no user code binds it).

    fused_elementwise[body=B, formula=F, members=(op, ...)]  *inputs -> *outputs

`body` holds the members as a sub-graph (docs/ir.md, "Sub-graphs"): its inputs are the
cluster's inputs (arrays of the output's shape, bias rows broadcast along the leading axes,
scalars), its outputs the member values read outside the cluster. So the text form, the
HTML viewer (a group that opens), networkx and the summary show the node with its members.
`formula` is the members' wiring as text (`t0=mul(x0,x1) t1=add(t0,x2) -> t1`, printed as a
short hash of it): the key the CPU kernel is generated and cached under
(runtime/adapters/fused.py), which also makes each cluster's kernel call distinct for the
warm-up. `members` names the member ops in order (what
the summary lists for every fused node).

The impl runs the members one after another on their numpy impls (the reference
interpreter); the CPU's generated kernel and its numpy twin are the runtime's.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from graphdist.errors import ShapeError
from graphdist.ir import Var, evaluate
from graphdist.ops.control_flow import graph_cost
from graphdist.ops.core import Op

fused_elementwise_p = Op("fused_elementwise", num_outputs=None, differentiable=False,
                         foldable=False)


@dataclass(frozen=True)
class Formula:
    """A cluster's wiring as text (`describe`), compared and hashed by it. The text form
    shows a short hash of it (nodes with the same one run the same kernel): the members
    themselves are printed under the node."""

    text: str

    def __str__(self) -> str:
        return self.text

    def param_text(self) -> str:
        return "#" + hashlib.sha1(self.text.encode()).hexdigest()[:8]


def describe(body) -> Formula:
    """`formula`: each member as `t<k>=op[params](refs)` (x<j>: body input j, t<k>: member
    k's result, literals by value and dtype), then `-> ` the outputs. Two clusters with the
    same text compute the same function of their inputs."""
    names = {v: f"x{j}" for j, v in enumerate(body.inputs)}
    parts = []
    for k, e in enumerate(body.eqns):
        refs = ",".join(names[v] if isinstance(v, Var) else f"{v}:{v.ty.dtype}"
                        for v in e.inputs)
        params = ",".join(f"{key}={value}" for key, value in e.params)
        parts.append(f"t{k}={e.op}{f'[{params}]' if params else ''}({refs})")
        names[e.outputs[0]] = f"t{k}"
    outs = ",".join(names[v] if isinstance(v, Var) else str(v) for v in body.outputs)
    return Formula(" ".join(parts) + f" -> {outs}")


@fused_elementwise_p.def_shape
def _fused_shape(*ins, body, formula, members):
    expected = tuple(v.ty for v in body.inputs)
    if ins != expected:
        raise ShapeError(f"fused_elementwise: its members take {expected}, got {ins}")
    return tuple(v.ty for v in body.outputs)


@fused_elementwise_p.def_impl
def _fused_impl(xp, *ins, body, formula, members):
    return evaluate(body, *ins)


@fused_elementwise_p.def_out
def _fused_out(xp, out, *ins, body, formula, members):
    """The members' results written into `out` (a tuple for several outputs). Never given an
    input's buffer: the members run one after another."""
    outs = out if isinstance(out, tuple) else (out,)
    for o, value in zip(outs, evaluate(body, *ins)):
        xp.copyto(o, value, casting="unsafe")


@fused_elementwise_p.def_cost
def _fused_cost(ins, outs, *, body, formula, members):
    """The members' FLOPs; the bytes of the cluster's inputs and outputs only (what fusion
    saves is the members' intermediate traffic)."""
    flops, _ = graph_cost(body)
    return flops, sum(t.nbytes for t in (*ins, *outs))

