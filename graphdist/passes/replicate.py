"""replicate: N logical graphs (one per device; they differ only where shard shapes differ)
become one placed graph. Each replica's eqns are cloned onto its device, and the k-th
collective of every replica becomes one N-way node (one input and one output per device);
the next stage, passes/collectives/, lowers it into what runs."""

from __future__ import annotations

import numpy as np

from graphdist.errors import GraphError, ShapeError
from graphdist.ir import COLLECTIVES_SCOPE, ArrayType, Eqn, Graph, Lit, Replication, Var
from graphdist.ir.printer import Namer
from graphdist.ir.builder import Builder
from graphdist.ops.collectives import replica_id_p
from graphdist.passes.lockstep import join_loop, runs_in_lockstep


def _segments(g: Graph):
    """Split g's eqns at its collectives: [(eqns before, collective), ..., (tail, None)]."""
    out, current = [], []
    for eqn in g.eqns:
        if eqn.op.collective or runs_in_lockstep(eqn):
            out.append((current, eqn))
            current = []
        else:
            current.append(eqn)
    out.append((current, None))
    return out


def replicate(graphs: list[Graph], devices: tuple, first: int = 0) -> Graph:
    """Place graphs[d] on devices[d], joined by one N-way node per collective. `first`: the
    global id of devices[0]'s replica (other replicas live in other worker processes)."""
    n = len(devices)
    if len(graphs) != n:
        raise GraphError(f"replicate: {len(graphs)} graphs for {n} devices")
    variables = graphs[0].variables
    for g in graphs[1:]:
        if g.variables != variables:
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
                _clone_eqn(b, d, eqn, maps[d], names[d], devices, first)
        colls = [segments[d][k][1] for d in range(n)]
        if colls[0] is not None and not colls[0].op.collective:    # a loop holding one
            join_loop(b, colls, maps, devices, names, first, replicate)
        elif colls[0] is not None:
            _join_collective(b, colls, maps, devices, names)
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
                 replication=Replication(n, graphs[0].num_args, graphs[0].num_results))


def _mapped(mapping: dict, v):
    return mapping.get(v, v) if isinstance(v, Var) else v


def _clone_eqn(b: Builder, d: int, eqn, mapping: dict, namer: Namer, devices,
               first: int = 0) -> None:
    if eqn.op is replica_id_p:
        mapping[eqn.outputs[0]] = Lit(np.int32(first + d), ArrayType((), np.dtype("int32")))
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


def _join_collective(b: Builder, colls, maps, devices, names) -> None:
    """The k-th collective of every replica as one N-way node on the first device."""
    first = colls[0]
    for c in colls[1:]:
        if c is None or c.op is not first.op or c.params != first.params:
            raise GraphError(f"replicate: replicas disagree on a collective: {first} vs {c}")
    xs = [_mapped(maps[d], c.inputs[0]) for d, c in enumerate(colls)]
    for d, x in enumerate(xs[1:], start=1):
        if x.ty != xs[0].ty:   # a user error (e.g. per-example values of uneven shards)
            raise ShapeError(f"{first.op}: replicas disagree on the value's type: {xs[0].ty} "
                             f"on {devices[0]}, {x.ty} on {devices[d]}; reduce per-example "
                             "values first (e.g. strategy.reduce(op, value, axis=0))"
                             + (f"\n  traced at  {first.source}" if first.source else ""))
    outs = tuple(Var(c.outputs[0].ty, names[d](c.outputs[0]), devices[d])
                 for d, c in enumerate(colls))
    b.eqns.append(Eqn(first.op, tuple(xs), outs, first.params, device=devices[0],
                      scope=COLLECTIVES_SCOPE, source=first.source))
    for d, c in enumerate(colls):
        maps[d][c.outputs[0]] = outs[d]
