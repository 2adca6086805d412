"""Dead-code elimination."""

from __future__ import annotations

from dataclasses import replace

from graphdist.ir import Graph, Var


def eliminate_dead_code(g: Graph) -> Graph:
    """Drop eqns none of whose outputs reach g.outputs (variable state included)."""
    live = {v for v in g.outputs if isinstance(v, Var)}
    kept = []
    for eqn in reversed(g.eqns):
        if any(v in live for v in eqn.outputs):
            kept.append(eqn)
            live.update(v for v in eqn.inputs if isinstance(v, Var))
    if len(kept) == len(g.eqns):
        return g
    return replace(g, eqns=tuple(reversed(kept)))
