"""check(g): the single source of truth for a graph's validity."""

from __future__ import annotations

from graphdist.errors import GraphError
from graphdist.ir.graph import Graph, Lit, Var


def check(g: Graph, where: str = "") -> Graph:
    """Raise GraphError unless every Var is bound once, defined before use, typed by its
    op's shape rule, and (once placed) read only on its own device or by a collective."""
    ctx = f"after pass '{where}': " if where else ""
    defined = set()
    for v in g.inputs:
        if v in defined:
            raise GraphError(f"{ctx}input {v.hint or v} is bound twice")
        defined.add(v)
    for eqn in g.eqns:
        for v in eqn.inputs:
            if isinstance(v, Var) and v not in defined:
                raise GraphError(f"{ctx}{v.hint or 'a value'} is used before it is defined\n"
                                 f"  in  {eqn}")
            if not isinstance(v, (Var, Lit)):
                raise GraphError(f"{ctx}input {v!r} is neither Var nor Lit\n  in  {eqn}")
        expected = eqn.op.out_types(*(v.ty for v in eqn.inputs), **dict(eqn.params))
        got = tuple(v.ty for v in eqn.outputs)
        if expected != got:
            raise GraphError(f"{ctx}{eqn.op} outputs {got}, its shape rule says {expected}\n"
                             f"  in  {eqn}")
        if eqn.device is not None and not eqn.op.collective:
            for v in eqn.inputs:
                if isinstance(v, Var) and v.device not in (None, eqn.device):
                    raise GraphError(f"{ctx}{v.hint or 'a value'} is read on {eqn.device} but "
                                     f"lives on {v.device}\n  in  {eqn}")
        for v in eqn.outputs:
            if v in defined:
                raise GraphError(f"{ctx}{v.hint or 'a value'} is bound twice\n  in  {eqn}")
            defined.add(v)
    for v in g.outputs:
        if isinstance(v, Var) and v not in defined:
            raise GraphError(f"{ctx}output {v.hint or v} is never defined")
    return g
