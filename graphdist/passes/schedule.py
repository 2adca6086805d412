"""Scheduling: the order eqns run in (trace order, which data allows), checked, with the
buffers' liveness recorded on the graph (ir/liveness.py)."""

from __future__ import annotations

from dataclasses import replace

from graphdist.errors import GraphError
from graphdist.ir import Graph, Var
from graphdist.ir.liveness import liveness


def schedule(g: Graph) -> Graph:
    """Order eqns topologically, keeping trace order where data allows (that order already
    keeps each variable's reads and writes in program order), and record liveness."""
    defined = set(g.inputs)
    for eqn in g.eqns:
        for v in eqn.inputs:
            if isinstance(v, Var) and v not in defined:
                raise GraphError(f"schedule: {v.hint or 'a value'} is used before it is defined"
                                 f"\n  in  {eqn}")
        defined.update(eqn.outputs)
    return replace(g, liveness=liveness(g))
