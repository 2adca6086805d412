"""The sharded update of zero_stage > 0 as one node, for replicas that share one host: a
bucket's reduce-scatter, every replica's update of its shard and the all-gather of the
parameters (graphdist/optimizers/zero.py emits them apart; passes/fuse_zero.py joins them
on logical CPU devices run as one program). The stage-1 counterpart of host_reduce_update.

Layout (optimizers/zero.py): replica k's gradient bucket is the (R, width) matrix whose row r
holds every member's chunk r side by side, member j at column `offsets[j]`, `lengths[j]`
(L_j = ceil(size_j / R)) wide; replica r owns the flat elements [r L_j, (r + 1) L_j) of
member j, padded with zeros past its size, and holds the shards of its slots.

Inputs: the R buckets, then per replica the update's inputs without the gradients (per
member its full parameter and its slot shards, then the shared float64 hyper vector).
Outputs: per replica, per member, the full parameter and the slot shards, each written in
place over its input. For chunk r of member j the node sums the R buckets' row r in replica
order (then / R for a mean), updates replica r's chunk of its parameter and its slot shards
with replica r's hyper vector (the multi-tensor update's own formula), and writes the new
chunk into every replica's parameter: the reduce-scatter + update + all-gather, with no
intermediate buffer. params: the update's own (`update`: the multi-tensor op's name, n,
nesterov), `reduce`, `replicas`, `width`, `offsets`, `lengths`, `variables` (their names)
and `members` (the ops it replaced, as every fused node lists them for the views).
"""

from __future__ import annotations

from graphdist.ops.collectives import reduce_types
from graphdist.ops.core import Op
from graphdist.ops.host_collectives import reduce_update_inplace, update_parts

host_sharded_update_p = Op("host_reduce_scatter_update_all_gather", collective=True,
                           num_outputs=None, differentiable=False)

LAYOUT = ("replicas", "width", "offsets", "lengths", "variables", "members", "reduce",
          "update")


def replica_groups(ins, params: dict) -> list:
    """Per replica: ([per member: (parameter, *slot shards)], shared inputs)."""
    multi, kept, per = update_parts(params)
    r, n = params["replicas"], params["n"]
    out = []
    for k in range(r):
        chunk = ins[r + k * per:r + (k + 1) * per]
        out.append(([tuple(chunk[j * kept:(j + 1) * kept]) for j in range(n)],
                    tuple(chunk[n * kept:])))
    return out


def update_params(params: dict) -> dict:
    """The multi-tensor update's own params."""
    return {k: v for k, v in params.items() if k not in LAYOUT}


@host_sharded_update_p.def_shape
def _shape(*ins, **params):
    multi, _, per = update_parts(params)
    r = params["replicas"]
    if len(ins) != r + r * per:
        raise ValueError(f"{host_sharded_update_p.name}: expected {r} buckets + {r} x {per} "
                         f"inputs, got {len(ins)}")
    reduce_types(host_sharded_update_p.name, ins[:r], params["reduce"])
    outs = []
    for members, _ in replica_groups(ins, params):
        for j, kept in enumerate(members):
            if kept[0].size > r * params["lengths"][j]:
                raise ValueError(f"{host_sharded_update_p.name}: member {j} "
                                 f"({params['variables'][j]}) has {kept[0].size} elements, "
                                 f"more than {r} shards of {params['lengths'][j]}")
            outs += list(kept[:multi.outs])
    return tuple(outs)


@host_sharded_update_p.def_impl
def _impl(xp, *ins, **params):
    """The reference: the reduce-scatter, each replica's update of its chunks, the
    all-gather, each step on whole arrays."""
    multi = update_parts(params)[0]
    r, width = params["replicas"], params["width"]
    total = xp.array(ins[0], copy=True).reshape(-1)
    for x in ins[1:r]:                       # replica order, as every host kernel adds
        total = total + x.reshape(-1)
    if params["reduce"] == "mean":
        total = total / total.dtype.type(r)
    groups = replica_groups(ins, params)
    outs = [[None] * params["n"] for _ in range(r)]
    for j, (offset, length) in enumerate(zip(params["offsets"], params["lengths"])):
        chunks = []
        for k, (members, shared) in enumerate(groups):
            p, *slots = members[j]
            flat = xp.zeros(r * length, p.dtype)
            flat[:p.size] = p.reshape(-1)
            g = total[k * width + offset:k * width + offset + length]
            new = multi.op.impl(xp, flat[k * length:(k + 1) * length].copy(), *slots, g,
                                *shared, **dict(update_params(params), n=1))
            new = list(new) if isinstance(new, tuple) else [new]
            chunks.append(new[0])
            outs[k][j] = new[1:]
        whole = xp.concatenate(chunks)
        for k, (members, _) in enumerate(groups):
            p = members[j][0]
            outs[k][j] = [whole[:p.size].reshape(p.shape).copy(), *outs[k][j]]
    return tuple(x for per_replica in outs for member in per_replica for x in member)


# the same inputs and outputs per replica as host_reduce_update: the same in-place map
host_sharded_update_p.inplace = reduce_update_inplace
host_sharded_update_p.def_cost(lambda ins, outs, **_: (sum(t.size for t in outs),
                                                       sum(t.nbytes for t in ins + outs)))


def kernel_inputs(ins, params: dict):
    """The node's inputs as its kernels take them: the R buckets, one list per kept input
    kind (parameter, m[, v]) over every replica's members (replica k's member j at k n + j),
    and each replica's hyper vector."""
    multi, kept, _ = update_parts(params)
    lists = [[] for _ in range(kept)]
    hypers = []
    for members, shared in replica_groups(ins, params):
        for member in members:
            for q in range(kept):
                lists[q].append(member[q])
        hypers += list(shared)
    return ins[:params["replicas"]], lists, hypers
