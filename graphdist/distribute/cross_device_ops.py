"""Cross-device ops: each one is a *lowering* of the logical all_reduce (and broadcast) into
explicit per-device copies and adds in the placed graph, or into one fused collective node
(HostAllReduce, NCCL), so the graph shows what runs.

Every lowering sums in a fixed order, so the same inputs give the same bits every run, and
every replica ends with the same bits (they all receive copies of one result per element).
"""

from __future__ import annotations

import numpy as np

from graphdist.ir import ArrayType, Eqn, Lit, Var
from graphdist.ops import OPS
from graphdist.passes.builder import Builder


class CrossDeviceOps:
    """Base: subclasses implement `all_reduce`; `broadcast` copies from the source."""

    def all_reduce(self, b: Builder, xs: list[Var], op: str, devices: tuple) -> list[Var]:
        """Emit eqns into `b` that leave reduce(xs) on every device; return one Var per device."""
        raise NotImplementedError

    def broadcast(self, b: Builder, xs: list[Var], source: int, devices: tuple) -> list[Var]:
        src = xs[source]
        return [xs[d] if d == source else copy_to(b, src, dev) for d, dev in enumerate(devices)]

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


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
    """Sizes of `parts` contiguous slices of `total`, the first ones one larger."""
    q, r = divmod(total, parts)
    return [q + (i < r) for i in range(parts)]


def _reshaped(b: Builder, x: Var, shape: tuple) -> Var:
    return x if x.ty.shape == shape else b.add1(OPS["reshape"], [x], x.device, shape=shape)


class ReductionToOneDevice(CrossDeviceOps):
    """Copy every replica's value to one device, add them there in device order, copy the
    result back: simple, and the fewest adds; the reducing device's link is the bottleneck."""

    def __init__(self, reduce_to_device: str | None = None):
        self.reduce_to_device = reduce_to_device

    def all_reduce(self, b, xs, op, devices):
        n = len(devices)
        if n == 1:
            return [finish_mean(b, xs[0], 1, devices[0], op)]
        from graphdist.distribute.devices import canonical

        target = canonical(self.reduce_to_device) if self.reduce_to_device else devices[0]
        parts = [copy_to(b, x, target)
                 for x in xs]
        result = finish_mean(b, sum_in_order(b, parts, target), n, target, op)
        return [copy_to(b, result, dev) for dev in devices]

    def __repr__(self) -> str:
        return f"ReductionToOneDevice(reduce_to_device={self.reduce_to_device!r})"


class RingAllReduce(CrossDeviceOps):
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

    def __init__(self, num_chunks: int | None = None):
        if num_chunks is not None and int(num_chunks) < 1:
            raise ValueError(f"RingAllReduce: num_chunks must be >= 1, got {num_chunks}")
        self.num_chunks = None if num_chunks is None else int(num_chunks)

    def all_reduce(self, b, xs, op, devices):
        n = len(devices)
        size = xs[0].ty.size
        if n == 1 or size == 0:
            return [finish_mean(b, x, 1, dev, op) for x, dev in zip(xs, devices)]
        flats = [_reshaped(b, x, (size,)) for x in xs]
        pieces, start = [], 0          # (segment, start, stop) of every non-empty piece
        for c, seg in enumerate(near_equal(size, n)):
            for length in near_equal(seg, self.num_chunks or 1):
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

    def __repr__(self) -> str:
        return f"RingAllReduce(num_chunks={self.num_chunks!r})"


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


class HierarchicalCopyAllReduce(CrossDeviceOps):
    """Two levels: each group of devices (contiguous near-equal slices of the device list)
    sums onto its first device in device order; the group leaders exchange their partials
    and each sums all of them in group order (so every leader holds the same bits) and
    divides for a mean; each leader then copies the result to its group."""

    def __init__(self, num_groups: int = 2):
        if int(num_groups) < 1:
            raise ValueError(f"HierarchicalCopyAllReduce: num_groups must be >= 1, "
                             f"got {num_groups}")
        self.num_groups = int(num_groups)

    def all_reduce(self, b, xs, op, devices):
        n = len(devices)
        index = {dev: d for d, dev in enumerate(devices)}
        groups = groups_of(devices, self.num_groups)
        leaders = [group[0] for group in groups]
        partials = [sum_in_order(b, [copy_to(b, xs[index[dev]], group[0]) for dev in group],
                                 group[0]) for group in groups]
        totals = {lead: finish_mean(b, sum_in_order(b, [copy_to(b, p, lead) for p in partials],
                                                    lead), n, lead, op) for lead in leaders}
        return [copy_to(b, totals[group[0]], dev) for group in groups for dev in group]

    def __repr__(self) -> str:
        return f"HierarchicalCopyAllReduce(num_groups={self.num_groups})"


class HostAllReduce(CrossDeviceOps):
    """One fused `host_all_reduce` node for host (cpu:N) devices: it runs on the first
    device, reads every replica's buffer once and writes every replica's result in a single
    parallel Numba pass (sum in device order), like an NCCL node does on GPUs. Each device
    flattens its input and reshapes its result with views, so no byte moves twice."""

    def all_reduce(self, b, xs, op, devices):
        _require(self, devices, "cpu", "HostAllReduce runs on host (cpu:N) devices; use "
                 "NcclAllReduce or RingAllReduce for GPUs")
        return _fused_node(b, xs, op, devices, "host_all_reduce", (("op", op),))


class NcclAllReduce(CrossDeviceOps):
    """One `nccl_all_reduce` node per all-reduce between GPUs: replicas sharing a physical
    GPU are summed there by one kernel, the physical GPUs' partial sums are all-reduced by
    NCCL (graphdist/runtime/gpu_collectives.py). Constructible anywhere; lowering onto a
    device that is not a GPU raises ValueError."""

    def all_reduce(self, b, xs, op, devices):
        _require(self, devices, "gpu", "NCCL runs between GPUs; use HostAllReduce or "
                 "RingAllReduce for host devices")
        return _fused_node(b, xs, op, devices, "nccl_all_reduce",
                           (("op", op), ("devices", tuple(devices))))


def _fused_node(b: Builder, xs: list[Var], op: str, devices: tuple, name: str,
                params: tuple) -> list[Var]:
    """One node reading every replica's flattened buffer and writing every replica's
    result; each device flattens its input and reshapes its result with views."""
    n, size = len(devices), xs[0].ty.size
    if n == 1:
        return [finish_mean(b, xs[0], 1, devices[0], op)]
    flats = [_reshaped(b, x, (size,)) for x in xs]
    outs = tuple(Var(f.ty, None, dev) for f, dev in zip(flats, devices))
    b.eqns.append(Eqn(OPS[name], tuple(flats), outs, params, device=devices[0], scope=b.scope))
    return [_reshaped(b, out, x.ty.shape) for out, x in zip(outs, xs)]


def _require(ops, devices, kind: str, hint: str) -> None:
    wrong = [dev for dev in devices if not str(dev).startswith(kind + ":")]
    if wrong:
        raise ValueError(f"{type(ops).__name__}: expected only {kind} devices, got "
                         f"{list(devices)} ({', '.join(wrong)} not {kind}); {hint}")


def choose_cross_device_ops(devices) -> CrossDeviceOps:
    """What `cross_device_ops=None` means for these devices: the fused one-pass
    HostAllReduce when all are host devices (fastest on CPU, see docs/benchmarks.md),
    NcclAllReduce when all are GPUs (logical GPUs sharing a physical one are summed there
    by one kernel), else ReductionToOneDevice.

    >>> choose_cross_device_ops(["cpu:0", "cpu:1"])
    HostAllReduce()
    """
    from graphdist.distribute.devices import device_kind

    kinds = {device_kind(dev) for dev in devices}
    if kinds == {"cpu"}:
        return HostAllReduce()
    if kinds == {"gpu"}:
        return NcclAllReduce()
    return ReductionToOneDevice()
