"""Liveness: where each buffer is last used, and the peak bytes live. Views (reshape,
transpose, read_var...) share their input's buffer, so a buffer lives until the last use of
any of its views. Computed by the schedule pass and by the runtime for each program."""

from __future__ import annotations

from dataclasses import dataclass

from graphdist.ir.graph import Graph, Var


@dataclass(frozen=True)
class Liveness:
    root: dict        # Var -> the Var whose buffer it aliases (itself if it owns one)
    last_use: dict    # root Var -> index of the last eqn using it (len(eqns) = graph output)
    peak_bytes: int   # most bytes of eqn-made buffers alive at once


def liveness(g: Graph) -> Liveness:
    root: dict = {}
    for v in g.inputs:
        root[v] = v
    for eqn in g.eqns:
        for v in eqn.outputs:
            a = eqn.op.alias_input
            root[v] = root[eqn.inputs[a]] if a is not None and isinstance(
                eqn.inputs[a], Var) else v
    last_use: dict = {}
    for i, eqn in enumerate(g.eqns):
        ins = eqn.inputs[1:] if eqn.op.overwrites_state else eqn.inputs  # state in: order only
        for v in ins:
            if isinstance(v, Var):
                last_use[root[v]] = i
    end = len(g.eqns)
    for v in g.outputs:
        if isinstance(v, Var):
            last_use[root[v]] = end
    return Liveness(root, last_use, _peak(g, root, last_use))


def _peak(g: Graph, root: dict, last_use: dict) -> int:
    dying: dict = {}
    for r, i in last_use.items():
        dying.setdefault(i, []).append(r)
    live = peak = 0
    for i, eqn in enumerate(g.eqns):
        for v in eqn.outputs:
            if root[v] is v:
                live += v.ty.nbytes
        peak = max(peak, live)
        live -= sum(r.ty.nbytes for r in dying.get(i, ()) if r not in g.inputs)
    return peak
