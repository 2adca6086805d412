"""What every pass shares: renaming Vars while rebuilding a graph, and the pipeline runner."""

from __future__ import annotations

from dataclasses import replace

from graphdist import flags
from graphdist.ir import Graph, Var, check


def substitute(g: Graph, eqns: list, mapping: dict) -> Graph:
    """Rebuild `g` with `eqns`, renaming every Var through `mapping` (old -> new)."""
    def sub(v):
        return mapping.get(v, v) if isinstance(v, Var) else v

    new_eqns = tuple(replace(e, inputs=tuple(sub(v) for v in e.inputs)) if any(
        isinstance(v, Var) and v in mapping for v in e.inputs) else e for e in eqns)
    return replace(g, eqns=new_eqns, outputs=tuple(sub(v) for v in g.outputs))


def run_passes(g: Graph, passes) -> Graph:
    """Run `passes` in order; GRAPHDIST_CHECK=1 checks after each, GRAPHDIST_DEBUG>=2 prints."""
    for p in passes:
        g = p(g)
        name = getattr(p, "__name__", str(p))
        if flags.CHECK:
            check(g, where=name)
        if flags.DEBUG >= 2:
            print(f"--- after {name} ---\n{g}")
    return g
