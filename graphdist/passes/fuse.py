"""fuse_optimizer: a device's per-variable optimizer updates that share an op, its
hyper-parameters, shared scalars (lr_t) and dtype become one multi-tensor eqn, so one
kernel launch updates every parameter (and the placed graph and profile show it so)."""

from __future__ import annotations

import heapq
from dataclasses import replace

from graphdist.ir import Eqn, Graph, Lit, Var
from graphdist.ops import OPS


def _multi_forms() -> dict:
    return {op.multi.single.name: op.multi for op in OPS.values() if hasattr(op, "multi")}


def _key(eqn, multi):
    shared = tuple(v if isinstance(v, Var) else ("lit", repr(v.value)) if isinstance(v, Lit)
                   else v for v in eqn.inputs[multi.k:])
    return (eqn.op.name, eqn.params, shared, eqn.device, eqn.inputs[0].ty.dtype)


def fuse_optimizer(g: Graph) -> Graph:
    forms = _multi_forms()
    groups: dict = {}
    for i, eqn in enumerate(g.eqns):
        multi = forms.get(eqn.op.name)
        if multi is not None:
            groups.setdefault(_key(eqn, multi), []).append(i)
    groups = [idx for idx in groups.values() if len(idx) > 1]
    if not groups:
        return g
    replaced: dict = {}
    for idx in groups:
        members = [g.eqns[i] for i in idx]
        multi = forms[members[0].op.name]
        ins = tuple(v for e in members for v in e.inputs[:multi.k]) + members[0].inputs[multi.k:]
        outs = tuple(v for e in members for v in e.outputs)
        fused = Eqn(multi.op, ins, outs, tuple(sorted(dict(members[0].params, n=len(members))
                                                     .items())),
                    device=members[0].device, scope=members[0].scope,
                    source=members[0].source)
        for i in idx[:-1]:
            replaced[i] = None
        replaced[idx[-1]] = fused
    eqns = [(i, replaced.get(i, e)) for i, e in enumerate(g.eqns) if replaced.get(i, e) is not None]
    return replace(g, eqns=tuple(stable_topological(eqns, g.inputs)))


def stable_topological(indexed_eqns: list, inputs) -> list:
    """Topological order that keeps the given priority (index) wherever data allows."""
    producer = {v: k for k, (_, e) in enumerate(indexed_eqns) for v in e.outputs}
    waiting = [0] * len(indexed_eqns)
    users: dict = {}
    for k, (_, e) in enumerate(indexed_eqns):
        deps = {producer[v] for v in e.inputs if isinstance(v, Var) and v in producer}
        waiting[k] = len(deps)
        for d in deps:
            users.setdefault(d, []).append(k)
    ready = [(indexed_eqns[k][0], k) for k in range(len(indexed_eqns)) if waiting[k] == 0]
    heapq.heapify(ready)
    out = []
    while ready:
        _, k = heapq.heappop(ready)
        out.append(indexed_eqns[k][1])
        for u in users.get(k, ()):
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, (indexed_eqns[u][0], u))
    assert len(out) == len(indexed_eqns), "cycle in graph"
    return out
