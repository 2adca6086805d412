"""fuse_elementwise: clusters of elementwise ops become one fused_elementwise node
(ops/fused.py) whose CPU kernel is one generated Numba loop (kernels/fused_elementwise.py),
so `relu_grad(ct * s + r, y)` reads each input once and writes once, instead of one pass
over memory per op.

A cluster is a connected set of elementwise eqns on one host device whose results all have
one shape S (at least MIN_ELEMENTS elements: below that a kernel call costs more than the
ufuncs it replaces), each with a scalar formula in kernels/fused_elementwise.py's table
(arithmetic, neg, abs, square, sqrt, maximum/minimum, relu and its gradient, where and
comparisons, clip, casts between floats and from bool, gelu and its gradient in both
forms), in float32 or float64 (bool masks inside). Its inputs are arrays of shape S, scalars
(literals, 0-d or all-ones arrays), rows broadcast along the leading axes (a bias (n,) or
(1, n) against (m, n)) and columns along the last (statistics (m, 1) against (m, n)); every
row input of one cluster the same length, and that the last axis's when it has a column;
an op reading anything else stays out. Transcendental functions (exp, log, tanh, sigmoid, pow) stay out
too: their Numba and numpy forms differ in the last bit, and a fused program gives the
unfused one's bits.

A member's result read outside its cluster (by another eqn, or returned) becomes one more
output of the fused node, never a reason to stop; a merge that would make a path leave the
cluster and come back into it (a cycle once fused) is refused, and so is one past
MAX_MEMBERS. A cluster whose node would still move more than MAX_TRAFFIC of its members'
bytes stays unfused. Never fused: collectives, state ops, views, control-flow nodes (their
bodies are fused on their own, each cluster inside one body), ops on another device. Nothing fuses: the input graph itself
comes back.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from graphdist.device.backends import on_host
from graphdist.ir import Eqn, Graph, Lit, Var
from graphdist.ir.bodies import bodies
from graphdist.passes.core import in_bodies
from graphdist.kernels.fused_elementwise import COL, FULL, ROW, SCALAR, formula
from graphdist.ops.fused import describe, fused_elementwise_p
from graphdist.passes.fuse import stable_topological

# a cluster's results have at least this many elements (512 KiB of float32); smaller values
# run their ufuncs. A fused node's call costs about 11 us before its loop starts (the
# adapter, the thread budget, the parallel kernel's entry) and numpy's ufuncs run at cache
# speed on values that fit in L2; measured node against ufuncs (2-core AVX-512 VM, float32),
# fused / unfused: x * 0.5 + y 3.4 at 32K elements, 1.3 at 128K, 0.79 at 512K;
# (x * 0.5 + y) * z - x 2.0 at 32K, 0.92 at 128K, 0.55 at 512K; relu(x + y) * 0.5 + z
# 0.90 at 32K, 0.49 at 128K. At 4096 (the arena's size, the threshold before) every chain
# ran 3-8x its ufuncs' time: an LSTM's loop body (32 x 128 values) fused ran 1.2x slower.
MIN_ELEMENTS = 1 << 17
# a fused node with one result smaller than this (a bool mask) would run its impl, not its
# kernel (runtime/buffers.py's arena size): left unfused
MIN_BYTES = 16 * 1024
# a cluster is fused when the node moves at most this share of its members' bytes: a loop
# call costs more than a ufunc's, so `t = x * y; u = -t` with both read outside (5 passes'
# worth of bytes down to 4) ran 1.3-1.8x slower fused on 1 MiB values; `x * s + mask`
# (down to half) ran 0.7-0.8x the members' time
MAX_TRAFFIC = 0.75
# members of one cluster at most: Numba's compile time grows with the loop body (a long
# chain becomes several nodes)
MAX_MEMBERS = 32
DTYPES = (np.dtype("float32"), np.dtype("float64"), np.dtype("bool"))


def fuse_elementwise(g: Graph) -> Graph:
    """`g` with each cluster of 2+ elementwise eqns one fused_elementwise node, placed where
    its last member was (eqns reading an earlier member's result wait for it); inside the
    bodies of control flow too."""
    g = in_bodies(g, fuse_elementwise)
    users: dict = {}
    for i, e in enumerate(g.eqns):
        for v in e.inputs:
            if isinstance(v, Var):
                users.setdefault(v, []).append(i)
    clusters = _clusters(g, users)
    if not clusters:
        return g
    replaced: dict = {}
    outputs = {v for v in g.outputs if isinstance(v, Var)}
    for members in clusters:
        fused = _fused_eqn(g, members, outputs, users)
        if fused is None:
            continue
        replaced.update((i, None) for i in members)
        replaced[members[-1]] = fused
    if not replaced:
        return g
    eqns = [(i, replaced.get(i, e)) for i, e in enumerate(g.eqns)
            if replaced.get(i, e) is not None]
    return replace(g, eqns=tuple(stable_topological(eqns, g.inputs)))


# ---------------------------------------------------------------- members


def input_kind(ty, shape: tuple) -> tuple | None:
    """(FULL | ROW | COL | SCALAR, row length) for an input of type `ty` read by a member
    whose result has `shape`; None for a broadcast the kernel does not index (a middle
    axis, a column with fewer axes than the result)."""
    if ty.dtype not in DTYPES:
        return None
    if tuple(ty.shape) == tuple(shape):
        return FULL, 0
    if ty.size == 1 and len(ty.shape) <= len(shape):
        return SCALAR, 0
    if len(shape) >= 2 and tuple(ty.shape) == (*shape[:-1], 1):
        return COL, shape[-1]
    dims = list(ty.shape)
    while dims and dims[0] == 1:
        dims.pop(0)
    if dims and len(dims) < len(shape) and tuple(dims) == tuple(shape[len(shape) - len(dims):]):
        return ROW, math.prod(dims)
    return None


def _member(eqn) -> tuple | None:
    """(result shape, row length or 0) of an eqn the kernels can take in, else None."""
    op = eqn.op
    if (not op.elementwise or op.stateful or op.collective or op.view or len(eqn.outputs) != 1
            or bodies(eqn) or not on_host(eqn.device)):
        return None
    out = eqn.outputs[0].ty
    if out.dtype not in DTYPES or out.size < MIN_ELEMENTS:
        return None
    cols = 0
    for v in eqn.inputs:
        if isinstance(v, Lit):
            if v.ty.dtype not in DTYPES:
                return None
            continue
        kind = input_kind(v.ty, out.shape)
        if kind is None or kind[0] in (ROW, COL) and cols not in (0, kind[1]):
            return None
        cols = kind[1] or cols
    args = [f"a{j}" for j in range(len(eqn.inputs))]
    if formula(op.name, args, dict(eqn.params), out.dtype.name) is None:
        return None
    return out.shape, cols


# ---------------------------------------------------------------- clusters


class _Cluster:
    """Members grown so far: their eqn indices, the eqns outside reading their results,
    the last member's index and the rows' length (0: no row input yet)."""

    __slots__ = ("members", "readers", "last", "cols")

    def __init__(self, i: int, readers: set, cols: int):
        self.members, self.readers, self.last, self.cols = {i}, readers, i, cols


def _clusters(g: Graph, users: dict) -> list:
    """Each cluster of 2+ members, as its sorted eqn indices: grown eqn by eqn in graph
    order, each eqn joining the clusters of the members whose results it reads. The smaller
    cluster merges into the larger, so a long chain costs n log n."""
    eqns = g.eqns
    info = [_member(e) for e in eqns]
    producer = {v: i for i, e in enumerate(eqns) for v in e.outputs}
    cluster_of: dict = {}          # eqn index -> its _Cluster
    for i, e in enumerate(eqns):
        if info[i] is None:
            continue
        readers = {u for v in e.outputs for u in users.get(v, ())}
        cluster_of[i] = _Cluster(i, readers, info[i][1])
        for v in e.inputs:
            p = producer.get(v) if isinstance(v, Var) else None
            if p is None or p not in cluster_of:
                continue
            a, b = cluster_of[p], cluster_of[i]
            if a is b or info[p][0] != info[i][0] or eqns[p].device != e.device:
                continue
            if a.cols and b.cols and a.cols != b.cols or \
                    len(a.members) + len(b.members) > MAX_MEMBERS:
                continue
            readers = {u for u in a.readers | b.readers
                       if u not in a.members and u not in b.members}
            last = max(a.last, b.last)
            if _leaves_and_returns(eqns, (a.members, b.members), readers, last, users,
                                   cluster_of):
                continue
            if len(a.members) > len(b.members):
                a, b = b, a
            for k in a.members:
                cluster_of[k] = b
            b.members |= a.members
            b.readers, b.last, b.cols = readers, last, b.cols or a.cols
    clusters = {id(c): c for c in cluster_of.values()}.values()
    return [sorted(c.members) for c in clusters if len(c.members) > 1]


def _leaves_and_returns(eqns, parts: tuple, readers: set, last: int, users: dict,
                        cluster_of: dict) -> bool:
    """Whether some path leaves the union of `parts` and comes back into it (fusing it
    would make a cycle): a search forward from the eqns outside reading a member's result
    (`readers`). Another cluster on the way counts as the one node it becomes: the search
    goes on from all of its members' results (two clusters each reading the other's result
    would wait on each other). Only eqns before the last member can lead back: clusters hold
    eqns up to the one being added, which is the last member."""
    stack, seen, expanded = [], set(), set()

    def reach(u: int) -> None:
        if u < last and u not in seen:
            seen.add(u)
            stack.append(u)

    for u in readers:
        reach(u)
    while stack:
        k = stack.pop()
        sources = [k]
        other = cluster_of.get(k)
        if other is not None and id(other) not in expanded:
            expanded.add(id(other))
            sources = other.members
        for j in sources:
            for v in eqns[j].outputs:
                for u in users.get(v, ()):
                    if any(u in part for part in parts):
                        return True
                    reach(u)
    return False


# ---------------------------------------------------------------- the fused node


def _bytes(ins, outs) -> int:
    """Bytes a node reads and writes (literals aside)."""
    return sum(v.ty.nbytes for v in (*ins, *outs) if isinstance(v, Var))


def _fused_eqn(g: Graph, members: list, outputs: set, users: dict) -> Eqn | None:
    """The fused_elementwise eqn standing for `members` (sorted eqn indices), or None when
    nothing it computes is read (a dead cluster is DCE's business)."""
    eqns = [g.eqns[i] for i in members]
    made = {v for e in eqns for v in e.outputs}
    inside = set(members)
    results = [v for e in eqns for v in e.outputs
               if v in outputs or any(u not in inside for u in users.get(v, ()))]
    if not results or len(results) == 1 and results[0].ty.nbytes < MIN_BYTES:
        return None
    ins = list(dict.fromkeys(v for e in eqns for v in e.inputs
                             if isinstance(v, Var) and v not in made))
    if _bytes(ins, results) > MAX_TRAFFIC * sum(_bytes(e.inputs, e.outputs) for e in eqns):
        return None
    rename = {v: Var(v.ty, v.hint, v.device) for v in (*ins, *made)}
    body_eqns = tuple(replace(e, inputs=tuple(rename.get(v, v) if isinstance(v, Var) else v
                                              for v in e.inputs),
                              outputs=tuple(rename[v] for v in e.outputs)) for e in eqns)
    body = Graph(tuple(rename[v] for v in ins), body_eqns, tuple(rename[v] for v in results),
                 devices=g.devices)
    last = eqns[-1]
    return Eqn(fused_elementwise_p, tuple(ins), tuple(results),
               (("body", body), ("formula", describe(body)),
                ("members", tuple(e.op.name for e in eqns))), device=last.device,
               scope=last.scope, source=last.source)
