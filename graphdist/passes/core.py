"""What every pass shares: renaming Vars while rebuilding a graph, running a placed pass
inside control-flow bodies, and the pipeline runner."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from graphdist import flags
from graphdist.config import logger
from graphdist.ir import Graph, Var, check
from graphdist.ir.bodies import map_placed_bodies


def substitute(g: Graph, eqns: list, mapping: dict) -> Graph:
    """Rebuild `g` with `eqns`, renaming every Var through `mapping` (old -> new)."""
    def sub(v):
        return mapping.get(v, v) if isinstance(v, Var) else v

    new_eqns = tuple(replace(e, inputs=tuple(sub(v) for v in e.inputs)) if any(
        isinstance(v, Var) and v in mapping for v in e.inputs) else e for e in eqns)
    return replace(g, eqns=new_eqns, outputs=tuple(sub(v) for v in g.outputs))


def in_bodies(g: Graph, placed_pass) -> Graph:
    """`g` with `placed_pass` run on the bodies of its control-flow eqns (their eqns shown
    placed on the holder's device: ir/bodies.py map_placed_bodies); `g` itself when no body
    changes."""
    memos: dict = {}
    eqns = tuple(map_placed_bodies(e, placed_pass, memos) for e in g.eqns)
    return replace(g, eqns=eqns) if any(a is not b for a, b in zip(eqns, g.eqns)) else g


@dataclass(frozen=True)
class Stage:
    """The graph after one pass of the pipeline, under the name users ask for it by."""

    name: str
    graph: Graph
    seconds: float


def run_passes(g: Graph, passes, record: list | None = None) -> Graph:
    """Run `passes` in order; GRAPHDIST_CHECK=1 checks after each, GRAPHDIST_DEBUG>=2 prints
    each result, GRAPHDIST_DEBUG>=1 logs each pass's time. With `record`, a
    `Stage(name, graph, seconds)` is appended after each pass."""
    for p in passes:
        start = time.perf_counter()
        g = p(g)
        seconds = time.perf_counter() - start
        name = getattr(p, "__name__", str(p))
        if flags.CHECK:
            check(g, where=name)
        if flags.DEBUG >= 1:
            logger.debug("pass %s: %.1f ms, %d eqns", name, seconds * 1e3, len(g.eqns))
        if flags.DEBUG >= 2:
            print(f"--- after {name} ---\n{g}")
        if record is not None:
            record.append(Stage(name, g, seconds))
    return g
