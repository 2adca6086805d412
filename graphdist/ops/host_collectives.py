"""Fused host collectives: one placed node that reads every replica's host buffer and writes
every replica's result in one parallel pass (the CPU counterpart of an NCCL node). Made by
the "host" lowering of the collectives (passes/collectives/), never by user code. What
runs host_all_reduce on CPU devices, a parallel Numba kernel, is in
runtime/kernel_table.py; host_all_gather and host_reduce_scatter run their numpy out=
forms.
"""

from __future__ import annotations

from graphdist.ir.types import ArrayType
from graphdist.ops.collectives import reduce_types
from graphdist.ops.core import Op

# inputs: one flat buffer per replica (each on its device); outputs: one result per replica,
# each a Var on its replica's device, all written by the eqn's device.
host_all_reduce_p = Op("host_all_reduce", collective=True, num_outputs=None,
                       differentiable=False)


host_all_reduce_p.def_shape(lambda *xs, op: reduce_types("host_all_reduce", xs, op))


@host_all_reduce_p.def_impl
def _host_all_reduce_impl(xp, *xs, op):   # xs: n x (size,)
    acc = xs[0].copy()
    for x in xs[1:]:                      # replica order, as the kernel adds
        acc += x
    if op == "mean":
        acc /= acc.dtype.type(len(xs))
    return tuple(acc.copy() for _ in xs)  # every replica owns its result


@host_all_reduce_p.def_out(may_alias=True)   # outs[k] may be xs[k]: chunk-wise in place
def _host_all_reduce_out(xp, outs, *xs, op):   # outs: n x (size,), one per replica
    acc = outs[0]                               # a few passes over buffers still in cache
    xp.copyto(acc, xs[0])
    for x in xs[1:]:
        xp.add(acc, x, out=acc)
    if op == "mean":
        xp.divide(acc, acc.dtype.type(len(xs)), out=acc)
    for out in outs[1:]:
        xp.copyto(out, acc)


host_all_reduce_p.def_cost(lambda ins, outs, **_: (sum(t.size for t in ins),
                                                   2 * sum(t.nbytes for t in ins)))


def host_all_reduce_ref(xs, op: str = "sum"):
    """The spec the kernel matches: the sum (or mean) of `xs` added in list order, one copy
    per input.

    >>> import numpy as np; host_all_reduce_ref([np.ones(2), np.ones(2)])[1]
    array([2., 2.])
    """
    import numpy as np

    return _host_all_reduce_impl(np, *xs, op=op)


# ---------------------------------------------------------------- all-gather
# inputs: one value per replica (the same type); outputs: every replica's concatenation of
# all of them in replica order (n x the rows), each written once, straight from the sources
host_all_gather_p = Op("host_all_gather", collective=True, num_outputs=None,
                       differentiable=False)


@host_all_gather_p.def_shape
def _host_all_gather_shape(*xs):
    """Rows add up: values of one type, or flat parts of different lengths (the unpadded
    shards of one value)."""
    from graphdist.ops.collectives import all_gather_p

    if all(x == xs[0] for x in xs) or any(x.ndim != 1 or x.dtype != xs[0].dtype for x in xs):
        return all_gather_p.shape_rule(*xs, n=len(xs))
    return (ArrayType((sum(x.shape[0] for x in xs),), xs[0].dtype),) * len(xs)


host_all_gather_p.def_impl(lambda xp, *xs: tuple(xp.concatenate(xs) for _ in xs))


@host_all_gather_p.def_out
def _host_all_gather_out(xp, outs, *xs):
    for out in outs:
        # the planner may hand over the storage the result flows into through a reshape
        # (a parameter of another shape, all-gathered by zero_stage > 0): fill it flat
        xp.concatenate(xs, out=out if out.ndim == xs[0].ndim else out.reshape(-1))


host_all_gather_p.def_cost(lambda ins, outs, **_: (0, sum(t.nbytes for t in outs)))


# ---------------------------------------------------------------- reduce-scatter
# inputs: one flat buffer per replica; outputs: each replica's padded shard (its near-equal
# chunk of the sum in replica order, zeros after it: ops/collectives.py), each written
# once: the part of a host_all_reduce that a sharded update reads
host_reduce_scatter_p = Op("host_reduce_scatter", collective=True, num_outputs=None,
                           differentiable=False)


@host_reduce_scatter_p.def_shape
def _host_reduce_scatter_shape(*xs, op):
    from graphdist.ops.collectives import reduce_scatter_p

    return reduce_scatter_p.shape_rule(*xs, op=op, n=len(xs))


@host_reduce_scatter_p.def_impl
def _host_reduce_scatter_impl(xp, *xs, op):
    from graphdist.ops.collectives import reduce_scatter_p

    return reduce_scatter_p.impl(xp, *xs, op=op, n=len(xs))


@host_reduce_scatter_p.def_out(may_alias=True)   # outs[k] may alias xs[k]: read first
def _host_reduce_scatter_out(xp, outs, *xs, op):
    """Each chunk summed in replica order on its own (no full-size buffer), then written
    with its padding into its output."""
    from graphdist.ops.collectives import shard_offsets

    outs = outs if isinstance(outs, tuple) else (outs,)
    at = shard_offsets(xs[0].size, len(xs))
    flats = [x.reshape(-1) for x in xs]
    sums = []
    for k in range(len(outs)):
        part = slice(at[k], at[k + 1])
        acc = flats[0][part].copy()
        for x in flats[1:]:
            xp.add(acc, x[part], out=acc)
        if op == "mean":
            xp.divide(acc, acc.dtype.type(len(xs)), out=acc)
        sums.append(acc)
    for out, acc in zip(outs, sums):     # after every read: an output may be an input
        out[:acc.size] = acc
        out[acc.size:] = 0


host_reduce_scatter_p.def_cost(lambda ins, outs, **_: (sum(t.size for t in ins),
                                                       sum(t.nbytes for t in ins + outs)))


# ---------------------------------------------------------------- all-reduce + update
# Made by passes/fuse.py (fuse_reduce_update) on host devices: a host_all_reduce whose
# results only feed, as views, the multi-tensor optimizer update of every replica becomes
# one node. Inputs: the R flat buckets, then per replica the update's inputs without the
# gradients (p, m[, v] per tensor, then the shared float64 hyper-parameter vector). Outputs:
# every replica's update outputs, each written in place over its input. params: the update's
# own (op name in `update`, n, nesterov), the reduction (`reduce`), the tensors' `offsets`
# in the bucket, and `replicas`.
host_reduce_update_p = Op("host_reduce_update", collective=True, num_outputs=None,
                          differentiable=False)


def update_parts(params: dict):
    """(multi-update op, per-tensor inputs kept (all but the gradient), inputs per replica)."""
    from graphdist.ops.core import OPS

    multi = OPS[params["update"]].multi_tensor
    kept = multi.k - 1
    return multi, kept, params["n"] * kept + multi.shared


def _replica_inputs(ins, params: dict):
    """Each replica's update inputs, with placeholders (None) where the gradients go."""
    _, kept, per = update_parts(params)
    r, n = params["replicas"], params["n"]
    rest = ins[r:]
    out = []
    for k in range(r):
        chunk = rest[k * per:(k + 1) * per]
        full = []
        for j in range(n):
            full += list(chunk[j * kept:(j + 1) * kept]) + [None]
        out.append(full + list(chunk[n * kept:]))
    return out


def _update_params(params: dict) -> dict:
    drop = {"update", "reduce", "offsets", "replicas"}
    return {k: v for k, v in params.items() if k not in drop}


@host_reduce_update_p.def_shape
def _reduce_update_shape(*ins, **params):
    multi = update_parts(params)[0]
    reduce_types("host_reduce_update", ins[:params["replicas"]], params["reduce"])
    outs = []
    for full in _replica_inputs(ins, params):
        grads_like = [full[j * multi.k] for j in range(params["n"])]   # p's type
        typed = [grads_like[i // multi.k] if t is None else t for i, t in enumerate(full)]
        outs += multi.op.out_types(*typed, **_update_params(params))
    return tuple(outs)


@host_reduce_update_p.def_impl
def _reduce_update_impl(xp, *ins, **params):
    """The reference: the all-reduce, then each replica's update on views of its result."""
    multi, kept, _ = update_parts(params)
    r = params["replicas"]
    total = _host_all_reduce_impl(xp, *ins[:r], op=params["reduce"])
    outs = []
    for k, full in enumerate(_replica_inputs(ins, params)):
        args = list(full)
        for j, offset in enumerate(params["offsets"]):
            p = full[j * multi.k]
            args[j * multi.k + kept] = total[k][offset:offset + p.size].reshape(p.shape)
        outs += list(multi.op.impl(xp, *args, **_update_params(params)))
    return tuple(outs)


def reduce_update_inplace(params) -> dict:
    params = dict(params)
    multi, kept, per = update_parts(params)
    r, n = params["replicas"], params["n"]
    return {k * n * multi.outs + j * multi.outs + o: r + k * per + j * kept + o
            for k in range(r) for j in range(n) for o in range(multi.outs)}


host_reduce_update_p.inplace = reduce_update_inplace
host_reduce_update_p.def_cost(lambda ins, outs, **_: (sum(t.size for t in outs),
                                                      sum(t.nbytes for t in ins + outs)))


def update_inputs(ins, update: str, replicas: int, n: int):
    """A host_reduce_update node's inputs as its kernel takes them: the R buckets, one list
    per kept input kind (p, m[, v]) over every replica's tensors, and each replica's hyper
    vector."""
    params = {"update": update, "replicas": replicas, "n": n}
    multi, kept, _ = update_parts(params)
    lists = [[] for _ in range(kept)]
    hypers = []
    for full in _replica_inputs(ins, params):
        for j in range(n):
            for q in range(kept):
                lists[q].append(full[j * multi.k + q])
        hypers += full[n * multi.k:]
    return ins[:replicas], lists, hypers
