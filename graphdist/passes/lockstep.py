"""Loops in lock step: a while_loop or scan whose body holds a collective, under
replication.

The tracer accepts such a loop only when its trip count is the same on every replica
(ops/control_flow.py, `_trip_count_varies`; a scan's is static), so the replicas can run
it as ONE loop: the k-th while (or scan) eqn of every replica becomes one N-way loop node
whose body is the replicated body (every replica's copy of it, their collectives joined
into N-way nodes, lowered with the rest by lower_collectives) and, for a while, whose
predicate is replica 0's (all replicas agree).
Each iteration then runs every replica's body and the collectives between them, as the
unrolled loop would.
"""

from __future__ import annotations

from dataclasses import replace

from graphdist.errors import GraphError
from graphdist.ir import Graph, Var
from graphdist.ir.bodies import bodies
from graphdist.ops.control_flow import holds_collective, scan_p, while_p
from graphdist.passes.dce import eliminate_dead_code


def runs_in_lockstep(eqn) -> bool:
    """Is `eqn` a loop the replicas must run together (its body holds a collective)?"""
    return eqn.op in (while_p, scan_p) and any(
        holds_collective(g) is not None for g in bodies(eqn))


def join_loop(b, loops: list, maps: list, devices: tuple, names: list, first: int,
              replicate) -> None:
    """Append to builder `b` the one while or scan node that runs loops[d] (replica d's
    copy) for every replica d, and map each replica's loop outputs to its part of the
    node's. `replicate`: replicate.py's, which replicates the bodies (it calls us)."""
    head = loops[0]
    for other in loops[1:]:
        if other.op is not head.op or other.params != head.params:
            raise GraphError(f"replicate: replicas disagree on a loop: {head} vs {other}")
    params = dict(head.params)
    n, nc = len(devices), params["num_carry"]
    body = params["body"]
    if head.op is while_p:
        in_groups, body_out_groups = [nc, len(head.inputs) - nc], [nc]
        out_groups = [nc, 1, nc] if params["history"] else [nc]
        cond = replicate([params["cond"]] * n, devices, first)
        cond = _regrouped(cond, n, in_groups, [1])
        params.update(cond=eliminate_dead_code(cond.replace(outputs=cond.outputs[:1])))
    else:
        nx = params["num_xs"]
        in_groups = [nc, nx, len(head.inputs) - nc - nx]
        body_out_groups = [nc, len(body.outputs) - nc]
        out_groups = body_out_groups + ([nc] if params["history"] else [])
        params.update(num_xs=n * nx)
    params.update(body=_regrouped(replicate([body] * n, devices, first), n, in_groups,
                                  body_out_groups), num_carry=n * nc)
    ins = [[maps[d].get(v, v) if isinstance(v, Var) else v for v in loop.inputs]
           for d, loop in enumerate(loops)]
    outs = [[Var(v.ty, names[d](v), devices[d]) for v in loop.outputs]
            for d, loop in enumerate(loops)]
    if head.op is while_p and params["history"]:     # one trip count: replica 0's
        for per in outs[1:]:
            per[nc] = outs[0][nc]
    shared = {1} if head.op is while_p and params["history"] else set()
    outputs = _group_major(outs, out_groups, shared)
    b.eqns.append(replace(head, inputs=tuple(_group_major(ins, in_groups)),
                          outputs=tuple(outputs),
                          params=tuple((k, params[k]) for k, _ in head.params),
                          device=devices[0]))
    for d, loop in enumerate(loops):
        maps[d].update(zip(loop.outputs, outs[d]))


def _group_major(lists: list, sizes: list, shared=frozenset()) -> list:
    """Each replica's list cut into consecutive groups of `sizes`, laid out group by group
    (every replica's carry, then every replica's xs, ...). A group in `shared` is one
    value all replicas share: replica 0's, once."""
    out, start = [], 0
    for g, size in enumerate(sizes):
        for per in (lists[:1] if g in shared else lists):
            out += per[start:start + size]
        start += size
    return out


def _regrouped(g: Graph, n: int, in_groups: list, out_groups: list) -> Graph:
    """A body replicated by replicate() (each replica's inputs, then outputs, in turn)
    with its inputs and outputs group-major: the loop node's order."""
    m, k = len(g.inputs) // n, len(g.outputs) // n
    ins = [list(g.inputs[d * m:(d + 1) * m]) for d in range(n)]
    outs = [list(g.outputs[d * k:(d + 1) * k]) for d in range(n)]
    return Graph(inputs=tuple(_group_major(ins, in_groups)), eqns=g.eqns,
                 outputs=tuple(_group_major(outs, out_groups)), devices=g.devices)
