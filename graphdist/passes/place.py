"""Placing a one-replica graph on one device (the replication pass does many devices)."""

from __future__ import annotations

from dataclasses import replace

from graphdist.ir import Graph, Var
from graphdist.passes.core import substitute


def place(g: Graph, device: str) -> Graph:
    """Give every Var and eqn of `g` the device `device`."""
    mapping = {v: Var(v.ty, v.hint, device) for v in g.inputs}
    eqns = []
    for eqn in g.eqns:
        outs = tuple(Var(v.ty, v.hint, device) for v in eqn.outputs)
        mapping.update(zip(eqn.outputs, outs))
        eqns.append(replace(eqn, outputs=outs, device=device))
    placed = substitute(replace(g, inputs=tuple(mapping[v] for v in g.inputs)), eqns, mapping)
    return replace(placed, devices=(device,))
