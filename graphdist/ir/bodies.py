"""Sub-graphs held in an eqn's params (the branches and bodies of control flow): finding
them and rebuilding an eqn with each one rewritten, which is how passes recurse into them.
A body's eqns are unplaced (they run on the device of the eqn holding them):
`map_placed_bodies` shows them placed to a pass that decides by device."""

from __future__ import annotations

from dataclasses import replace

from graphdist.ir.graph import Eqn, Graph


def bodies(eqn: Eqn) -> tuple:
    """The sub-graphs `eqn` holds, in param order (none for ordinary ops)."""
    out = []
    for _, value in eqn.params:
        if isinstance(value, Graph):
            out.append(value)
        elif isinstance(value, tuple) and value and all(isinstance(x, Graph) for x in value):
            out.extend(value)
    return tuple(out)


def map_bodies(eqn: Eqn, fn, memo: dict) -> Eqn:
    """`eqn` with every sub-graph g replaced by fn(g) (the same eqn when none changes).
    `memo` (one per pass run) maps each body to its rewrite, so eqns that shared a body
    (replicas, a vjp's recomputation) still share one and CSE can merge them."""
    if not any(isinstance(v, (Graph, tuple)) for _, v in eqn.params):
        return eqn

    def rewrite(g: Graph) -> Graph:
        if g not in memo:
            memo[g] = fn(g)
        return memo[g]

    params, changed = [], False
    for key, value in eqn.params:
        if isinstance(value, Graph):
            new = rewrite(value)
        elif isinstance(value, tuple) and value and all(isinstance(x, Graph) for x in value):
            new = tuple(rewrite(x) for x in value)
        else:
            new = value
        changed = changed or new is not value and new != value
        params.append((key, new))
    return replace(eqn, params=tuple(params)) if changed else eqn


def map_placed_bodies(eqn: Eqn, fn, memos: dict) -> Eqn:
    """map_bodies for a pass that decides by each eqn's device: fn sees every unplaced eqn
    of a body placed on `eqn`'s device, and its result comes back unplaced there (a body
    runs on its holder's device). `memos` (one per pass run) keeps a memo per device."""
    device = eqn.device

    def placed_fn(g: Graph) -> Graph:
        placed = _placed(g, lambda d: d or device)
        out = fn(placed)
        return g if out is placed else _placed(out, lambda d: None if d == device else d)

    return map_bodies(eqn, placed_fn, memos.setdefault(device, {}))


def _placed(g: Graph, where) -> Graph:
    eqns = tuple(e if where(e.device) == e.device else replace(e, device=where(e.device))
                 for e in g.eqns)
    return replace(g, eqns=eqns) if any(a is not b for a, b in zip(eqns, g.eqns)) else g
