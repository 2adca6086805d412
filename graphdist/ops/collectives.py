"""Cross-replica ops of the logical (one-replica, SPMD) graph. The replication pass joins
each into one N-way node, which passes/collectives.py lowers into what runs (copies and
adds, or one fused node) as the strategy's cross-device ops say; on a single replica they
are the identity.

vjp rules: the cotangent of all_reduce[op=sum] is an all_reduce[op=sum] of the incoming
cotangents (mean: a mean); broadcast's is a sum back to the source, which in SPMD form is
again an all_reduce[op=sum].
"""

from __future__ import annotations

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

# every replica's value, concatenated along axis 0 in replica order (n x its rows): how
# sparse gradients cross replicas (distribute/sparse.py). `n` is the replica count, so the
# logical graph knows the gathered shape.
all_gather_p = Op("all_gather", collective=True, num_outputs=None, differentiable=False)


@all_gather_p.def_shape
def _all_gather_shape(*xs, n):
    _same_types("all_gather", xs)
    if xs[0].ndim == 0:
        raise ValueError(f"all_gather: cannot concatenate scalars ({xs[0]}); reshape to 1-D")
    return (ArrayType((n * xs[0].shape[0],) + xs[0].shape[1:], xs[0].dtype),) * len(xs)


all_gather_p.def_impl(lambda xp, x, *, n: (xp.concatenate([x] * n),))
all_gather_p.def_cost(lambda ins, outs, **_: (0, sum(t.nbytes for t in outs)))

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


def all_gather(x, n: int):
    """Every replica's `x` (each of the same shape), concatenated in replica order."""
    return bind(all_gather_p, x, n=int(n))[0]


def broadcast(x, source: int = 0):
    return bind(broadcast_p, x, source=int(source))[0]


replica_id_p = Op("replica_id", differentiable=False)  # replication makes it a per-device constant
replica_id_p.def_shape(lambda: ArrayType((), np.dtype("int32")))
replica_id_p.def_impl(lambda xp: xp.asarray(0, dtype=np.int32))


def replica_id():
    return bind(replica_id_p)
