"""Every lowering of a collective, in one place.

The replication pass leaves each collective of the step as one N-way node (one input and
one output per device). `lower_collectives` turns each into what runs, with the lowering
the strategy's cross-device ops name (`CrossDeviceOps.lowering`, plus its options):

- "one_device": copy every replica's value to one device, add there, copy back;
- "ring": reduce-scatter then all-gather around the device ring, as copies and adds;
- "hierarchical": sum within groups, exchange between group leaders, copy back;
- "host": one fused `host_all_reduce` node for host devices (one parallel pass);
- "nccl": one `nccl_all_reduce` node between GPUs.

An all_gather (sparse gradients' rows) needs no arithmetic: copies and a concat on each
device, or one `host_all_gather` node with the "host" lowering.

Each is a plain function `(b, xs, op, devices, **options) -> one Var per device`,
registered by name, so a new one (MPI across processes) is one more function here.
Every lowering sums in a fixed order, so the same inputs give the same bits every run, and
every replica ends with the same bits (they all receive copies of one result per element).
The fusion of a host all-reduce with every replica's optimizer update that follows it is
in passes/fuse.py (`fuse_reduce_update`), the next stage of the pipeline.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from graphdist.errors import GraphError
from graphdist.ir import COLLECTIVES_SCOPE, ArrayType, Eqn, Graph, Lit, Var
from graphdist.ops import OPS
from graphdist.ir.builder import Builder

LOWERINGS: dict = {}
LOGICAL_COLLECTIVES = ("all_reduce", "broadcast", "all_gather")


def lowering(name: str):
    """Register `fn(b, xs, op, devices, **options)` as the all-reduce lowering `name`."""
    def register(fn):
        LOWERINGS[name] = fn
        return fn
    return register


def lower_collectives(g: Graph, cross_device_ops) -> Graph:
    """Replace every N-way all_reduce/broadcast/all_gather node of a replicated graph by its
    lowering."""
    if not any(e.op.name in LOGICAL_COLLECTIVES for e in g.eqns):
        return g
    b = Builder()
    rename: dict = {}

    def sub(v):
        return rename.get(v, v) if isinstance(v, Var) else v

    for eqn in g.eqns:
        ins = tuple(sub(v) for v in eqn.inputs)
        if eqn.op.name not in LOGICAL_COLLECTIVES:
            b.eqns.append(replace(eqn, inputs=ins) if ins != eqn.inputs else eqn)
            continue
        start = len(b.eqns)
        b.scope = COLLECTIVES_SCOPE
        devices = tuple(v.device for v in eqn.outputs)
        params = dict(eqn.params)
        across = cross_device_ops.lowering == "mpi"     # workers in other processes too
        if eqn.op.name == "all_reduce":
            results = lower_all_reduce(cross_device_ops, b, list(ins), params["op"], devices)
        elif eqn.op.name == "all_gather":
            results = (_mpi_node(b, list(ins), devices, "mpi_all_gather", {
                "replicas": cross_device_ops.options()["replicas"]}, cross_device_ops)
                if across else all_gather(b, list(ins), devices,
                                          cross_device_ops.lowering == "host"))
        elif across:
            opts = cross_device_ops.options()
            results = _mpi_node(b, list(ins), devices, "mpi_broadcast", {
                "source": params["source"], "first": opts["first"], "local": len(devices)},
                cross_device_ops)
        else:
            results = broadcast(b, list(ins), params["source"], devices)
        b.scope = ""
        results = _name_lowering(b, start, results, [v.hint for v in eqn.outputs])
        rename.update(zip(eqn.outputs, results))
    return replace(g, eqns=tuple(b.eqns), outputs=tuple(sub(v) for v in g.outputs))


def lower_all_reduce(cross_device_ops, b: Builder, xs: list, op: str, devices: tuple) -> list:
    """Emit into `b` the all-reduce of `xs` (one Var per device) that `cross_device_ops`
    configures; returns the result on every device."""
    fn = LOWERINGS.get(cross_device_ops.lowering)
    if fn is None:
        raise GraphError(f"no all-reduce lowering named {cross_device_ops.lowering!r} "
                         f"(have: {sorted(LOWERINGS)})")
    return fn(b, xs, op, tuple(devices), **cross_device_ops.options())


def broadcast(b: Builder, xs: list, source: int, devices: tuple) -> list:
    """Every device gets a copy of the source replica's value."""
    src = xs[source]
    return [xs[d] if d == source else copy_to(b, src, dev) for d, dev in enumerate(devices)]


def all_gather(b: Builder, xs: list, devices: tuple, host: bool = False) -> list:
    """Every replica's value on every device, concatenated in replica order. Nothing is
    added on the way, so one lowering serves every cross-device ops: each device copies the
    others' values and concatenates (n - 1 copies into each); on host devices with the
    "host" lowering, one `host_all_gather` node writes every result straight from the
    sources instead."""
    if host and len(devices) > 1:
        outs = tuple(Var(ArrayType((len(xs) * x.ty.shape[0],) + x.ty.shape[1:], x.ty.dtype),
                         None, dev) for x, dev in zip(xs, devices))
        b.eqns.append(Eqn(OPS["host_all_gather"], tuple(xs), outs, (), device=devices[0],
                          scope=b.scope))
        return list(outs)
    return [b.add1(OPS["concat"], [copy_to(b, x, dev) for x in xs], dev, axis=0)
            for dev in devices]


def _name_lowering(b: Builder, start: int, results: list, bases: list) -> list:
    """Name what a lowering made: each device's result takes the N-way node's output name
    (so the code after it reads alike on every device), temporaries `<name>.k`; otherwise
    the printer's letters for them would collide with the replicas' names."""
    final = {r: base for r, base in zip(results, bases)}
    rename, k = {}, 0
    for i in range(start, len(b.eqns)):
        eqn = b.eqns[i]
        outs = []
        for v in eqn.outputs:
            if v.hint is None:
                hint = final.get(v)
                if hint is None:
                    hint, k = f"{bases[0]}.{k}", k + 1
                rename[v] = Var(v.ty, hint, v.device)
            outs.append(rename.get(v, v))
        b.eqns[i] = replace(eqn, inputs=tuple(rename.get(v, v) if isinstance(v, Var) else v
                                              for v in eqn.inputs), outputs=tuple(outs))
    return [rename.get(r, r) for r in results]


# ---------------------------------------------------------------- building blocks


def finish_mean(b: Builder, total: Var, n: int, device: str, op: str) -> Var:
    """Mean = sum / n, divided (not multiplied by 1/n) as the reduce kernels do."""
    if op == "sum" or n == 1:
        return total
    return b.add1(OPS["div"], [total, _lit(n, total)], device)


def _lit(value, like: Var):
    return Lit(np.asarray(value, dtype=like.ty.dtype)[()], ArrayType((), like.ty.dtype))


def sum_in_order(b: Builder, parts: list[Var], device: str) -> Var:
    total = parts[0]
    for p in parts[1:]:
        total = b.add1(OPS["add"], [total, p], device)
    return total


def copy_to(b: Builder, x: Var, device: str) -> Var:
    return x if x.device == device else b.add1(OPS["copy_to"], [x], device, device=device)


def near_equal(total: int, parts: int) -> list[int]:
    """Sizes of `parts` contiguous slices of `total`, the first ones one larger.

    >>> near_equal(10, 4)
    [3, 3, 2, 2]
    """
    q, r = divmod(total, parts)
    return [q + (i < r) for i in range(parts)]


def groups_of(devices, num_groups: int) -> list[tuple]:
    """Contiguous near-equal slices of `devices`; fewer groups when there are fewer devices.

    >>> groups_of(("cpu:0", "cpu:1", "cpu:2"), 2)
    [('cpu:0', 'cpu:1'), ('cpu:2',)]
    """
    out, start = [], 0
    for size in near_equal(len(devices), min(num_groups, len(devices))):
        out.append(tuple(devices[start:start + size]))
        start += size
    return out


def _reshaped(b: Builder, x: Var, shape: tuple) -> Var:
    return x if x.ty.shape == shape else b.add1(OPS["reshape"], [x], x.device, shape=shape)


# ---------------------------------------------------------------- the lowerings


@lowering("one_device")
def reduce_to_one_device(b, xs, op, devices, reduce_to_device=None):
    """Copy every replica's value to one device, add them there in device order, copy the
    result back: simple, and the fewest adds; the reducing device's link is the bottleneck."""
    n = len(devices)
    if n == 1:
        return [finish_mean(b, xs[0], 1, devices[0], op)]
    target = reduce_to_device or devices[0]
    parts = [copy_to(b, x, target) for x in xs]
    result = finish_mean(b, sum_in_order(b, parts, target), n, target, op)
    return [copy_to(b, result, dev) for dev in devices]


@lowering("ring")
def ring(b, xs, op, devices, num_chunks=None):
    """Reduce-scatter then all-gather around the device ring, as explicit copy_to/add nodes.

    The flat buffer is cut into n near-equal segments (n devices). Segment c starts on device
    c+1 and travels the ring: each of n-1 steps copies the partial sum to the next device,
    which adds its own slice, so segment c is summed in the order c+1, c+2, ..., c (mod n)
    and ends complete on device c (divided by n there for a mean). n-1 all-gather steps then
    pass every complete segment around the ring; each device concatenates the segments and
    reshapes. Each device sends and receives 2(n-1)/n of the buffer, the bandwidth optimum.

    `num_chunks=k` cuts each segment into k pieces that travel the ring independently, so a
    device can add piece p while piece p+1 is being copied (pipelining, k times more nodes).
    The pieces follow their segment's path, so the bits do not depend on k. Empty segments
    and pieces (a buffer smaller than n*k elements) are skipped.
    """
    n = len(devices)
    size = xs[0].ty.size
    if n == 1 or size == 0:
        return [finish_mean(b, x, 1, dev, op) for x, dev in zip(xs, devices)]
    flats = [_reshaped(b, x, (size,)) for x in xs]
    pieces, start = [], 0          # (segment, start, stop) of every non-empty piece
    for c, seg in enumerate(near_equal(size, n)):
        for length in near_equal(seg, num_chunks or 1):
            if length:
                pieces.append((c, start, start + length))
            start += length
    views = [{p: b.add1(OPS["getitem"], [flats[d]], devices[d],
                        index=(("slice", p[1], p[2], None),)) for p in pieces}
             for d in range(n)]
    partial = {p: views[(p[0] + 1) % n][p] for p in pieces}
    for step in range(n - 1):      # reduce-scatter
        for p in pieces:
            d = (p[0] + 2 + step) % n
            partial[p] = b.add1(OPS["add"], [copy_to(b, partial[p], devices[d]),
                                             views[d][p]], devices[d])
    done = [{} for _ in range(n)]
    for p in pieces:
        done[p[0]][p] = finish_mean(b, partial[p], n, devices[p[0]], op)
    for step in range(n - 1):      # all-gather
        for p in pieces:
            d = (p[0] + 1 + step) % n
            done[d][p] = copy_to(b, done[(d - 1) % n][p], devices[d])
    results = []
    for d, dev in enumerate(devices):
        parts = [done[d][p] for p in pieces]
        flat = parts[0] if len(parts) == 1 else b.add1(OPS["concat"], parts, dev, axis=0)
        results.append(_reshaped(b, flat, xs[d].ty.shape))
    return results


@lowering("hierarchical")
def hierarchical(b, xs, op, devices, num_groups=2):
    """Two levels: each group of devices (contiguous near-equal slices of the device list)
    sums onto its first device in device order; the group leaders exchange their partials
    and each sums all of them in group order (so every leader holds the same bits) and
    divides for a mean; each leader then copies the result to its group."""
    n = len(devices)
    index = {dev: d for d, dev in enumerate(devices)}
    groups = groups_of(devices, num_groups)
    leaders = [group[0] for group in groups]
    partials = [sum_in_order(b, [copy_to(b, xs[index[dev]], group[0]) for dev in group],
                             group[0]) for group in groups]
    totals = {lead: finish_mean(b, sum_in_order(b, [copy_to(b, p, lead) for p in partials],
                                                lead), n, lead, op) for lead in leaders}
    return [copy_to(b, totals[group[0]], dev) for group in groups for dev in group]


@lowering("host")
def host(b, xs, op, devices):
    """One fused `host_all_reduce` node for host (cpu:N) devices: it runs on the first
    device, reads every replica's buffer once and writes every replica's result in a single
    parallel pass (sum in device order), as an NCCL node does on GPUs."""
    _require("HostAllReduce", devices, "cpu", "HostAllReduce runs on host (cpu:N) devices; "
             "use NcclAllReduce or RingAllReduce for GPUs")
    return _fused_node(b, xs, op, devices, "host_all_reduce", (("op", op),))


@lowering("nccl")
def nccl(b, xs, op, devices):
    """One `nccl_all_reduce` node between GPUs: replicas sharing a physical GPU are summed
    there by one kernel, the physical GPUs' partial sums are all-reduced by NCCL."""
    _require("NcclAllReduce", devices, "gpu", "NCCL runs between GPUs; use HostAllReduce or "
             "RingAllReduce for host devices")
    return _fused_node(b, xs, op, devices, "nccl_all_reduce",
                       (("op", op), ("devices", tuple(devices))))


def _fused_node(b: Builder, xs: list[Var], op: str, devices: tuple, name: str,
                params: tuple) -> list[Var]:
    """One node reading every replica's flattened buffer and writing every replica's
    result; each device flattens its input and reshapes its result with views, so no byte
    moves twice."""
    n, size = len(devices), xs[0].ty.size
    if n == 1:
        return [finish_mean(b, xs[0], 1, devices[0], op)]
    flats = [_reshaped(b, x, (size,)) for x in xs]
    outs = tuple(Var(f.ty, None, dev) for f, dev in zip(flats, devices))
    b.eqns.append(Eqn(OPS[name], tuple(flats), outs, params, device=devices[0], scope=b.scope))
    return [_reshaped(b, out, x.ty.shape) for out, x in zip(outs, xs)]


@lowering("mpi")
def mpi(b, xs, op, devices, group, replicas, first):
    """Across worker processes (MultiWorkerMirroredStrategy): one `mpi_all_reduce` node
    sums this worker's replicas in order, all-reduces the partial sums between the workers
    with MPI and writes every local replica's result (a mean divides by every worker's
    replicas)."""
    size = xs[0].ty.size
    flats = [_reshaped(b, x, (size,)) for x in xs]
    outs = tuple(Var(f.ty, None, dev) for f, dev in zip(flats, devices))
    params = (("group", group), ("op", op), ("replicas", replicas))
    b.eqns.append(Eqn(OPS["mpi_all_reduce"], tuple(flats), outs, params, device=devices[0],
                      scope=b.scope))
    return [_reshaped(b, out, x.ty.shape) for out, x in zip(outs, xs)]


def _mpi_node(b: Builder, xs: list, devices: tuple, name: str, params: dict,
              cross_device_ops) -> list:
    """A broadcast or all-gather across worker processes as one node of that name."""
    params = tuple(sorted({**params, "group": cross_device_ops.options()["group"]}.items()))
    types = OPS[name].out_types(*(x.ty for x in xs), **dict(params))
    outs = tuple(Var(ty, None, dev) for ty, dev in zip(types, devices))
    b.eqns.append(Eqn(OPS[name], tuple(xs), outs, params, device=devices[0], scope=b.scope))
    return list(outs)


def _require(who: str, devices, kind: str, hint: str) -> None:
    wrong = [dev for dev in devices if not str(dev).startswith(kind + ":")]
    if wrong:
        raise ValueError(f"{who}: expected only {kind} devices, got "
                         f"{list(devices)} ({', '.join(wrong)} not {kind}); {hint}")
