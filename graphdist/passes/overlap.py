"""The `overlap` stage (issue 26): communication hidden behind compute. Each host, MPI or
NCCL all-reduce node becomes a start and a wait (ops/overlap_collectives.py), and the eqns are
ordered so that the starts come early: each device keeps its own order (nothing changes
numerically), the devices are interleaved eqn by eqn, each start (with the reshapes and the
bucket concat feeding it) runs as soon as its inputs exist, which puts the buckets in
reverse forward order as DDP does, and each wait sits just before the first eqn that reads
its results (or the next collective that is not split, so that every worker issues its
collectives in one order). runtime/overlap.py runs them; `gd.config.set_overlap(False)`
leaves the collectives inline (pipeline.py then runs fuse_reduce_update instead).

The pipeline runs the stage where the strategy's lowering declares `splits_to_overlap`
(its node can start early: host, mpi, nccl), in one program or with a thread per device
(each device's program then keeps its own eqns in this order, the collectives in the first
device's); a merged program has no collective left to split (passes/merge.py).
"""

from __future__ import annotations

import collections
import heapq
from dataclasses import replace

from graphdist.ir import Graph, Var
from graphdist.ops.array import concat_p, reshape_p
from graphdist.ops.overlap_collectives import (START_OF, TOKEN, Channel, CommLane,
                                               collective_wait_p, is_start)

# the collectives the stage splits: host memory all-reduces, within a process or across
# worker processes, and the NCCL all-reduce of GPUs
SPLIT_OPS = tuple(START_OF)

# ops that only lay a bucket out (flatten, concatenate): hoisted with the start they feed
_LAYOUT_OPS = (reshape_p, concat_p)


def overlap_collectives(g: Graph) -> Graph:
    """Split each host/MPI/NCCL all-reduce into a start and a wait and schedule them to overlap
    the compute (see the module docstring). A graph without one comes back as it is."""
    worth = _worth_splitting(g.eqns)
    if not worth:
        return g
    lane = CommLane()
    returned = {v for v in g.outputs[: g.num_results] if isinstance(v, Var)}
    order = _hoisted_order(g.eqns, worth)
    starts, waits = [], {}
    for eqn in order:
        if eqn not in worth:
            starts.append(eqn)
            continue
        start, wait = _split(eqn, lane, returned)
        starts.append(start)
        waits[start] = wait
    return replace(g, eqns=tuple(_place_waits(starts, waits)), liveness=None)


def _split(eqn, lane: CommLane, returned: set):
    params = dict(eqn.params)
    channel = Channel(eqn.op, params, eqn.device, [v.ty for v in eqn.outputs], lane,
                      any(v in returned for v in eqn.outputs))
    token = Var(TOKEN, hint=f"{eqn.op.name}_started", device=eqn.device)
    start = replace(eqn, op=START_OF[eqn.op], outputs=(token,),
                    params=tuple({**params, "channel": channel}.items()))
    wait = replace(eqn, op=collective_wait_p, inputs=(token, *eqn.inputs),
                   params=(("channel", channel),))
    return start, wait


def _worth_splitting(eqns) -> set:
    """The all-reduces that have compute to hide behind: eqns after the last one
    they read that neither feed them nor follow from any all-reduce (the rest of the
    backward pass; variable reads and writes do not count), touching at least as many
    bytes as the all-reduce reads. The last bucket, ready only when the backward pass ends,
    has none: it stays inline, where fuse_reduce_update can fold it into the optimizer's
    update (one pass over the gradients instead of two; the MLP on 4 devices ran 10% slower
    with every bucket split)."""
    candidates = [i for i, e in enumerate(eqns) if e.op in SPLIT_OPS]
    if not candidates:
        return set()
    producer = {v: i for i, e in enumerate(eqns) for v in e.outputs}
    inputs = [{producer[v] for v in e.inputs if isinstance(v, Var) and v in producer}
              for e in eqns]
    after_any = set(candidates)            # everything an all-reduce's result reaches
    for i, deps in enumerate(inputs):
        if deps & after_any:
            after_any.add(i)
    worth = set()
    for c in candidates:
        before = {c}                       # everything the all-reduce reads, transitively
        stack = [c]
        while stack:
            for j in inputs[stack.pop()]:
                if j not in before:
                    before.add(j)
                    stack.append(j)
        # hoisted (with the layout ops packing its bucket), the start runs once every
        # device has made its part of the bucket; what each device still has to compute
        # then (the devices are interleaved) is what can hide the all-reduce
        ready: dict = {}
        for j in before - {c}:
            if eqns[j].op not in _LAYOUT_OPS:
                ready[eqns[j].device] = max(ready.get(eqns[j].device, -1), j)
        hidden = sum(_bytes(eqns[i]) for i in range(len(eqns))
                     if i > ready.get(eqns[i].device, len(eqns)) and i not in before
                     and i not in after_any and not eqns[i].op.collective
                     and not eqns[i].op.stateful and eqns[i].op not in _LAYOUT_OPS)
        if hidden >= sum(v.ty.nbytes for v in eqns[c].inputs):
            worth.add(eqns[c])
    return worth


def _bytes(eqn) -> int:
    """The bytes an eqn touches by its op's cost rule (views and reshapes: none)."""
    return eqn.op.cost([v.ty for v in eqn.inputs], [v.ty for v in eqn.outputs],
                       dict(eqn.params))[1]


def _hoisted_order(eqns, split: set) -> list:
    """Eqns in an order the data allows: each device's eqns in their own order, the devices
    interleaved eqn by eqn, and every collective to split (with the layout ops that only
    feed it) as soon as its inputs exist."""
    producer = {v: i for i, e in enumerate(eqns) for v in e.outputs}
    consumers: dict = collections.defaultdict(set)
    for i, e in enumerate(eqns):
        for v in e.inputs:
            if isinstance(v, Var) and v in producer:
                consumers[producer[v]].add(i)
    hoisted = {i for i, e in enumerate(eqns) if e in split}
    for i in range(len(eqns) - 1, -1, -1):      # consumers come after producers
        if eqns[i].op in _LAYOUT_OPS and consumers[i] and consumers[i] <= hoisted:
            hoisted.add(i)
    deps = {i: {producer[v] for v in e.inputs if isinstance(v, Var) and v in producer}
            for i, e in enumerate(eqns)}
    key, chains = {}, {}
    lane_rank = {}
    for i, e in enumerate(eqns):
        if i in hoisted:
            key[i] = (0, i, 0)
            continue
        lane = lane_rank.setdefault(e.device, len(lane_rank))
        chain = chains.setdefault(e.device, [])
        if chain:
            deps[i].add(chain[-1])       # a device's eqns keep their order
        key[i] = (1, len(chain), lane)
        chain.append(i)
    waiting = {i: len(d) for i, d in deps.items()}
    users: dict = collections.defaultdict(list)
    for i, d in deps.items():
        for j in d:
            users[j].append(i)
    ready = [(key[i], i) for i, n in waiting.items() if n == 0]
    heapq.heapify(ready)
    out = []
    while ready:
        _, i = heapq.heappop(ready)
        out.append(eqns[i])
        for j in users[i]:
            waiting[j] -= 1
            if waiting[j] == 0:
                heapq.heappush(ready, (key[j], j))
    if len(out) != len(eqns):
        raise AssertionError("overlap: the eqns' dependencies have a cycle")
    return out


def _place_waits(eqns: list, waits: dict) -> list:
    """Each wait just before the first eqn reading its results, or before the next
    collective that is not split (every worker then issues its collectives in one order),
    or at the end."""
    out, pending = [], []          # pending: (wait, the Vars it makes)
    for eqn in eqns:
        reads = {v for v in eqn.inputs if isinstance(v, Var)}
        inline = eqn.op.collective and not is_start(eqn.op) and eqn.op is not collective_wait_p
        due = [w for w, made in pending if inline or made & reads]
        for w in due:
            out.append(w)
        pending = [(w, made) for w, made in pending if w not in due]
        out.append(eqn)
        if eqn in waits:
            pending.append((waits[eqn], set(waits[eqn].outputs)))
    out.extend(w for w, _ in pending)
    return out
