"""fuse_sharded_update: on host devices run as one program, the sharded update of
zero_stage > 0 (graphdist/optimizers/zero.py) becomes one node per gradient bucket.

zero.py emits, per bucket: a reduce-scatter of the replicas' gradient buckets, on each
replica its chunk of every member's parameter (pad, reshape, a gather of its row), the
optimizer's multi-tensor update of those chunks and of its slot shards, and an all-gather
of the new chunks, unpacked into every replica's parameters. Lowered for host devices that
is a host_reduce_scatter, R updates and a host_all_gather, plus the copies around them.
This pass finds that shape and puts one host_reduce_scatter_update_all_gather node in its
place (ops/zero_collectives.py, kernels/sharded_update.py): each chunk of the buckets is
summed once, replica r's shard is updated from it and the new values are written straight
into every replica's parameter storage. Same bits as the nodes apart.

Anything else reading an intermediate (a clipped gradient: clipping by norm multiplies the
reduced shards first; a gathered value read elsewhere) leaves the bucket as it was.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from graphdist.ir import Eqn, Graph, Lit, Var
from graphdist.ops.array import concat_p, pad_p, reshape_p, split_p
from graphdist.ops.host_collectives import host_all_gather_p, host_reduce_scatter_p
from graphdist.ops.sparse import check_indices_p, gather_p
from graphdist.ops.state import read_p as read_var_p
from graphdist.ops.zero_collectives import host_sharded_update_p
from graphdist.passes.fuse import _reduce_update_plan, _split_updates_by_bucket, spliced, \
    stable_topological

# replicas x members one node updates: the CPU kernels take tuples of up to 16 arrays
# (kernels/common.py TUPLE_SIZES), as passes/fuse.py's fused all-reduce + update
MAX_TENSORS_PER_NODE = 16


def fuse_sharded_update(g: Graph) -> Graph:
    """Each host_reduce_scatter whose results reach only every replica's update of its
    chunks, whose new chunks go only to one host_all_gather, unpacked only into whole
    parameters, becomes one host_reduce_scatter_update_all_gather node (or a few, for more
    than 16 replicas x members)."""
    if not any(e.op is host_reduce_scatter_p for e in g.eqns):
        return g
    given, g = g, _split_updates_by_bucket(g, host_reduce_scatter_p)
    index = _Index(g)
    replaced: dict = {}
    maybe_dead: set = set()
    for i, eqn in enumerate(g.eqns):
        if eqn.op is not host_reduce_scatter_p:
            continue
        found = _bucket(index, i)
        if found is None:
            continue
        nodes, dead, anchor, chains = found
        replaced.update(dict.fromkeys(dead))
        replaced[anchor] = nodes          # where the reduce-scatter was: the buckets die early
        maybe_dead |= chains
    if not replaced:
        return given                  # not even the updates cut per bucket
    eqns = _without_dead(spliced(g, replaced), maybe_dead, g.outputs)
    return replace(g, eqns=tuple(stable_topological(eqns, g.inputs)))


class _Index:
    """Who makes and who reads each value."""

    def __init__(self, g: Graph):
        self.g = g
        self.producer = {v: i for i, e in enumerate(g.eqns) for v in e.outputs}
        self.users: dict = {}
        for i, eqn in enumerate(g.eqns):
            for v in eqn.inputs:
                if isinstance(v, Var):
                    self.users.setdefault(v, []).append(i)
        self.outputs = {v for v in g.outputs if isinstance(v, Var)}

    def made_by(self, v, op):
        """The eqn index making v, if it is `op`'s."""
        i = self.producer.get(v) if isinstance(v, Var) else None
        return i if i is not None and self.g.eqns[i].op is op else None

    def only_user(self, v):
        """The one eqn reading v (None: several, none, or v is a result)."""
        found = self.users.get(v, [])
        return found[0] if len(found) == 1 and v not in self.outputs else None


def _bucket(index: _Index, rs: int):
    """(the fused nodes, the eqns they replace, the index they take, eqns that may be dead
    after) for the reduce-scatter at `rs`, or None where the bucket is not the shape
    zero.py emits."""
    g = index.g
    scatter = g.eqns[rs]
    replicas = len(scatter.outputs)
    width = scatter.outputs[0].ty.size
    if replicas < 2 or any(x.ty.size != replicas * width for x in scatter.inputs):
        return None
    plan = _reduce_update_plan(g, scatter, index.users, index.outputs)
    if plan is None:
        return None
    updates, dead, offsets = plan
    update = [g.eqns[k] for k in updates]
    multi = update[0].op.multi_tensor
    n = dict(update[0].params)["n"]
    lengths = tuple(update[0].inputs[j * multi.k + multi.k - 1].ty.size for j in range(n))
    if any(o + length > width for o, length in zip(offsets, lengths)):
        return None
    chains: set = set()
    params = []                                   # [replica][member]: its whole parameter
    for k, u in enumerate(update):
        row = []
        for j in range(n):
            found = _chunk_source(index, u.inputs[j * multi.k], k, replicas, lengths[j])
            if found is None:
                return None
            row.append(found[0])
            chains |= found[1]
        params.append(row)
    gathered = _gathered_chunks(index, update, multi, offsets, lengths)
    if gathered is None:
        return None
    gather_eqn, packing = gathered
    finals = _unpacked(index, g.eqns[gather_eqn], offsets, lengths, params)
    if finals is None:
        return None
    wholes, unpacking = finals
    replaced = {rs, *dead, *updates, gather_eqn, *packing, *unpacking}
    names = [_variable_name(index, params[0][j], j) for j in range(n)]
    nodes = _nodes(scatter, update, multi, offsets, lengths, params, wholes, width, names)
    return nodes, replaced, rs, chains


def _literal(index: _Index, v):
    """The value of an integer literal v, seen through reshapes and index checks."""
    while isinstance(v, Var):
        i = index.producer.get(v)
        if i is None or index.g.eqns[i].op not in (reshape_p, check_indices_p):
            return None
        v = index.g.eqns[i].inputs[0]
    value = np.asarray(v.value) if isinstance(v, Lit) else None
    return int(value.reshape(-1)[0]) if value is not None and value.size == 1 else None


def _chunk_source(index: _Index, chunk, k: int, replicas: int, length: int):
    """(the whole parameter whose chunk k `chunk` is, the eqns that cut it) for zero.py's
    `gather(reshape(pad(reshape(x, -1)), (R, L)), k)` (the pad where R L > size), else
    None."""
    g, eqns = index.g, set()
    if chunk.ty.shape != (length,):
        return None
    i = index.made_by(chunk, reshape_p)       # gather's row of a 1-element index, or
    if i is not None:                          # gather(rows, k) itself
        eqns.add(i)
        chunk = g.eqns[i].inputs[0]
    j = index.made_by(chunk, gather_p)
    if j is None or _literal(index, g.eqns[j].inputs[1]) != k:
        return None
    eqns.add(j)
    rows_index = g.eqns[j].inputs[1]
    while isinstance(rows_index, Var):            # the replica's row number, checked
        eqns.add(index.producer[rows_index])
        rows_index = g.eqns[index.producer[rows_index]].inputs[0]
    rows = g.eqns[j].inputs[0]
    if rows.ty.shape != (replicas, length):
        return None
    v, padded = rows, False
    while True:                                     # back through reshapes and one pad
        p = index.producer.get(v) if isinstance(v, Var) else None
        e = g.eqns[p] if p is not None else None
        if e is not None and e.op is reshape_p:
            eqns.add(p)
            v = e.inputs[0]
        elif e is not None and e.op is pad_p and not padded and _pads_end_with_zeros(e):
            eqns.add(p)
            v, padded = e.inputs[0], True
        else:
            break
    if not isinstance(v, Var) or -(-v.ty.size // replicas) != length:   # ceil(size / R)
        return None
    return v, eqns


def _pads_end_with_zeros(eqn) -> bool:
    params = dict(eqn.params)
    return (eqn.inputs[0].ty.ndim == 1 and params.get("mode", "CONSTANT") == "CONSTANT"
            and params.get("constant_values", 0) == 0
            and tuple(params["paddings"][0])[0] == 0)


def _gathered_chunks(index: _Index, update: list, multi, offsets, lengths):
    """(the host_all_gather that takes every replica's new chunks, the concats packing
    them) when each replica's new parameter chunks, packed in bucket order, are its input
    and nothing else reads them."""
    g, packing, gather_eqn = index.g, set(), None
    order = sorted(range(len(offsets)), key=lambda j: offsets[j])
    if [offsets[j] for j in order] != [sum(lengths[m] for m in order[:q])
                                       for q in range(len(order))]:
        return None                                 # members do not tile the chunk
    for k, u in enumerate(update):
        news = [u.outputs[j * multi.outs] for j in order]
        if len(news) == 1:
            packed = news[0]
        else:
            c = index.only_user(news[0])
            if c is None or g.eqns[c].op is not concat_p or g.eqns[c].inputs != tuple(news) \
                    or any(index.only_user(x) != c for x in news):
                return None
            packing.add(c)
            packed = g.eqns[c].outputs[0]
        a = index.only_user(packed)
        if a is None or g.eqns[a].op is not host_all_gather_p or gather_eqn not in (None, a) \
                or g.eqns[a].inputs[k] is not packed:
            return None
        gather_eqn = a
    if len(g.eqns[gather_eqn].inputs) != len(update):
        return None
    return gather_eqn, packing


def _unpacked(index: _Index, gather_eqn, offsets, lengths, params):
    """([replica][member] the value equal to the whole new parameter, the view eqns between
    the all-gather and them) when every gathered element goes only, through reshapes and
    splits, to those values (or nowhere: the padding)."""
    g, views = index.g, set()
    member_at = {(o, length): j for j, (o, length) in enumerate(zip(offsets, lengths))}
    replicas = len(gather_eqn.outputs)
    wholes = []
    for k, out in enumerate(gather_eqn.outputs):
        found: dict = {}
        width = out.ty.size // replicas
        # (value, first column, columns, [start, stop) of its flat order): the value's
        # elements, in order, are the rows' columns [c0, c0 + w), restricted to [a, b)
        stack = [(out, 0, width, 0, out.ty.size)]
        while stack:
            v, c0, w, a, b = stack.pop()
            j = member_at.get((c0, w))
            whole = params[k][j] if j is not None else None
            if whole is not None and (a, b) == (0, whole.ty.size) \
                    and v.ty.shape == whole.ty.shape and j not in found:
                found[j] = v
                continue
            if v in index.outputs:
                return None
            for u in index.users.get(v, ()):
                e = g.eqns[u]
                views.add(u)
                if e.op is reshape_p:
                    stack.append((e.outputs[0], c0, w, a, b))
                elif e.op is split_p and _splits(e, v, replicas, w, a, b):
                    axis, at = dict(e.params)["axis"], 0
                    for piece, size in zip(e.outputs, dict(e.params)["sizes"]):
                        stack.append((piece, c0 + at, size, 0, replicas * size) if axis == 1
                                     else (piece, c0, w, a + at, a + at + size))
                        at += size
                else:
                    return None
        if len(found) != len(offsets):
            return None
        wholes.append([found[j] for j in range(len(offsets))])
    return wholes, views


def _splits(eqn, v, replicas: int, w: int, a: int, b: int) -> bool:
    """A split we can follow: columns of the whole (R, w) matrix, or a 1-D range."""
    axis = dict(eqn.params)["axis"]
    if axis == 1:
        return v.ty.shape == (replicas, w) and (a, b) == (0, replicas * w)
    return axis == 0 and v.ty.ndim == 1


def _nodes(scatter, update: list, multi, offsets, lengths, params, wholes, width,
           names) -> list:
    """The fused nodes: one per group of members, replicas x members <= 16."""
    replicas, n = len(update), len(offsets)
    kept = multi.k - 1
    per_node = max(1, MAX_TENSORS_PER_NODE // replicas)
    nodes = []
    for first in range(0, n, per_node):
        js = range(first, min(n, first + per_node))
        ins, outs = list(scatter.inputs), []
        for k, u in enumerate(update):
            for j in js:
                ins += [params[k][j], *u.inputs[j * multi.k + 1:j * multi.k + kept]]
                outs += [wholes[k][j], *u.outputs[j * multi.outs + 1:(j + 1) * multi.outs]]
            ins += u.inputs[n * multi.k:]
        node_params = dict(update[0].params, update=update[0].op.name, n=len(js),
                           reduce=dict(scatter.params)["op"], replicas=replicas, width=width,
                           offsets=tuple(offsets[j] for j in js),
                           lengths=tuple(lengths[j] for j in js),
                           variables=tuple(names[j] for j in js),
                           members=(scatter.op.name, update[0].op.name, "host_all_gather"))
        nodes.append(Eqn(host_sharded_update_p, tuple(ins), tuple(outs),
                         tuple(sorted(node_params.items())), device=scatter.device,
                         scope=update[0].scope, source=update[0].source))
    return nodes


def _variable_name(index: _Index, v, j: int) -> str:
    """The name of the variable whose read v is (for the views), else tensor<j>."""
    i = index.made_by(v, read_var_p)
    ref = dict(index.g.eqns[i].params).get("var") if i is not None else None
    return getattr(ref, "name", f"tensor{j}")


def _without_dead(eqns: list, candidates: set, results) -> list:
    """`eqns` ((index, eqn) pairs) less the candidates none of whose outputs anyone reads."""
    while True:
        read = {v for _, e in eqns for v in e.inputs if isinstance(v, Var)}
        read |= {v for v in results if isinstance(v, Var)}
        dead = {i for i, e in eqns if i in candidates and not any(v in read for v in e.outputs)}
        if not dead:
            return eqns
        eqns = [(i, e) for i, e in eqns if i not in dead]
