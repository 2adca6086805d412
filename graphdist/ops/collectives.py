"""Cross-replica ops of the logical (one-replica, SPMD) graph. The replication pass joins
each into one N-way node, which passes/collectives/ lowers into what runs (copies and
adds, or one fused node) as the strategy's cross-device ops say; on a single replica they
are the identity.

vjp rules: the cotangent of all_reduce[op=sum] is an all_reduce[op=sum] of the incoming
cotangents (mean: a mean); broadcast's is a sum back to the source, which in SPMD form is
again an all_reduce[op=sum]; reduce_scatter's is an all_gather of the shards' cotangents
(divided by n for a mean) and all_gather's a reduce_scatter[op=sum] of its cotangent.

Shards (reduce_scatter's results, all_gather(total=)'s inputs): the flattened value cut into
n contiguous near-equal chunks, the first ones one larger (`shard_sizes`, as the data split
and the ring's segments cut); replica r holds chunk r, padded at its end with zeros to
`shard_length` = ceil(size / n) elements, so that every replica's shard has the same static
shape and the step is traced once for all of them. all_gather(shard, n, total=size) drops
the padding. A chunk may be empty (a value of fewer elements than replicas): all padding.
"""

from __future__ import annotations

import math

import numpy as np

from graphdist.ir.types import ArrayType
from graphdist.ops.core import Op, Symbolic, bind, current_tracer, require_float, run_eagerly

REDUCE_OPS = ("sum", "mean")

# In the logical graph a collective has one input and one output (this replica's); after
# replication it stands for a moment as one eqn with one input and output per device.

def _same_types(name: str, xs):
    for x in xs[1:]:
        if x != xs[0]:
            raise ValueError(f"{name}: replicas disagree: {xs[0]} vs {x}")
    return tuple(xs)


all_reduce_p = Op("all_reduce", collective=True, num_outputs=None)


def reduce_types(name: str, xs, op: str) -> tuple:
    """The shape rule every all-reduce shares: one type per replica, all equal."""
    if op not in REDUCE_OPS:
        raise ValueError(f"{name}: op must be one of {REDUCE_OPS}, got {op!r}")
    if op == "mean":
        require_float(f"{name}[op=mean]", xs[0])
    return _same_types(name, xs)


all_reduce_p.def_shape(lambda *xs, op: reduce_types("all_reduce", xs, op))


all_reduce_p.def_impl(lambda xp, x, *, op: (x,))
all_reduce_p.def_vjp(lambda cts, x, *, op: (all_reduce(cts[0], op),))
all_reduce_p.def_cost(lambda ins, outs, **_: (sum(t.size for t in ins),
                                              2 * sum(t.nbytes for t in ins)))

broadcast_p = Op("broadcast", collective=True, num_outputs=None)  # source replica's value
broadcast_p.def_shape(lambda *xs, source: _same_types("broadcast", xs))
broadcast_p.def_impl(lambda xp, x, *, source: (x,))
broadcast_p.def_vjp(lambda cts, x, *, source: (all_reduce(cts[0], "sum"),))
broadcast_p.def_cost(lambda ins, outs, **_: (0, sum(t.nbytes for t in ins)))

def shard_sizes(size: int, n: int) -> list[int]:
    """Sizes of the n contiguous near-equal chunks of `size` elements, the first ones one
    larger: what replica r's shard of a reduce_scatter holds before its padding.

    >>> shard_sizes(10, 4)
    [3, 3, 2, 2]
    """
    q, r = divmod(int(size), int(n))
    return [q + (i < r) for i in range(int(n))]


def shard_offsets(size: int, n: int) -> list[int]:
    """Where each replica's chunk starts in the flattened value (n + 1 entries: the last is
    `size`)."""
    out = [0]
    for s in shard_sizes(size, n):
        out.append(out[-1] + s)
    return out


def shard_length(size: int, n: int) -> int:
    """Every replica's shard length: the largest chunk, ceil(size / n)."""
    return -(-int(size) // int(n))


def _check_replicas(name: str, n) -> int:
    if int(n) < 1:
        raise ValueError(f"{name}: n (the replica count) must be >= 1, got {n}")
    return int(n)


# every replica's value, concatenated along axis 0 in replica order (n x its rows): how
# sparse gradients cross replicas (distribute/sparse.py). `n` is the replica count, so the
# logical graph knows the gathered shape. With `total`, every replica holds its padded
# shard of a flat value of `total` elements (as reduce_scatter leaves it) and every
# replica gets the whole value back, the padding dropped.
all_gather_p = Op("all_gather", collective=True, num_outputs=None)


@all_gather_p.def_shape
def _all_gather_shape(*xs, n, total=None):
    _check_replicas("all_gather", n)
    _same_types("all_gather", xs)
    if total is None:
        if xs[0].ndim == 0:
            raise ValueError(f"all_gather: cannot concatenate scalars ({xs[0]}); reshape to 1-D")
        return (ArrayType((n * xs[0].shape[0],) + xs[0].shape[1:], xs[0].dtype),) * len(xs)
    if xs[0].shape != (shard_length(total, n),):
        raise ValueError(f"all_gather(total={total}, n={n}): a replica holds {xs[0]}; "
                         f"expected its flat shard of {shard_length(total, n)} elements "
                         "(as reduce_scatter leaves it)")
    return (ArrayType((int(total),), xs[0].dtype),) * len(xs)


def unpadded(xp, shards, n: int, total: int):
    """The flat value of `total` elements from every replica's padded shard, in order."""
    sizes = shard_sizes(total, n)
    return xp.concatenate([s[:size] for s, size in zip(shards, sizes)])


@all_gather_p.def_impl
def _all_gather_impl(xp, *xs, n, total=None):
    """Every output is the inputs concatenated in replica order; a lone input (an eager
    call, one replica) stands for every replica."""
    parts = list(xs) if len(xs) == n else [xs[0]] * n
    out = xp.concatenate(parts) if total is None else unpadded(xp, parts, n, total)
    return tuple(out.copy() for _ in xs)


@all_gather_p.def_vjp
def _all_gather_vjp(cts, x, *, n, total=None):
    """Replica r's value reaches every replica at its rows: its cotangent is the sum of
    every replica's cotangent at those rows: a reduce_scatter (zero on the padding)."""
    from graphdist.ops.array import reshape

    return (reshape(reduce_scatter(cts[0], "sum", n), x.shape),)


all_gather_p.def_cost(lambda ins, outs, **_: (0, sum(t.nbytes for t in outs)))

# each replica's shard (padded flat near-equal chunk: `shard_sizes`, `shard_length`) of the
# sum (or mean) of every replica's value: the first half of a ring all-reduce, what
# sharded optimizer state reads its gradients with. `n`: the replica count.
reduce_scatter_p = Op("reduce_scatter", collective=True, num_outputs=None)


@reduce_scatter_p.def_shape
def _reduce_scatter_shape(*xs, op, n):
    _check_replicas("reduce_scatter", n)
    reduce_types("reduce_scatter", xs, op)
    return (ArrayType((shard_length(xs[0].size, n),), xs[0].dtype),) * len(xs)


def padded_shards(xp, total, n: int, first: int = 0, count: int | None = None) -> tuple:
    """Replicas first, first + 1, ...'s padded shards of the flat `total` (count: n)."""
    at, length = shard_offsets(total.size, n), shard_length(total.size, n)
    out = []
    for r in range(first, first + (n if count is None else count)):
        shard = xp.zeros(length, total.dtype)
        shard[:at[r + 1] - at[r]] = total[at[r]:at[r + 1]]
        out.append(shard)
    return tuple(out)


@reduce_scatter_p.def_impl
def _reduce_scatter_impl(xp, *xs, op, n):
    """The sum of the inputs in replica order (a mean divides by n), cut into padded
    shards; output k is replica k's. A lone input (an eager call) is replica 0's."""
    total = xp.array(xs[0], copy=True).reshape(-1)
    for x in xs[1:]:
        total = total + x.reshape(-1)
    if op == "mean" and n > 1:
        total = total / total.dtype.type(n)
    return padded_shards(xp, total, n, 0, len(xs))


@reduce_scatter_p.def_vjp
def _reduce_scatter_vjp(cts, x, *, op, n):
    """Every replica's value adds into every shard: its cotangent is every shard's
    cotangent, gathered (divided by n for a mean) and shaped as the value."""
    from graphdist.ops.array import reshape
    from graphdist.ops.math import divide

    gathered = all_gather(cts[0], n, total=math.prod(x.shape))
    if op == "mean" and n > 1:
        gathered = divide(gathered, np.asarray(n, x.dtype))
    return (reshape(gathered, x.shape),)


reduce_scatter_p.def_cost(lambda ins, outs, **_: (sum(t.size for t in ins),
                                                  sum(t.nbytes for t in ins + outs)))

copy_p = Op("copy_to", collective=True)  # the one cross-device edge: runs on `device`
copy_p.def_shape(lambda x, *, device: x)
copy_p.def_impl(lambda xp, x, *, device: xp.array(x, copy=True))
copy_p.def_vjp(lambda ct, x, *, device: (ct,))


def all_reduce(x, op: str = "sum"):
    if not isinstance(x, Symbolic):
        return _all_reduce_constant(x, op)
    return bind(all_reduce_p, x, op=op)[0]


def _all_reduce_constant(x, op: str):
    # A constant (Python number, numpy array) holds the same value on every replica, so it is
    # reduced here, at trace time: its sum over n replicas is n times it, its mean is itself.
    # (The eager impl alone would be the one-replica identity: a silent 1.0 for 2.0.)
    (x,) = run_eagerly(all_reduce_p, (x,), {"op": op})     # the same op and dtype checks
    strategy = getattr(current_tracer(), "strategy", None)
    n = strategy.num_replicas_in_sync if strategy is not None else 1
    if op != "sum" or n == 1:
        return x
    return np.asarray(np.sum(np.broadcast_to(x, (n, *x.shape)), axis=0, dtype=x.dtype))


def all_gather(x, n: int, total: int | None = None):
    """Every replica's `x` (each of the same shape), concatenated in replica order; with
    `total`, each replica's `x` is its padded flat shard of a value of `total` elements (as
    reduce_scatter leaves it) and every replica gets the whole flat value."""
    if total is None:
        return bind(all_gather_p, x, n=int(n))[0]
    return bind(all_gather_p, x, n=int(n), total=int(total))[0]


def reduce_scatter(x, op: str = "sum", n: int = 1):
    """This replica's shard of the sum (or mean) over the n replicas of `x`: the flattened
    result cut into n contiguous near-equal chunks, the first ones one larger; replica r
    gets chunk r (`shard_sizes`), padded with zeros to ceil(size / n) elements
    (`shard_length`). all_gather(shard, n, total=x.size) inverts it."""
    return bind(reduce_scatter_p, x, op=op, n=int(n))[0]


def broadcast(x, source: int = 0):
    return bind(broadcast_p, x, source=int(source))[0]


# replication makes it a per-device constant: never folded before that
replica_id_p = Op("replica_id", differentiable=False, foldable=False)
replica_id_p.def_shape(lambda: ArrayType((), np.dtype("int32")))
replica_id_p.def_impl(lambda xp: xp.asarray(0, dtype=np.int32))


def replica_id():
    return bind(replica_id_p)
