"""Every lowering of a collective, in one place.

The replication pass leaves each collective of the step as one N-way node (one input and
one output per device). `lower_collectives` turns each into what runs, with the lowering
the strategy's cross-device ops configure (`CrossDeviceOps.lowering`, a name in the
registry, plus its options): registry.py holds the `Lowering` base class and `LOWERINGS`;
lowerings.py the six lowerings (one_device, ring, hierarchical, host, nccl, mpi), each
giving all four collectives (all_reduce, reduce_scatter, all_gather, broadcast) and their
cost (costs.py, the formulas the simulator prices a step with); blocks.py the copies,
ordered adds and views they are built of. A new lowering is one class in lowerings.py (or
anywhere, registered with `@register`) and its CrossDeviceOps.
"""

from __future__ import annotations

from dataclasses import replace

from graphdist.ir import COLLECTIVES_SCOPE, Graph, Var
from graphdist.ir.bodies import map_bodies
from graphdist.ir.builder import Builder
from graphdist.ops.collectives import all_gather_p, all_reduce_p, broadcast_p, reduce_scatter_p
from graphdist.passes.collectives import lowerings  # noqa: F401  (registers the six)
from graphdist.passes.collectives.blocks import (copy_to, finish_mean, groups_of, near_equal,
                                                 sum_in_order)
from graphdist.passes.collectives.registry import (COLLECTIVES, LOWERINGS, Lowering, Pricing,
                                                   lowering_for, register)

__all__ = ["COLLECTIVES", "LOWERINGS", "Lowering", "Pricing", "copy_to", "finish_mean",
           "groups_of", "lower_all_reduce", "lower_collectives", "lowering_for", "near_equal",
           "register", "sum_in_order"]


def lower_collectives(g: Graph, cross_device_ops) -> Graph:
    """Replace every N-way collective node of a replicated graph by its lowering."""
    memo: dict = {}      # a loop run in lock step holds N-way nodes in its body too
    eqns = tuple(map_bodies(e, lambda body: lower_collectives(body, cross_device_ops), memo)
                 for e in g.eqns)
    if any(new is not old for new, old in zip(eqns, g.eqns)):
        g = g.replace(eqns=eqns)
    if not any(e.op in _EMIT for e in g.eqns):
        return g
    lowering = lowering_for(cross_device_ops)
    b = Builder()
    rename: dict = {}

    def sub(v):
        return rename.get(v, v) if isinstance(v, Var) else v

    for eqn in g.eqns:
        ins = tuple(sub(v) for v in eqn.inputs)
        emit = _EMIT.get(eqn.op)
        if emit is None:
            b.eqns.append(replace(eqn, inputs=ins) if ins != eqn.inputs else eqn)
            continue
        start = len(b.eqns)
        b.scope = COLLECTIVES_SCOPE
        devices = tuple(v.device for v in eqn.outputs)
        results = emit(lowering, b, list(ins), devices, dict(eqn.params))
        b.scope = ""
        results = _name_lowering(b, start, results, [v.hint for v in eqn.outputs])
        for i in range(start, len(b.eqns)):    # what it lowers to keeps the user's line
            if not b.eqns[i].source:
                b.eqns[i] = replace(b.eqns[i], source=eqn.source)
        rename.update(zip(eqn.outputs, results))
    return replace(g, eqns=tuple(b.eqns), outputs=tuple(sub(v) for v in g.outputs))


# each N-way collective node, by its op, as the lowering's method for it
_EMIT = {
    all_reduce_p: lambda low, b, xs, devices, p: low.all_reduce(b, xs, p["op"], devices),
    reduce_scatter_p: lambda low, b, xs, devices, p: low.reduce_scatter(b, xs, p["op"],
                                                                        devices, p["n"]),
    all_gather_p: lambda low, b, xs, devices, p: low.all_gather(b, xs, devices, p["n"],
                                                                p.get("total")),
    broadcast_p: lambda low, b, xs, devices, p: low.broadcast(b, xs, p["source"], devices),
}


def lower_all_reduce(cross_device_ops, b: Builder, xs: list, op: str, devices: tuple) -> list:
    """Emit into `b` the all-reduce of `xs` (one Var per device) that `cross_device_ops`
    configures; returns the result on every device."""
    return lowering_for(cross_device_ops).all_reduce(b, list(xs), op, tuple(devices))


def _name_lowering(b: Builder, start: int, results: list, bases: list) -> list:
    """Name what a lowering made: each device's result takes the N-way node's output name
    (so the code after it reads alike on every device), temporaries `<name>.k`; otherwise
    the printer's letters for them would collide with the replicas' names."""
    final = {r: base for r, base in zip(results, bases)}
    rename, k = {}, 0
    for i in range(start, len(b.eqns)):
        eqn = b.eqns[i]
        outs = []
        for v in eqn.outputs:
            if v.hint is None:
                hint = final.get(v)
                if hint is None:
                    hint, k = f"{bases[0]}.{k}", k + 1
                rename[v] = Var(v.ty, hint, v.device)
            outs.append(rename.get(v, v))
        b.eqns[i] = replace(eqn, inputs=tuple(rename.get(v, v) if isinstance(v, Var) else v
                                              for v in eqn.inputs), outputs=tuple(outs))
    return [rename.get(r, r) for r in results]
