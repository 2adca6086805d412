"""Loops in lock step: a while_loop whose body holds a collective, under replication.

The tracer accepts such a loop only when its trip count is the same on every replica
(ops/control_flow.py, `_trip_count_varies`), so the replicas can run it as ONE loop: the
k-th while eqn of every replica becomes one N-way while node whose body is the replicated
body (every replica's copy of it, their collectives joined into N-way nodes, lowered with
the rest by lower_collectives) and whose predicate is replica 0's (all replicas agree).
Each iteration then runs every replica's body and the collectives between them, as the
unrolled loop would.
"""

from __future__ import annotations

from dataclasses import replace

from graphdist.errors import GraphError
from graphdist.ir import Graph, Var
from graphdist.ops.control_flow import holds_collective, while_p
from graphdist.passes.dce import eliminate_dead_code


def runs_in_lockstep(eqn) -> bool:
    """Is `eqn` a loop the replicas must run together (its body holds a collective)?"""
    return eqn.op is while_p and any(
        holds_collective(dict(eqn.params)[k]) is not None for k in ("body", "cond"))


def join_loop(b, loops: list, maps: list, devices: tuple, names: list, first: int,
              replicate) -> None:
    """Append to builder `b` the one while node that runs loops[d] (replica d's copy) for
    every replica d, and map each replica's loop outputs to its part of the node's.
    `replicate`: replicate.py's, which replicates the bodies (passed in: it calls us)."""
    head = loops[0]
    for other in loops[1:]:
        if other.op is not head.op or other.params != head.params:
            raise GraphError(f"replicate: replicas disagree on a loop: {head} vs {other}")
    params = dict(head.params)
    n, nc = len(devices), params["num_carry"]
    body = _carry_first(replicate([params["body"]] * n, devices, first), n, nc)
    cond = _carry_first(replicate([params["cond"]] * n, devices, first), n, nc)
    cond = eliminate_dead_code(cond.replace(outputs=cond.outputs[:1]))   # replica 0's
    ins = [[maps[d].get(v, v) if isinstance(v, Var) else v for v in loop.inputs]
           for d, loop in enumerate(loops)]
    inputs = [v for per in ins for v in per[:nc]] + [v for per in ins for v in per[nc:]]
    carry = [Var(v.ty, names[d](v), devices[d])
             for d, loop in enumerate(loops) for v in loop.outputs[:nc]]
    outputs = list(carry)
    if params["history"]:
        trips = Var(head.outputs[nc].ty, names[0](head.outputs[nc]), devices[0])
        outputs += [trips] + [Var(v.ty, names[d](v), devices[d])
                              for d, loop in enumerate(loops) for v in loop.outputs[nc + 1:]]
    params.update(body=body, cond=cond, num_carry=n * nc)
    b.eqns.append(replace(head, inputs=tuple(inputs), outputs=tuple(outputs),
                          params=tuple((k, params[k]) for k, _ in head.params),
                          device=devices[0]))
    for d, loop in enumerate(loops):
        maps[d].update(zip(loop.outputs[:nc], carry[d * nc:(d + 1) * nc]))
        if params["history"]:
            maps[d][loop.outputs[nc]] = trips
            start = n * nc + 1 + d * nc
            maps[d].update(zip(loop.outputs[nc + 1:], outputs[start:start + nc]))


def _carry_first(g: Graph, n: int, nc: int) -> Graph:
    """A replicated body (each replica's inputs in turn: carry, then constants) with every
    replica's carry first, then every replica's constants: the while node's input order."""
    m = len(g.inputs) // n
    per = [g.inputs[d * m:(d + 1) * m] for d in range(n)]
    return Graph(inputs=tuple(v for p in per for v in p[:nc]) +
                 tuple(v for p in per for v in p[nc:]),
                 eqns=g.eqns, outputs=g.outputs, devices=g.devices)
