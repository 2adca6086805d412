"""Fusing optimizer work.

fuse_optimizer: a device's per-variable optimizer updates that share an op, its params,
the hyper-parameter vector (one per optimizer step) and dtype become one multi-tensor eqn,
so one kernel launch updates every parameter (and the placed graph and profile show it so).

fuse_reduce_update: on logical CPU devices, a gradient bucket's all-reduce and every
replica's multi-tensor update become one node that streams the buckets once.
"""

from __future__ import annotations

import heapq
from dataclasses import replace

from graphdist.ir import Eqn, Graph, Lit, Var
from graphdist.ops import OPS
from graphdist.ops.array import reshape_p, split_p
from graphdist.ops.host_collectives import host_all_reduce_p, host_reduce_update_p
from graphdist.ops.overlap_collectives import collective_wait_p


def _multi_forms() -> dict:
    """Per-variable update op -> its multi-tensor form (ops/optim.py MultiTensor)."""
    return {op.multi_tensor.single: op.multi_tensor for op in OPS.values()
            if op.multi_tensor is not None}


def _key(eqn, multi):
    shared = tuple(v if isinstance(v, Var) else ("lit", repr(v.value)) if isinstance(v, Lit)
                   else v for v in eqn.inputs[multi.k:])
    return (eqn.op.name, eqn.params, shared, eqn.device, eqn.inputs[0].ty.dtype)


def fuse_optimizer(g: Graph) -> Graph:
    forms = _multi_forms()
    groups: dict = {}
    # Only independent updates may share a node. An update's depth is the number of updates
    # on its longest input path (two optimizer steps in one function: the second step's are
    # one deeper); grouping by depth too keeps every fused node's inputs computable before it,
    # so no fused node waits on itself, and one step's updates (all depth 0) stay one node.
    depth: dict = {}
    for i, eqn in enumerate(g.eqns):
        d = max((depth.get(v, 0) for v in eqn.inputs if isinstance(v, Var)), default=0)
        multi = forms.get(eqn.op)
        if multi is not None:
            groups.setdefault((_key(eqn, multi), d), []).append(i)
            d += 1
        if d:
            depth.update((v, d) for v in eqn.outputs)
    groups = [idx for idx in groups.values() if len(idx) > 1]
    if not groups:
        return g
    replaced: dict = {}
    for idx in groups:
        members = [g.eqns[i] for i in idx]
        multi = forms[members[0].op]
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


def spliced(g: Graph, replaced: dict) -> list:
    """g's eqns as (index, eqn) pairs with `replaced[i]` in eqn i's place: an eqn, a list of
    them (spliced in at i's priority), or None (dropped). The fusion passes hand the result
    to stable_topological."""
    eqns = []
    for i, e in enumerate(g.eqns):
        new = replaced.get(i, e)
        eqns += [(i, x) for x in (new if isinstance(new, list) else [new]) if x is not None]
    return eqns


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


def fuse_reduce_update(g: Graph) -> Graph:
    """On host devices: a host_all_reduce whose every result reaches only its replica's
    multi-tensor optimizer update, through views (reshape, split along axis 0), becomes one
    host_reduce_update node that sums each chunk of the buckets once and updates every
    replica's tensors from it (kernels/reduce_update.py): the reduced gradient is never
    written out per replica and read back. Same bits as the unfused pair. An update whose
    gradients come from several buckets is first cut into one update per bucket."""
    g = _split_updates_by_bucket(g)
    users: dict = {}
    for i, eqn in enumerate(g.eqns):
        for v in eqn.inputs:
            if isinstance(v, Var):
                users.setdefault(v, []).append(i)
    outputs = {v for v in g.outputs if isinstance(v, Var)}
    replaced: dict = {}
    for i, eqn in enumerate(g.eqns):
        if eqn.op is not host_all_reduce_p:
            continue
        plan = _reduce_update_plan(g, eqn, users, outputs)
        if plan is None:
            continue
        updates, dead, offsets = plan
        replaced.update({k: None for k in (*dead, *updates)})
        replaced[max(updates)] = _fused(eqn, [g.eqns[k] for k in updates], offsets)
        replaced.setdefault(i, None)
    if not replaced:
        return g
    return replace(g, eqns=tuple(stable_topological(spliced(g, replaced), g.inputs)))


def _reduce_update_plan(g: Graph, reduce_eqn, users: dict, outputs: set):
    """(update eqn indices in replica order, view eqn indices made dead, each tensor's
    offset in the bucket), or None when the results have any other use."""
    updates, dead, layout = [], set(), None
    for out in reduce_eqn.outputs:
        found = {}                           # grad position in the update -> bucket offset
        update = None
        stack = [(out, 0)]
        while stack:
            v, offset = stack.pop()
            if v in outputs:
                return None
            for k in users.get(v, ()):
                e = g.eqns[k]
                multi = e.op.multi_tensor
                if e.op is reshape_p:
                    dead.add(k)
                    stack.append((e.outputs[0], offset))
                elif e.op is split_p and dict(e.params)["axis"] == 0:
                    dead.add(k)
                    row = v.ty.size // max(v.ty.shape[0], 1) if v.ty.ndim else 1
                    start = offset
                    for piece, size in zip(e.outputs, dict(e.params)["sizes"]):
                        stack.append((piece, start))
                        start += size * row
                elif multi is not None and update in (None, k):
                    uses = [j for j, x in enumerate(e.inputs) if x is v]
                    slots = [j for j in uses if j < dict(e.params)["n"] * multi.k
                             and j % multi.k == multi.k - 1]
                    if not slots or len(slots) != len(uses):
                        return None             # read as something other than a gradient
                    update = k
                    found.update({j // multi.k: offset for j in slots})
                else:
                    return None
        if update is None or len(found) != dict(g.eqns[update].params)["n"]:
            return None
        offsets = tuple(found[j] for j in range(len(found)))
        key = (g.eqns[update].op.name, g.eqns[update].params, offsets)
        if layout not in (None, key):
            return None
        layout = key
        updates.append(update)
    if len(set(updates)) != len(updates):
        return None                          # one update fed by two replicas' results
    return updates, dead, layout[2]


# tensors one fused node updates across all replicas: the CPU kernels take tuples of up to
# 16 arrays (kernels/common.py TUPLE_SIZES); longer lists become typed Lists, whose numba
# internals compile anew in every process (0.65 s on the first step). Several nodes over
# disjoint ranges of the buckets still read each byte once.
MAX_TENSORS_PER_NODE = 16


def _fused(reduce_eqn, updates: list, offsets: tuple) -> list:
    """The host_reduce_update nodes replacing `reduce_eqn` and `updates`: one, or one per
    group of tensors when replicas x tensors exceed MAX_TENSORS_PER_NODE."""
    multi = updates[0].op.multi_tensor
    n = dict(updates[0].params)["n"]
    per_node = max(1, MAX_TENSORS_PER_NODE // len(updates))
    nodes = []
    for first in range(0, n, per_node):
        js = range(first, min(n, first + per_node))
        ins = list(reduce_eqn.inputs)
        outs = []
        for u in updates:
            for j in js:
                ins += u.inputs[j * multi.k:(j + 1) * multi.k - 1]
            ins += u.inputs[n * multi.k:]
            for j in js:
                outs += u.outputs[j * multi.outs:(j + 1) * multi.outs]
        params = dict(updates[0].params, update=updates[0].op.name, n=len(js),
                      offsets=tuple(offsets[j] for j in js),
                      reduce=dict(reduce_eqn.params)["op"], replicas=len(updates))
        nodes.append(Eqn(host_reduce_update_p, tuple(ins), tuple(outs),
                         tuple(sorted(params.items())), device=reduce_eqn.device,
                         scope=updates[0].scope, source=updates[0].source))
    return nodes


def _split_updates_by_bucket(g: Graph, source=host_all_reduce_p) -> Graph:
    """Cut each multi-tensor update whose gradients come from several host all-reduces (or
    other `source` collectives: the reduce-scatters of zero_stage > 0), or from the waits
    of the buckets the overlap stage started early, into one update per collective (the
    tensors' updates are independent; order is kept). The last bucket's all-reduce, left
    inline by the overlap stage, can then be fused with its own part of the update."""
    producer = {v: i for i, e in enumerate(g.eqns) for v in e.outputs}

    def bucket_of(v):
        while isinstance(v, Var) and v in producer:
            e = g.eqns[producer[v]]
            if e.op is source or e.op is collective_wait_p:
                return producer[v]
            if e.op is not reshape_p and e.op is not split_p:
                return None
            v = e.inputs[0]
        return None

    replaced: dict = {}
    for i, eqn in enumerate(g.eqns):
        multi = eqn.op.multi_tensor
        if multi is None:
            continue
        n = dict(eqn.params)["n"]
        sources = [bucket_of(eqn.inputs[j * multi.k + multi.k - 1]) for j in range(n)]
        if len(set(sources)) < 2 or None in sources:
            continue
        parts = []
        for bucket in dict.fromkeys(sources):          # first-seen order
            js = [j for j in range(n) if sources[j] == bucket]
            ins = tuple(v for j in js for v in eqn.inputs[j * multi.k:(j + 1) * multi.k])
            outs = tuple(v for j in js for v in eqn.outputs[j * multi.outs:(j + 1) * multi.outs])
            params = tuple(sorted(dict(eqn.params, n=len(js)).items()))
            parts.append(replace(eqn, inputs=ins + eqn.inputs[n * multi.k:], outputs=outs,
                                 params=params))
        replaced[i] = parts
    if not replaced:
        return g
    eqns = [e for i, e in enumerate(g.eqns) for e in replaced.get(i, [e])]
    return replace(g, eqns=tuple(eqns))
