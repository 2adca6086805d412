"""Cross-replica ops of the logical (one-replica, SPMD) graph. The replication pass lowers
each into per-device copies and adds through the strategy's cross-device ops; on a single
replica they are the identity.

vjp rules: the cotangent of all_reduce[op=sum] is an all_reduce[op=sum] of the incoming
cotangents (mean: a mean); broadcast's is a sum back to the source, which in SPMD form is
again an all_reduce[op=sum].
"""

from __future__ import annotations

import numpy as np

from graphdist.ir.types import ArrayType
from graphdist.ops.core import Op, bind, require_float

REDUCE_OPS = ("sum", "mean")

all_reduce_p = Op("all_reduce", collective=True)


@all_reduce_p.def_shape
def _all_reduce_shape(x, *, op):
    if op not in REDUCE_OPS:
        raise ValueError(f"all_reduce: op must be one of {REDUCE_OPS}, got {op!r}")
    if op == "mean":
        require_float("all_reduce[op=mean]", x)
    return x


all_reduce_p.def_impl(lambda xp, x, *, op: x)
all_reduce_p.def_vjp(lambda ct, x, *, op: (all_reduce(ct, op),))
all_reduce_p.def_cost(lambda ins, outs, **_: (ins[0].size, 2 * ins[0].nbytes))

broadcast_p = Op("broadcast", collective=True)   # the source replica's value, everywhere
broadcast_p.def_shape(lambda x, *, source: x)
broadcast_p.def_impl(lambda xp, x, *, source: x)
broadcast_p.def_vjp(lambda ct, x, *, source: (all_reduce(ct, "sum"),))
broadcast_p.def_cost(lambda ins, outs, **_: (0, ins[0].nbytes))


def all_reduce(x, op: str = "sum"):
    return bind(all_reduce_p, x, op=op)


def broadcast(x, source: int = 0):
    return bind(broadcast_p, x, source=int(source))


replica_id_p = Op("replica_id", differentiable=False)  # replication makes it a per-device constant
replica_id_p.def_shape(lambda: ArrayType((), np.dtype("int32")))
replica_id_p.def_impl(lambda xp: xp.asarray(0, dtype=np.int32))


def replica_id():
    return bind(replica_id_p)
