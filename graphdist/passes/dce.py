"""Dead-code elimination, inside branch and loop bodies too: a loop whose per-iteration
history (what reverse mode reads) nobody reads stops keeping it, and a scan stops stacking
the ys nobody reads."""

from __future__ import annotations

from dataclasses import replace

from graphdist.ir import Graph, Var
from graphdist.ir.bodies import map_bodies
from graphdist.ops.control_flow import scan_p, while_p


def eliminate_dead_code(g: Graph) -> Graph:
    """Drop eqns none of whose outputs reach g.outputs (variable state included)."""
    live = {v for v in g.outputs if isinstance(v, Var)}
    kept = []
    memo: dict = {}
    changed = False
    for eqn in reversed(g.eqns):
        if any(v in live for v in eqn.outputs):
            new = map_bodies(_without_dead_ys(_without_history(eqn, live), live),
                             eliminate_dead_code, memo)
            changed = changed or new is not eqn
            kept.append(new)
            live.update(v for v in new.inputs if isinstance(v, Var))
    if len(kept) == len(g.eqns) and not changed:
        return g
    return replace(g, eqns=tuple(reversed(kept)))


def _without_dead_ys(eqn, live: set):
    """A scan without the stacked ys nobody reads (its body stops computing them)."""
    if eqn.op is not scan_p:
        return eqn
    params = dict(eqn.params)
    body, n = params["body"], params["num_carry"]
    n_y = len(body.outputs) - n
    dead = [k for k in range(n_y) if eqn.outputs[n + k] not in live]
    if not dead:
        return eqn
    keep = [k for k in range(n_y) if k not in dead]
    params["body"] = body.replace(outputs=body.outputs[:n] + tuple(body.outputs[n + k]
                                                                    for k in keep))
    outputs = (eqn.outputs[:n] + tuple(eqn.outputs[n + k] for k in keep)
               + eqn.outputs[n + n_y:])
    return replace(eqn, outputs=outputs, params=tuple(sorted(params.items())))


def _without_history(eqn, live: set):
    """A scan or while_loop whose history outputs are all dead, without them."""
    params = dict(eqn.params)
    if eqn.op not in (scan_p, while_p) or not params["history"]:
        return eqn
    n = params["num_carry"]
    first = len(eqn.outputs) - n - (1 if eqn.op is while_p else 0)
    if any(v in live for v in eqn.outputs[first:]):
        return eqn
    params["history"] = False
    return replace(eqn, outputs=eqn.outputs[:first], params=tuple(sorted(params.items())))
