"""Common-subexpression elimination: eqns with the same op, inputs and params compute the
same value once. This is also what merges a vjp rule's recomputed forward values (exp(x),
tanh(x)...) with the forward pass's."""

from __future__ import annotations

from dataclasses import replace

from graphdist.ir import Graph, Lit
from graphdist.ir.bodies import map_bodies
from graphdist.ops.state import assign_p
from graphdist.passes.core import substitute


def _key_of(v, mapping):
    if isinstance(v, Lit):
        return ("lit", v.ty, repr(v.value))
    return mapping.get(v, v)


def eliminate_common_subexpressions(g: Graph) -> Graph:
    mapping: dict = {}
    seen: dict = {}
    kept = []
    memo: dict = {}
    changed = False
    for eqn in g.eqns:
        new = map_bodies(eqn, eliminate_common_subexpressions, memo)   # inside bodies
        changed = changed or new is not eqn
        eqn = new
        if eqn.op is assign_p:
            kept.append(eqn)
            continue
        key = (eqn.op.name, tuple(_key_of(v, mapping) for v in eqn.inputs), eqn.params,
               eqn.device)
        try:
            first = seen.get(key)
        except TypeError:  # an unhashable param: leave the eqn alone
            kept.append(eqn)
            continue
        if first is None:
            seen[key] = eqn
            kept.append(eqn)
        else:
            mapping.update(zip(eqn.outputs, first.outputs))
    if not mapping:
        return replace(g, eqns=tuple(kept)) if changed else g
    return substitute(g, kept, mapping)
