"""replicate: N logical graphs (one per device; they differ only where shard shapes differ)
become one placed graph. Each replica's eqns are cloned onto its device, and the k-th
collective of every replica becomes one multi-device collective, lowered right away by the
strategy's cross-device ops into the copies and adds that actually run."""

from __future__ import annotations

import numpy as np

from graphdist.errors import GraphError
from graphdist.ir import ArrayType, Graph, Lit, Var
from graphdist.ir.printer import Namer
from graphdist.passes.builder import Builder


def _segments(g: Graph):
    """Split g's eqns at its collectives: [(eqns before, collective), ..., (tail, None)]."""
    out, current = [], []
    for eqn in g.eqns:
        if eqn.op.collective:
            out.append((current, eqn))
            current = []
        else:
            current.append(eqn)
    out.append((current, None))
    return out


def replicate(graphs: list[Graph], devices: tuple, cross_device_ops) -> Graph:
    """Place graphs[d] on devices[d] and lower the collectives between them."""
    n = len(devices)
    if len(graphs) != n:
        raise GraphError(f"replicate: {len(graphs)} graphs for {n} devices")
    variables = graphs[0].variables
    for g in graphs[1:]:
        # by identity: Variable's == is the elementwise gd.equal
        if len(g.variables) != len(variables) or any(
                a is not b for a, b in zip(g.variables, variables)):
            raise GraphError("replicate: replicas captured different variables")
    maps = [dict() for _ in range(n)]

    def clone_var(d: int, v: Var, name: str) -> Var:
        new = Var(v.ty, name, devices[d])
        maps[d][v] = new
        return new

    names = [Namer() for _ in range(n)]
    inputs = [[clone_var(d, v, names[d](v)) for v in g.inputs[: g.num_args]]
              for d, g in enumerate(graphs)]
    states = [[clone_var(d, v, names[d](v)) for v in g.inputs[g.num_args:]]
              for d, g in enumerate(graphs)]
    b = Builder()
    segments = [_segments(g) for g in graphs]
    if len({len(s) for s in segments}) != 1:
        raise GraphError("replicate: replicas have different numbers of collectives; shard "
                         "shapes must not change which collectives a step runs")
    for k in range(len(segments[0])):
        for d in range(n):
            for eqn in segments[d][k][0]:
                _clone_eqn(b, d, eqn, maps[d], names[d], devices)
        colls = [segments[d][k][1] for d in range(n)]
        if colls[0] is not None:
            _lower_collective(b, colls, maps, devices, cross_device_ops, names)
    outputs = []
    for d, g in enumerate(graphs):
        outputs += [_mapped(maps[d], v) for v in g.outputs[: g.num_results]]
    finals = [[_mapped(maps[d], v) for v in g.outputs[g.num_results:]]
              for d, g in enumerate(graphs)]
    return Graph(inputs=tuple(v for per in inputs for v in per) +
                 tuple(v for per in states for v in per),
                 eqns=tuple(b.eqns),
                 outputs=tuple(outputs) + tuple(v for per in finals for v in per),
                 variables=tuple(variables) * n, devices=tuple(devices),
                 meta={"replicas": n, "args_per_replica": graphs[0].num_args,
                       "results_per_replica": graphs[0].num_results})


def _mapped(mapping: dict, v):
    return mapping.get(v, v) if isinstance(v, Var) else v


def _clone_eqn(b: Builder, d: int, eqn, mapping: dict, namer: Namer, devices) -> None:
    if eqn.op == "replica_id":
        mapping[eqn.outputs[0]] = Lit(np.int32(d), ArrayType((), np.dtype("int32")))
        return
    ins = [_mapped(mapping, v) for v in eqn.inputs]
    b.add(eqn.op, ins, devices[d], **dict(eqn.params))
    b.eqns[-1] = _with(b.eqns[-1], eqn, [namer(v) for v in eqn.outputs])
    for old, new in zip(eqn.outputs, b.eqns[-1].outputs):
        mapping[old] = new


def _with(new_eqn, old_eqn, hints):
    from dataclasses import replace

    outs = tuple(Var(v.ty, h, v.device) for v, h in zip(new_eqn.outputs, hints))
    return replace(new_eqn, outputs=outs, scope=old_eqn.scope, source=old_eqn.source)


def _lower_collective(b: Builder, colls, maps, devices, cross_device_ops, names) -> None:
    first = colls[0]
    for c in colls[1:]:
        if c is None or c.op is not first.op or c.params != first.params:
            raise GraphError(f"replicate: replicas disagree on a collective: {first} vs {c}")
    xs = [_mapped(maps[d], c.inputs[0]) for d, c in enumerate(colls)]
    for d, x in enumerate(xs[1:], start=1):
        if x.ty != xs[0].ty:   # a user error (e.g. per-example values of uneven shards)
            from graphdist.errors import ShapeError

            raise ShapeError(f"{first.op}: replicas disagree on the value's type: {xs[0].ty} "
                             f"on {devices[0]}, {x.ty} on {devices[d]}; reduce per-example "
                             "values first (e.g. strategy.reduce(op, value, axis=0))"
                             + (f"\n  traced at  {first.source}" if first.source else ""))
    params = dict(first.params)
    scope, b.scope = b.scope, "collectives"
    start = len(b.eqns)
    if first.op == "all_reduce":
        results = cross_device_ops.all_reduce(b, xs, params["op"], devices)
    elif first.op == "broadcast":
        results = cross_device_ops.broadcast(b, xs, params["source"], devices)
    else:
        raise GraphError(f"replicate: no lowering for collective '{first.op}'")
    b.scope = scope
    results = _name_lowering(b, start, results, [names[d](c.outputs[0])
                                                 for d, c in enumerate(colls)])
    for d, c in enumerate(colls):
        maps[d][c.outputs[0]] = results[d]


def _name_lowering(b: Builder, start: int, results: list, bases: list) -> list:
    """Name what a lowering made: each device's result takes the logical output's name (so
    the code after it reads alike on every device), temporaries `<name>.k`; otherwise the
    printer's letters for them would collide with the replicas' names."""
    from dataclasses import replace

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
