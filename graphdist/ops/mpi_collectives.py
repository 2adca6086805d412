"""Collectives across worker processes (MultiWorkerMirroredStrategy): one placed node per
collective that reads this worker's replicas' buffers, works with the other workers through
MPI, and writes every local replica's result. Made by the "mpi" lowering
(passes/collectives/). `group` is the process group (graphdist/device/mpi.py), held as a
parameter: these impls call its methods and import nothing of MPI.

The sums are deterministic: this worker's replicas are added in replica order, then the
workers' partial sums by MPI (in rank order for two workers, commutative otherwise), and
every worker and replica receives the same bits.
"""

from __future__ import annotations

from graphdist.ir.types import ArrayType
from graphdist.ops.collectives import REDUCE_OPS, _same_types
from graphdist.ops.core import Op


def _local_sum(xp, xs):
    acc = xp.array(xs[0], copy=True).reshape(-1)
    for x in xs[1:]:
        acc += x.reshape(-1)
    return acc


# inputs: one value per local replica; outputs: one per local replica. params: `op`,
# `group`, `replicas` (every worker's), written by the node's device.
mpi_all_reduce_p = Op("mpi_all_reduce", collective=True, num_outputs=None,
                      differentiable=False)


@mpi_all_reduce_p.def_shape
def _mpi_all_reduce_shape(*xs, op, group, replicas):
    if op not in REDUCE_OPS:
        raise ValueError(f"mpi_all_reduce: op must be one of {REDUCE_OPS}, got {op!r}")
    return _same_types("mpi_all_reduce", xs)


@mpi_all_reduce_p.def_impl
def _mpi_all_reduce_impl(xp, *xs, op, group, replicas):
    """New arrays (a result handed to the caller), written as the out= form writes them:
    MPI reads a lone replica's value where it lies, with no copy first."""
    outs = tuple(xp.empty(x.shape, x.dtype) for x in xs)
    _mpi_all_reduce_out(xp, outs, *xs, op=op, group=group, replicas=replicas)
    return outs


@mpi_all_reduce_p.def_out(may_alias=True)     # outs[k] may be xs[k]: read before written
def _mpi_all_reduce_out(xp, outs, *xs, op, group, replicas):
    """Into the step's own buffers (reused every step: no fresh 16 MiB allocation to fault
    in). One local replica: MPI sums its value straight into the first output (in place
    when that is the value's own, dying, buffer); several: their sum, added into the first
    output, is all-reduced there in place. A copy of the input first cost 40-55% over a
    bare comm.Allreduce(x, out) of 16 MiB between 2 workers."""
    outs = outs if isinstance(outs, tuple) else (outs,)
    acc = outs[0].reshape(-1)
    what = f"an all-reduce of {ArrayType(xs[0].shape, xs[0].dtype)}"
    if len(xs) == 1 and not xp.may_share_memory(acc, xs[0]):
        group.allreduce(acc, what, send=xs[0].reshape(-1))
    else:
        if len(xs) > 1:
            xp.add(xs[0].reshape(-1), xs[1].reshape(-1), out=acc)
        for x in xs[2:]:
            xp.add(acc, x.reshape(-1), out=acc)
        group.allreduce(acc, what)
    if op == "mean":
        xp.divide(acc, acc.dtype.type(replicas), out=acc)
    for out in outs[1:]:
        xp.copyto(out, acc.reshape(out.shape))


mpi_all_reduce_p.def_cost(lambda ins, outs, **_: (sum(t.size for t in ins),
                                                  2 * sum(t.nbytes for t in ins)))

# inputs: one value per local replica; outputs: each local replica's padded shard (its
# near-equal chunk of the flattened sum over every worker's replicas, zeros after it: see
# ops/collectives.py). params: `first` (this worker's first global replica), `group`,
# `op`, `replicas`.
mpi_reduce_scatter_p = Op("mpi_reduce_scatter", collective=True, num_outputs=None,
                          differentiable=False)


@mpi_reduce_scatter_p.def_shape
def _mpi_reduce_scatter_shape(*xs, first, group, op, replicas):
    from graphdist.ops.collectives import reduce_scatter_p

    return reduce_scatter_p.shape_rule(*xs, op=op, n=replicas)


@mpi_reduce_scatter_p.def_impl
def _mpi_reduce_scatter_impl(xp, *xs, first, group, op, replicas):
    """The local sum all-reduced between the workers (the bits of mpi_all_reduce), each
    local replica's shard cut from it: every worker holds the same sum, so a shard does
    not depend on which worker cuts it. (MPI's Reduce_scatter would move half the bytes;
    this keeps the group's one checked, abortable collective.)"""
    from graphdist.ops.collectives import padded_shards

    acc = _local_sum(xp, xs)
    group.allreduce(acc, f"a reduce-scatter of {ArrayType(xs[0].shape, xs[0].dtype)}")
    if op == "mean":
        acc /= acc.dtype.type(replicas)
    return padded_shards(xp, acc, replicas, first, len(xs))


@mpi_reduce_scatter_p.def_out
def _mpi_reduce_scatter_out(xp, outs, *xs, first, group, op, replicas):
    """Into the step's own buffers: `post_reduce_scatter`, then its finish at once."""
    post_reduce_scatter(xp, outs, xs, first=first, group=group, op=op, replicas=replicas)()


def post_reduce_scatter(xp, outs, xs, *, first, group, op, replicas):
    """Start the reduce-scatter of `xs` into `outs` and return finish(), which waits for it
    and completes `outs` (the overlapped reduce-scatter, runtime/overlap.py, calls it where
    the shards are first read). With two workers, where any order of adding the two
    partial sums gives the same bits, and shards that tile the value exactly (the buckets
    of zero_stage > 0): one Reduce_scatter_block straight from this worker's sum (its lone
    replica's buffer, no copy) into its replicas' shards, half the bytes of the all-reduce.
    Otherwise the impl's all-reduce of the local sum, then its shards."""
    outs = outs if isinstance(outs, tuple) else (outs,)
    size, local, length = xs[0].size, len(xs), outs[0].size
    what = f"a reduce-scatter of {ArrayType(xs[0].shape, xs[0].dtype)}"
    if group.size != 2 or size != replicas * length or replicas != group.size * local:
        acc = _local_sum(xp, xs)
        request = group.post_allreduce(acc)

        def finish_shards():
            from graphdist.ops.collectives import padded_shards

            if request is not None:
                group.wait_for(request, what)
            if op == "mean":
                xp.divide(acc, acc.dtype.type(replicas), out=acc)
            for out, shard in zip(outs, padded_shards(xp, acc, replicas, first, local)):
                xp.copyto(out, shard)
        return finish_shards
    mine = outs[0] if local == 1 else xp.empty(local * length, xs[0].dtype)
    send = xp.ascontiguousarray(xs[0]).reshape(-1) if local == 1 else _local_sum(xp, xs)
    request = group.post_reduce_scatter(send, mine.reshape(-1))

    def finish():
        if request is not None:
            group.wait_for(request, what)
        if op == "mean":
            xp.divide(mine, mine.dtype.type(replicas), out=mine)
        for k, out in enumerate(outs[1:], 1):
            xp.copyto(out, mine[k * length:(k + 1) * length])
        if local > 1:
            xp.copyto(outs[0], mine[:length])
    return finish


mpi_reduce_scatter_p.def_cost(lambda ins, outs, **_: (sum(t.size for t in ins),
                                                      2 * sum(t.nbytes for t in ins)))

mpi_broadcast_p = Op("mpi_broadcast", collective=True, num_outputs=None, differentiable=False)


@mpi_broadcast_p.def_shape
def _mpi_broadcast_shape(*xs, source, group, first, local):
    return _same_types("mpi_broadcast", xs)


@mpi_broadcast_p.def_impl
def _mpi_broadcast_impl(xp, *xs, source, group, first, local):
    """Every replica gets replica `source`'s value (a global replica index): its worker
    sends it, the others receive."""
    here = first <= source < first + local
    buf = xp.array(xs[source - first] if here else xs[0], copy=True)
    group.bcast(buf, source // local, f"a broadcast from replica {source}")
    return tuple(buf.copy() for _ in xs)


mpi_broadcast_p.def_cost(lambda ins, outs, **_: (0, sum(t.nbytes for t in outs)))

mpi_all_gather_p = Op("mpi_all_gather", collective=True, num_outputs=None,
                      differentiable=False)


@mpi_all_gather_p.def_shape
def _mpi_all_gather_shape(*xs, group, replicas, rows=None):
    """`rows`: every global replica's valid rows when the inputs are padded shards (the
    rest is padding, dropped); None: all of every replica's rows."""
    _same_types("mpi_all_gather", xs)
    gathered = replicas * xs[0].shape[0] if rows is None else sum(rows)
    return (ArrayType((gathered,) + xs[0].shape[1:], xs[0].dtype),) * len(xs)


@mpi_all_gather_p.def_impl
def _mpi_all_gather_impl(xp, *xs, group, replicas, rows=None):
    """Every replica's rows, in global replica order: this worker's replicas concatenated,
    then the workers' blocks in rank order (each replica's padding cut off with `rows`)."""
    mine = xp.concatenate(xs)
    out = xp.empty((replicas * xs[0].shape[0],) + xs[0].shape[1:], xs[0].dtype)
    group.allgather(mine, out, f"an all-gather of {len(xs)} x {ArrayType(xs[0].shape, xs[0].dtype)}")
    if rows is not None:
        length = xs[0].shape[0]
        out = xp.concatenate([out[r * length:r * length + rows[r]] for r in range(replicas)])
    return tuple(out.copy() for _ in xs)


@mpi_all_gather_p.def_out
def _mpi_all_gather_out(xp, outs, *xs, group, replicas, rows=None):
    """Into the step's own buffers (the planner may hand over the storage of a parameter
    the result flows into through a reshape, as zero_stage > 0 all-gathers them: filled
    flat). A lone replica's value is sent from where it lies, straight into the first
    output, when no padding is dropped."""
    outs = outs if isinstance(outs, tuple) else (outs,)
    flat = [out if out.ndim == xs[0].ndim else out.reshape(-1) for out in outs]
    length = xs[0].shape[0]
    whole = rows is None or all(r == length for r in rows)
    if whole and len(xs) == 1:
        group.allgather(xp.ascontiguousarray(xs[0]), flat[0], f"an all-gather of 1 x "
                                         f"{ArrayType(xs[0].shape, xs[0].dtype)}")
    else:
        for k, value in enumerate(_mpi_all_gather_impl(xp, *xs, group=group,
                                                       replicas=replicas, rows=rows)[:1]):
            xp.copyto(flat[k], value)
    for out in flat[1:]:
        xp.copyto(out, flat[0])


mpi_all_gather_p.def_cost(lambda ins, outs, **_: (0, sum(t.nbytes for t in outs)))
