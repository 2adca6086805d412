"""Common-subexpression elimination: eqns with the same op, inputs and params compute the
same value once. This is also what merges a vjp rule's recomputed forward values (exp(x),
tanh(x)...) with the forward pass's."""

from __future__ import annotations

from graphdist.ir import Graph, Lit
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
    for eqn in g.eqns:
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
        return g
    return substitute(g, kept, mapping)
